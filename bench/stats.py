"""Per-request results of a load run and their aggregates: TTFT, TPOT, ITL, end-to-end percentiles, throughput,
goodput under SLOs, errors by status.

Definitions (those of vLLM's `benchmark_serving`, so numbers compare across servers):
- TTFT: request sent → first streamed chunk with content.
- TPOT: (end-to-end − TTFT) / (output tokens − 1), per request; undefined for one-token answers.
- ITL: the gaps between successive content chunks, pooled over all requests (one token per chunk on servers that
  stream token by token: ours, vLLM, SGLang, llama.cpp).
- goodput: requests/s that succeeded *and* met every SLO given (TTFT and TPOT, each per request: `meets_slo`, with
  the simulator's `partitioner.simulate.workload.Slo`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from partitioner.simulate.workload import Slo

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds on the load generator's clock."""

    sent_s: float
    status: int  # HTTP status; 0 when the connection failed before any status
    num_prompt_tokens: int = 0  # from the server's usage; 0 when not reported
    num_output_tokens: int = 0  # from usage, else the number of content chunks
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    usage_reported: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """Succeeded, within every objective of `slo` (a one-token answer has no TPOT to judge)."""
    return result.ok and slo.met(result.ttft_s, result.tpot_s)


def percentiles(values: Sequence[float], qs: Sequence[int] = PERCENTILES) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ...} by linear interpolation (numpy's default); NaN when empty."""
    if not values:
        return {f"p{q}": math.nan for q in qs}
    found = np.percentile(np.asarray(values, dtype=float), qs)
    return {f"p{q}": float(v) for q, v in zip(qs, found, strict=True)}


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The sample nearest to quantile `q` (0..1) of `values`, no interpolation (the overhead benchmarks' p50/p99)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ms(values: Sequence[float]) -> dict[str, float]:
    stats = {k: v * 1e3 for k, v in percentiles(values).items()}
    stats["mean"] = float(np.mean(values)) * 1e3 if values else math.nan
    return stats


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo | None = None) -> dict[str, object]:
    """The aggregate numbers of one run over `duration_s` (first send of a measured request → last finish)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slo = slo or Slo()
    ok = [r for r in results if r.ok]
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    num_good = sum(meets_slo(r, slo) for r in results)
    errors = Counter(str(r.status) for r in results if not r.ok)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "duration_s": duration_s,
        "request_per_s": len(ok) / duration_s,
        "output_tok_per_s": num_output / duration_s,
        "prompt_tok_per_s": num_prompt / duration_s,
        "mean_prompt_tokens": num_prompt / len(ok) if ok else math.nan,
        "mean_output_tokens": num_output / len(ok) if ok else math.nan,
        "goodput_req_per_s": num_good / duration_s,
        "slo_attainment": num_good / len(results) if results else math.nan,
        "ttft_ms": _ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": _ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "prefill_tok_per_s": prefill_rate(ok),
        "errors": dict(errors),
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
    }


def prefill_rate(results: Sequence[RequestResult]) -> float:
    """Prompt tokens per second of TTFT, summed over requests: at low load (no queueing) the replica's prefill speed;
    under load a lower bound. NaN without prompt-token counts."""
    timed = [(r.num_prompt_tokens, r.ttft_s) for r in results if r.ttft_s and r.num_prompt_tokens]
    if not timed:
        return math.nan
    return sum(n for n, _ in timed) / sum(t for _, t in timed)
