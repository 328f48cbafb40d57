"""`multiserve bench plot`: PNG charts from history records — latency CDFs (TTFT, TPOT, end to end) per run, and
output throughput and goodput against offered load (request rate, or concurrency for closed-loop runs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt  # after choosing the backend

CDF_PANELS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2e_ms", "end-to-end latency (ms)"))


def run_label(record: Mapping[str, Any]) -> str:
    tag = record.get("tag")
    load = record.get("load", {}).get("label", "?")
    return f"{tag} {load}" if tag else f"{record.get('workload')} {load}"


def offered_load(record: Mapping[str, Any]) -> float:
    """The x of a load curve: requests/s offered, or the concurrency of a closed loop."""
    load = record.get("load", {})
    return float(load.get("rate_per_s") or load.get("concurrency") or 0)


def plot_cdfs(records: Sequence[Mapping[str, Any]], path: Path) -> Path:
    fig, axes = plt.subplots(1, len(CDF_PANELS), figsize=(5 * len(CDF_PANELS), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], CDF_PANELS, strict=True):
        for record in records:
            values = sorted(record.get("samples", {}).get(key, []))
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                        label=run_label(record))
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_load_curves(records: Sequence[Mapping[str, Any]], path: Path) -> Path:
    closed = all(r.get("load", {}).get("rate_per_s") is None for r in records)
    xlabel = "concurrency (closed loop)" if closed else "offered load (requests/s)"
    series: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:  # one line per tag (or workload): e.g. prefix caching on vs off
        series.setdefault(str(record.get("tag") or record.get("workload")), []).append(record)
    fig, (tput, good) = plt.subplots(1, 2, figsize=(11, 4))
    for name, group in series.items():
        group = sorted(group, key=offered_load)
        xs = [offered_load(r) for r in group]
        tput.plot(xs, [r["results"]["output_tok_per_s"] for r in group], marker="o", label=name)
        good.plot(xs, [r["results"]["goodput_req_per_s"] for r in group], marker="o", label=f"{name} goodput")
        good.plot(xs, [r["results"]["request_per_s"] for r in group], marker="x", linestyle="--",
                  label=f"{name} completed")
    tput.set(xlabel=xlabel, ylabel="output tokens/s", title="throughput vs load")
    good.set(xlabel=xlabel, ylabel="requests/s", title="goodput (within SLOs) vs load")
    for ax in (tput, good):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_runs(records: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """latency_cdf.png and load_curves.png for `records` in `out_dir` (created). Raises ValueError when empty."""
    if not records:
        raise ValueError("no history records to plot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plot_cdfs(records, out / "latency_cdf.png"), plot_load_curves(records, out / "load_curves.png")]
