"""When requests arrive (offsets in seconds from the start), and a trace's request lengths (token counts).

Every generator takes its `random.Random` from the caller, so a seed reproduces a run's schedule exactly.

Arrivals:
- `poisson`: exponential gaps at `rate_per_s` (memoryless traffic from many independent users).
- `gamma`: gamma gaps with mean 1/rate and coefficient of variation `cv` (cv 1 is Poisson; cv > 1 is bursty, as
  vLLM's `--burstiness` = 1/cv²).
- `constant`: evenly spaced.
- a trace: offsets taken from a JSONL file (see `load_trace`).

Drawn lengths are `partitioner.simulate.workload.LengthDist`s, the simulator's too (`bench.workloads.parse_length`
reads them from the command line); a trace has its own counts.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ARRIVALS = ("poisson", "gamma", "constant")


def arrival_offsets(kind: str, rate_per_s: float, count: int, rng: random.Random, cv: float = 1.0) -> list[float]:
    """`count` arrival offsets (s, non-decreasing, the first at its first gap) at a mean `rate_per_s`."""
    if rate_per_s <= 0 or not math.isfinite(rate_per_s):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate_per_s}")
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}; known: {', '.join(ARRIVALS)}")
    mean_gap_s = 1.0 / rate_per_s
    if kind == "constant":
        return [mean_gap_s * (i + 1) for i in range(count)]
    if kind == "poisson":
        gaps = [rng.expovariate(rate_per_s) for _ in range(count)]
    else:
        if cv <= 0:
            raise ValueError(f"gamma arrivals need a coefficient of variation > 0, got {cv}")
        shape = 1.0 / cv**2  # gamma: CV = 1/sqrt(shape); mean = shape * scale
        gaps = [rng.gammavariate(shape, mean_gap_s / shape) for _ in range(count)]
    offsets, now = [], 0.0
    for gap in gaps:
        now += gap
        offsets.append(now)
    return offsets


@dataclass(frozen=True)
class TraceEntry:
    offset_s: float
    num_prompt_tokens: int
    num_output_tokens: int


def load_trace(path: str | Path) -> list[TraceEntry]:
    """A JSONL trace, one request a line: `{"timestamp": s, "prompt_tokens": n, "output_tokens": n}`. Timestamps
    are absolute or relative; offsets are taken from the first. The gateway's traffic log
    (gateway/traffic.py: `start_s`) is read the same way. Raises ValueError naming the line at fault."""
    entries = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            stamp = float(row["timestamp"] if "timestamp" in row else row["start_s"])
            entries.append(TraceEntry(stamp, int(row["prompt_tokens"]), int(row["output_tokens"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:{number}: a trace line needs timestamp (or start_s), prompt_tokens and "
                             f"output_tokens: {err!r}") from None
    if not entries:
        raise ValueError(f"{path}: the trace is empty")
    entries.sort(key=lambda e: e.offset_s)
    first = entries[0].offset_s
    return [TraceEntry(e.offset_s - first, max(e.num_prompt_tokens, 1), max(e.num_output_tokens, 1))
            for e in entries]


def measured_rate(offsets: Sequence[float]) -> float:
    """Arrivals per second over a schedule (count / last offset): what a generator actually delivered."""
    if not offsets or offsets[-1] <= 0:
        raise ValueError("a rate needs at least one arrival after time 0")
    return len(offsets) / offsets[-1]
