"""`multiserve bench compare`: one run against earlier runs of the same configuration, regressions flagged.

How noise is judged: the baseline is the median of the last N earlier runs with the same configuration key
(model, endpoint, workload, lengths, load level, tag; `history.config_key`). A metric regresses when it is worse
than the baseline by more than a noise band. The band is the larger of
- `threshold` (default 10 %): the floor, and all there is with one or two earlier runs; and
- 3 × the baseline runs' own relative spread (1.4826 × median absolute deviation / median, a robust σ), once
  there are 3 or more: a configuration that wobbles run to run on a shared machine earns a wider band.
So a metric is flagged only when it moved further than the same configuration has been seen to move by itself.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.history import config_key

# (path in record["results"], higher is better)
METRICS: tuple[tuple[str, bool], ...] = (
    ("output_tok_per_s", True), ("request_per_s", True), ("goodput_req_per_s", True),
    ("ttft_ms.p50", False), ("ttft_ms.p99", False), ("tpot_ms.p50", False), ("tpot_ms.p99", False),
    ("itl_ms.p50", False), ("e2e_ms.p50", False), ("e2e_ms.p99", False),
)
MIN_RUNS_FOR_SPREAD = 3
SPREAD_FACTOR = 3.0


@dataclass(frozen=True)
class Row:
    metric: str
    baseline: float
    current: float
    change: float  # relative, signed: + means the number went up
    band: float  # relative noise band
    verdict: str  # "ok" | "REGRESSION" | "improved" | "n/a"


def metric_value(record: Mapping[str, Any], path: str) -> float:
    value: Any = record.get("results", {})
    for part in path.split("."):
        value = value.get(part, math.nan) if isinstance(value, Mapping) else math.nan
    return float(value) if isinstance(value, int | float) else math.nan


def noise_band(values: Sequence[float], threshold: float) -> float:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < MIN_RUNS_FOR_SPREAD:
        return threshold
    center = statistics.median(finite)
    if center == 0:
        return threshold
    mad = statistics.median(abs(v - center) for v in finite)
    return max(threshold, SPREAD_FACTOR * 1.4826 * mad / abs(center))


def compare(current: Mapping[str, Any], baselines: Sequence[Mapping[str, Any]], threshold: float = 0.10) -> list[Row]:
    rows = []
    for path, higher_better in METRICS:
        values = [metric_value(b, path) for b in baselines]
        finite = [v for v in values if math.isfinite(v)]
        now = metric_value(current, path)
        if not finite or not math.isfinite(now):
            rows.append(Row(path, math.nan, now, math.nan, math.nan, "n/a"))
            continue
        base = statistics.median(finite)
        change = (now - base) / abs(base) if base else math.inf if now != base else 0.0
        band = noise_band(values, threshold)
        worse = -change if higher_better else change
        verdict = "REGRESSION" if worse > band else "improved" if -worse > band else "ok"
        rows.append(Row(path, base, now, change, band, verdict))
    return rows


def baselines_for(records: Sequence[Mapping[str, Any]], current: Mapping[str, Any],
                  last: int) -> list[Mapping[str, Any]]:
    """The last `last` records before `current` with the same configuration key."""
    key = config_key(current)
    earlier = []
    for record in records:
        if record is current or record.get("run_id") == current.get("run_id"):
            break
        if config_key(record) == key:
            earlier.append(record)
    return earlier[-last:]


def format_table(current: Mapping[str, Any], baselines: Sequence[Mapping[str, Any]], rows: Sequence[Row]) -> str:
    ids = ", ".join(str(b.get("run_id")) for b in baselines)
    head = [f"run {current.get('run_id')} ({current.get('time')}, commit {str(current.get('commit'))[:10]}) "
            f"vs median of {len(baselines)} earlier run(s): {ids}",
            "| metric | baseline | current | change | noise band | verdict |", "|---|---|---|---|---|---|"]
    body = [f"| {r.metric} | {r.baseline:.2f} | {r.current:.2f} | {r.change:+.1%} | ±{r.band:.0%} | {r.verdict} |"
            if r.verdict != "n/a" else f"| {r.metric} | - | {r.current:.2f} | - | - | n/a |" for r in rows]
    return "\n".join(head + body)
