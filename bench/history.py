"""The benchmark history: one JSON line per measured load level (commit, machine, config, workload, numbers and a
bounded sample of per-request latencies for CDFs), appended so that later runs can be compared against it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import subprocess
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.stats import RequestResult

DEFAULT_HISTORY = Path(".multiserve/bench/history.jsonl")
SCHEMA_VERSION = 2  # 2: `lengths` name each distribution's own parameters (`LengthDist.parameters`)
MAX_SAMPLES = 2000  # per latency list: enough for a smooth CDF, small enough to keep a line under ~100 kB


def git_commit(cwd: Path | None = None) -> dict[str, Any]:
    """{"commit": HEAD or None, "dirty": uncommitted changes to tracked files}; None where git is absent."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}


def machine_info() -> dict[str, Any]:
    return {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def latency_samples(results: Sequence[RequestResult], rng: random.Random) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and end-to-end (ms) of the successful requests, down-sampled to MAX_SAMPLES each."""
    ok = [r for r in results if r.ok]
    lists = {"ttft_ms": [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None],
             "tpot_ms": [t * 1e3 for r in ok if (t := r.tpot_s) is not None],
             "e2e_ms": [r.e2e_s * 1e3 for r in ok if r.e2e_s is not None]}
    return {k: sorted(rng.sample(v, MAX_SAMPLES) if len(v) > MAX_SAMPLES else v) for k, v in lists.items()}


def make_record(config: Mapping[str, Any], summary: Mapping[str, Any], samples: Mapping[str, list[float]],
                now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.timezone.utc),
                ) -> dict[str, Any]:
    """One history line. `config` holds target, workload, load, slo, seed, tag and sweep_id."""
    return {"schema": SCHEMA_VERSION, "run_id": uuid.uuid4().hex[:12], "time": now().isoformat(timespec="seconds"),
            **git_commit(), "machine": machine_info(), **config, "results": dict(summary),
            "samples": dict(samples)}


def append(path: str | Path, record: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(record, allow_nan=True) + "\n")


def load(path: str | Path) -> list[dict[str, Any]]:
    """Every record, oldest first. Raises ValueError naming a line that is not JSON."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a history record: {err}") from None
    return records


def config_key(record: Mapping[str, Any]) -> tuple[str, ...]:
    """What must match for two records to be comparable: model, endpoint, workload, lengths (as drawn:
    `lengths_key`), load and tag."""
    target, load_cfg = record.get("target", {}), record.get("load", {})
    return (str(target.get("model")), str(target.get("endpoint")), str(record.get("workload")),
            lengths_key(record), str(load_cfg.get("label")), str(record.get("tag")))


def lengths_key(record: Mapping[str, Any]) -> str:
    """A record's `lengths` (per workload component: weight, prompt and output distributions; or "trace") by what
    the distributions draw, so that records of schema 1 compare with later ones: those wrote every field of a
    distribution, `mean` standing for a fixed length's value and for a lognormal's median, and a fixed length's
    upper bound (which never clamped it) as 2^20 or as the length itself."""
    lengths, schema = record.get("lengths"), record.get("schema", 1)
    if not isinstance(lengths, list):
        return json.dumps(lengths, sort_keys=True)
    return json.dumps([{**c, "prompt": _drawn(c.get("prompt"), schema), "output": _drawn(c.get("output"), schema)}
                       if isinstance(c, dict) else c for c in lengths], sort_keys=True)


def _drawn(dist: Any, schema: Any) -> Any:
    if not isinstance(dist, dict):
        return dist
    if schema == 1:
        dist = {**dist, "value": dist.get("mean"), "median": dist.get("mean"), "mean": None}
    kind, value, low, high = dist.get("kind"), dist.get("value"), dist.get("low", 1), dist.get("high")
    if kind == "fixed" and isinstance(value, int | float) and isinstance(low, int) and isinstance(high, int | None):
        return ["fixed", max(value, low) if high is None else min(max(value, low), high)]
    if kind == "uniform":
        return ["uniform", low, high]
    if kind == "lognormal":
        return ["lognormal", dist.get("median"), dist.get("mean"), dist.get("sigma"), low, high]
    return dist


def find(records: Sequence[Mapping[str, Any]], run_id: str) -> Mapping[str, Any]:
    """The record whose run_id starts with `run_id`. Raises KeyError listing the latest ids when none does."""
    matches = [r for r in records if str(r.get("run_id", "")).startswith(run_id)]
    if len(matches) != 1:
        latest = ", ".join(str(r.get("run_id")) for r in records[-5:])
        raise KeyError(f"run {run_id!r} matches {len(matches)} records; latest runs: {latest}")
    return matches[0]
