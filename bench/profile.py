"""`multiserve profile --traffic FILE`: what the gateway's traffic log (gateway/traffic.py) says about demand —
prompt and output lengths, requests/s over time (peaks and troughs), and concurrent tokens, the KV cache they need.

Concurrent-token demand counts each request's prompt + output tokens as held in the KV cache from its start to its
end (an upper bound: output blocks fill during decode). Its peak and its time-weighted p99 are reported.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.stats import percentiles
from partitioner.planning.demand import ModelShape

GIB = 1 << 30
OUTPUT_BUCKETS = (16, 64, 256, 1024, 4096)  # upper bounds of the output-length histogram


@dataclass(frozen=True)
class TrafficProfile:
    num_requests: int
    span_s: float
    prompt_tokens: dict[str, float]  # p50, p95, p99, mean, max
    output_tokens: dict[str, float]
    output_histogram: dict[str, int]  # "<=16": count, ..., ">4096": count
    bucket_s: float
    rate_per_s: list[float]  # requests/s in each bucket of bucket_s, from the first start
    peak_rate_per_s: float
    trough_rate_per_s: float
    peak_concurrent_tokens: int
    p99_concurrent_tokens: float  # time-weighted
    peak_concurrent_requests: int
    lanes: dict[str, int]
    models: dict[str, int]


def traffic_files(path: str | Path) -> list[Path]:
    """The log and its rotated copies, oldest first (path.N … path.1, path)."""
    path = Path(path)
    rotated = sorted((p for p in path.parent.glob(f"{path.name}.*") if p.suffix[1:].isdigit()),
                     key=lambda p: int(p.suffix[1:]), reverse=True)
    return rotated + ([path] if path.exists() else [])


def load_traffic(path: str | Path) -> list[dict[str, Any]]:
    """Records with both token counts and status 200 (what shaped the load), from the log and its rotations."""
    files = traffic_files(path)
    if not files:
        raise ValueError(f"{path}: no traffic log (set gateway.traffic.path in the registry to record one)")
    rows = []
    for file in files:
        for number, line in enumerate(file.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}:{number}: not a traffic record: {err}") from None
            if row.get("status") == 200 and row.get("prompt_tokens") is not None and row.get("output_tokens"):
                rows.append(row)
    return rows


def _dist(values: Sequence[float]) -> dict[str, float]:
    stats = percentiles(values, (50, 95, 99))
    stats.update(mean=float(np.mean(values)) if values else math.nan, max=float(max(values, default=math.nan)))
    return stats


def _histogram(values: Sequence[int]) -> dict[str, int]:
    counts = Counter(next((f"<={b}" for b in OUTPUT_BUCKETS if v <= b), f">{OUTPUT_BUCKETS[-1]}") for v in values)
    return {label: counts[label] for label in [f"<={b}" for b in OUTPUT_BUCKETS] + [f">{OUTPUT_BUCKETS[-1]}"]}


def rate_buckets(starts: Sequence[float], bucket_s: float) -> list[float]:
    """Requests/s per `bucket_s` window from the first start (the last, partial window over its own length)."""
    first, last = min(starts), max(starts)
    num_buckets = max(1, math.floor((last - first) / bucket_s) + 1)
    counts = [0] * num_buckets
    for start in starts:
        counts[min(int((start - first) / bucket_s), num_buckets - 1)] += 1
    tail_s = (last - first) - (num_buckets - 1) * bucket_s
    widths = [bucket_s] * (num_buckets - 1) + [max(tail_s, min(bucket_s, 1.0))]
    return [c / w for c, w in zip(counts, widths, strict=True)]


def concurrent_demand(rows: Sequence[dict[str, Any]]) -> tuple[int, float, int]:
    """(peak tokens, time-weighted p99 tokens, peak requests) held at once; a request holds prompt + output."""
    events = []
    for row in rows:
        tokens = int(row["prompt_tokens"]) + int(row["output_tokens"])
        events += [(float(row["start_s"]), 1, tokens), (float(row["end_s"]), -1, -tokens)]
    events.sort(key=lambda e: (e[0], e[1]))  # at equal times, ends before starts: a freed slot is reused
    tokens = requests = peak_tokens = peak_requests = 0
    levels, durations = [], []
    for (time_s, step, delta), nxt in zip(events, [*events[1:], None], strict=True):
        tokens, requests = tokens + delta, requests + step
        peak_tokens, peak_requests = max(peak_tokens, tokens), max(peak_requests, requests)
        if nxt is not None and nxt[0] > time_s:
            levels.append(tokens)
            durations.append(nxt[0] - time_s)
    if not levels:
        return peak_tokens, float(peak_tokens), peak_requests
    order = np.argsort(levels)
    cumulative = np.cumsum(np.asarray(durations)[order]) / sum(durations)
    p99 = float(np.asarray(levels)[order][np.searchsorted(cumulative, 0.99)])
    return peak_tokens, p99, peak_requests


def build_profile(rows: Sequence[dict[str, Any]], bucket_s: float = 60.0) -> TrafficProfile:
    if not rows:
        raise ValueError("no complete requests (status 200 with token counts) in the traffic log")
    starts = [float(r["start_s"]) for r in rows]
    rates = rate_buckets(starts, bucket_s)
    outputs = [int(r["output_tokens"]) for r in rows]
    peak, p99, peak_requests = concurrent_demand(rows)
    return TrafficProfile(
        num_requests=len(rows), span_s=max(float(r["end_s"]) for r in rows) - min(starts),
        prompt_tokens=_dist([int(r["prompt_tokens"]) for r in rows]), output_tokens=_dist(outputs),
        output_histogram=_histogram(outputs), bucket_s=bucket_s, rate_per_s=rates, peak_rate_per_s=max(rates),
        trough_rate_per_s=min(rates), peak_concurrent_tokens=peak, p99_concurrent_tokens=p99,
        peak_concurrent_requests=peak_requests, lanes=dict(Counter(str(r.get("lane")) for r in rows)),
        models=dict(Counter(str(r.get("model")) for r in rows)))


def format_profile(profile: TrafficProfile, shape: ModelShape | None = None) -> str:
    p, o = profile.prompt_tokens, profile.output_tokens
    lines = [
        f"{profile.num_requests} requests over {profile.span_s:.0f} s; models {profile.models}; lanes {profile.lanes}",
        f"prompt tokens  p50 {p['p50']:.0f}  p95 {p['p95']:.0f}  p99 {p['p99']:.0f}  mean {p['mean']:.0f}  "
        f"max {p['max']:.0f}",
        f"output tokens  p50 {o['p50']:.0f}  p95 {o['p95']:.0f}  p99 {o['p99']:.0f}  mean {o['mean']:.0f}  "
        f"max {o['max']:.0f}",
        "output length histogram: " + ", ".join(f"{k}: {v}" for k, v in profile.output_histogram.items()),
        f"requests/s per {profile.bucket_s:g} s: peak {profile.peak_rate_per_s:.2f}, trough "
        f"{profile.trough_rate_per_s:.2f}, over time: " + " ".join(f"{r:.2f}" for r in profile.rate_per_s[:60])
        + (" …" if len(profile.rate_per_s) > 60 else ""),
        f"concurrent demand: peak {profile.peak_concurrent_requests} requests, peak {profile.peak_concurrent_tokens} "
        f"tokens, p99 (time-weighted) {profile.p99_concurrent_tokens:.0f} tokens",
    ]
    if shape is not None:
        per_token = shape.kv_bytes_per_token
        peak_gib = profile.peak_concurrent_tokens * per_token / GIB
        lines.append(f"implied KV cache ({per_token} B/token): peak {peak_gib:.3f} GiB, "
                     f"p99 {profile.p99_concurrent_tokens * per_token / GIB:.3f} GiB")
    return "\n".join(lines)
