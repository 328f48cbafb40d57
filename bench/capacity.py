"""`multiserve plan-capacity`: replicas and KV memory for a traffic profile, from a model's shape and one replica's
measured prefill and decode token rates.

The arithmetic, all at the profile's peak request rate R (mean prompt P and output O tokens per request):
- prefill work  = R × P tokens/s; one replica prefills `prefill_tok_per_s` → prefill share f_p = R·P / rate_p;
- decode work   = R × O tokens/s; one replica decodes `decode_tok_per_s` within the TPOT SLO → f_d = R·O / rate_d;
- co-located replicas = ceil((f_p + f_d) × (1 + headroom)); disaggregated: ceil(f_p × (1 + h)) prefill and
  ceil(f_d × (1 + h)) decode replicas, a prefill:decode split of f_p : f_d;
- KV per replica = peak concurrent tokens / replicas, rounded up to whole blocks, × 2 × layers × kv_heads ×
  head_dim × dtype bytes (`partitioner.planning.demand.ModelShape.kv_bytes_per_token`) × (1 + headroom).

Rates come from bench history records of the model: prefill from `prefill_tok_per_s` (prompt tokens per second of
TTFT; the best, i.e. least queued, run), decode from `output_tok_per_s` of the best run whose TPOT p90 met the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.profile import GIB, TrafficProfile
from partitioner.planning.demand import ModelShape


@dataclass(frozen=True)
class ReplicaRates:
    prefill_tok_per_s: float
    decode_tok_per_s: float
    prefill_run: str  # run ids the rates came from
    decode_run: str


@dataclass(frozen=True)
class CapacityPlan:
    peak_rate_per_s: float
    prefill_share: float  # replicas' worth of prefill work at the peak
    decode_share: float
    replicas: int  # co-located (each replica prefills and decodes)
    prefill_replicas: int  # disaggregated
    decode_replicas: int
    kv_tokens_per_replica: int
    kv_bytes_per_replica: int
    p99_prefill_s: float  # a p99-long prompt's prefill alone, on an idle replica
    warnings: tuple[str, ...]


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def rates_from_history(records: Sequence[Mapping[str, Any]], model: str, slo_tpot_ms: float | None) -> ReplicaRates:
    """The replica's prefill and decode rates from bench records of `model`. Raises ValueError when none qualify."""
    mine = [r for r in records if r.get("target", {}).get("model") == model]
    prefill = [(v, r) for r in mine if (v := _finite(r["results"].get("prefill_tok_per_s")))]
    decode = [(v, r) for r in mine if (v := _finite(r["results"].get("output_tok_per_s")))
              and (slo_tpot_ms is None or (_finite(r["results"]["tpot_ms"].get("p90")) or math.inf) <= slo_tpot_ms)]
    if not prefill or not decode:
        raise ValueError(f"no bench record of model {model!r} gives a prefill rate and a decode rate"
                         + (f" within TPOT p90 <= {slo_tpot_ms:g} ms" if slo_tpot_ms is not None else "")
                         + f" ({len(mine)} record(s) of it); run `multiserve bench --model {model}` at a few loads")
    best_prefill, best_decode = max(prefill, key=lambda x: x[0]), max(decode, key=lambda x: x[0])
    return ReplicaRates(best_prefill[0], best_decode[0], str(best_prefill[1].get("run_id")),
                        str(best_decode[1].get("run_id")))


def plan_capacity(profile: TrafficProfile, shape: ModelShape, rates: ReplicaRates, headroom: float = 0.2,
                  block_size: int = 16, slo_ttft_ms: float | None = None) -> CapacityPlan:
    if headroom < 0:
        raise ValueError(f"headroom must be >= 0, got {headroom}")
    peak = profile.peak_rate_per_s
    prefill_share = peak * profile.prompt_tokens["mean"] / rates.prefill_tok_per_s
    decode_share = peak * profile.output_tokens["mean"] / rates.decode_tok_per_s
    grow = 1.0 + headroom
    replicas = max(1, math.ceil((prefill_share + decode_share) * grow))
    per_replica = math.ceil(profile.peak_concurrent_tokens / replicas / block_size) * block_size
    p99_prefill_s = profile.prompt_tokens["p99"] / rates.prefill_tok_per_s
    warnings = []
    if slo_ttft_ms is not None and p99_prefill_s * 1e3 > slo_ttft_ms:
        warnings.append(f"a p99 prompt ({profile.prompt_tokens['p99']:.0f} tokens) takes {p99_prefill_s * 1e3:.0f} ms"
                        f" to prefill on an idle replica: the TTFT SLO of {slo_ttft_ms:g} ms cannot hold for it at "
                        f"any replica count (prefill is not split across replicas)")
    return CapacityPlan(
        peak_rate_per_s=peak, prefill_share=prefill_share, decode_share=decode_share, replicas=replicas,
        prefill_replicas=max(1, math.ceil(prefill_share * grow)),
        decode_replicas=max(1, math.ceil(decode_share * grow)),
        kv_tokens_per_replica=per_replica,
        kv_bytes_per_replica=math.ceil(per_replica * shape.kv_bytes_per_token * grow),
        p99_prefill_s=p99_prefill_s, warnings=tuple(warnings))


def format_plan(plan: CapacityPlan, rates: ReplicaRates, shape: ModelShape, profile: TrafficProfile) -> str:
    total = plan.prefill_share + plan.decode_share
    lines = [
        f"peak load {plan.peak_rate_per_s:.2f} req/s × {profile.prompt_tokens['mean']:.0f} prompt + "
        f"{profile.output_tokens['mean']:.0f} output tokens (means)",
        f"one replica: prefill {rates.prefill_tok_per_s:.0f} tok/s (run {rates.prefill_run}), decode "
        f"{rates.decode_tok_per_s:.0f} tok/s within the TPOT SLO (run {rates.decode_run})",
        f"work at peak: prefill {plan.prefill_share:.2f} + decode {plan.decode_share:.2f} replica(s)",
        f"replicas (co-located prefill and decode): {plan.replicas}",
        f"disaggregated: {plan.prefill_replicas} prefill + {plan.decode_replicas} decode "
        f"(prefill:decode = {plan.prefill_share / total:.0%}:{plan.decode_share / total:.0%} of the work)",
        f"KV cache per replica: {plan.kv_tokens_per_replica} tokens of the peak {profile.peak_concurrent_tokens} × "
        f"{shape.kv_bytes_per_token} B/token + headroom = {plan.kv_bytes_per_replica / GIB:.3f} GiB "
        f"(engine.kv_cache_gib: {math.ceil(plan.kv_bytes_per_replica / GIB * 100) / 100:.2f})",
        f"a p99 prompt's prefill on an idle replica: {plan.p99_prefill_s * 1e3:.0f} ms",
    ]
    return "\n".join(lines + [f"warning: {w}" for w in plan.warnings])
