"""The traffic profile (lengths, load over time, concurrent tokens) and the capacity plan built on it."""

import json
import math

import pytest

from bench.capacity import ReplicaRates, plan_capacity, rates_from_history
from bench.profile import build_profile, concurrent_demand, load_traffic, rate_buckets
from partitioner.planning.demand import ModelShape

SHAPE = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, weights_bytes=0, kv_dtype_bytes=2)  # 23040 B/token


def row(start_s: float, end_s: float, prompt: int, output: int, **extra) -> dict:
    return {"start_s": start_s, "end_s": end_s, "prompt_tokens": prompt, "output_tokens": output, "status": 200,
            "model": "m", "lane": "normal", **extra}


def test_concurrent_demand_follows_overlaps():
    rows = [row(0, 10, 100, 10), row(5, 15, 200, 20), row(10, 20, 50, 5)]  # the first ends as the third starts
    peak_tokens, p99_tokens, peak_requests = concurrent_demand(rows)
    assert peak_tokens == 110 + 220
    assert peak_requests == 2
    assert p99_tokens == 330  # held for half the time: the time-weighted p99 is the peak here


def test_rate_buckets_find_peaks_and_troughs():
    starts = [0.0, 1.0, 2.0, 3.0] + [10.0 + i * 0.1 for i in range(10)] + [25.0]
    rates = rate_buckets(starts, bucket_s=10.0)
    assert rates[:2] == [0.4, 1.0]
    assert build_profile([row(s, s + 1, 10, 5) for s in starts], bucket_s=10.0).peak_rate_per_s == 1.0


def test_profile_reads_rotated_files_oldest_first_and_skips_failures(tmp_path):
    log = tmp_path / "traffic.jsonl"
    (tmp_path / "traffic.jsonl.2").write_text(json.dumps(row(0, 1, 10, 1)) + "\n")
    (tmp_path / "traffic.jsonl.1").write_text(json.dumps(row(1, 2, 20, 2)) + "\n")
    log.write_text(json.dumps(row(2, 3, 30, 3)) + "\n" + json.dumps({**row(3, 4, 40, 4), "status": 503}) + "\n")
    rows = load_traffic(log)
    assert [r["prompt_tokens"] for r in rows] == [10, 20, 30]
    profile = build_profile(rows)
    assert profile.prompt_tokens["p50"] == 20 and profile.output_tokens["max"] == 3
    assert profile.output_histogram["<=16"] == 3


def test_missing_log_says_how_to_record_one(tmp_path):
    with pytest.raises(ValueError, match=r"gateway\.traffic\.path"):
        load_traffic(tmp_path / "none.jsonl")


def test_capacity_plan_arithmetic():
    # 2 req/s at peak, 500 prompt + 100 output tokens each; one replica: 1000 prefill and 100 decode tok/s
    rows = [row(i * 0.5, i * 0.5 + 4, 500, 100) for i in range(121)]  # a full 60 s window, then one more
    profile = build_profile(rows, bucket_s=60.0)
    rates = ReplicaRates(prefill_tok_per_s=1000.0, decode_tok_per_s=100.0, prefill_run="a", decode_run="b")
    plan = plan_capacity(profile, SHAPE, rates, headroom=0.25, block_size=16, slo_ttft_ms=300.0)
    assert plan.prefill_share == pytest.approx(1.0)  # 2 × 500 / 1000
    assert plan.decode_share == pytest.approx(2.0)  # 2 × 100 / 100
    assert plan.replicas == math.ceil(3.0 * 1.25)
    assert (plan.prefill_replicas, plan.decode_replicas) == (2, 3)
    per_replica = math.ceil(profile.peak_concurrent_tokens / plan.replicas / 16) * 16
    assert plan.kv_tokens_per_replica == per_replica
    assert plan.kv_bytes_per_replica == math.ceil(per_replica * 23040 * 1.25)
    assert plan.warnings and "500 ms" in plan.warnings[0]  # a 500-token prefill alone takes longer than the SLO


def history_record(run_id, prefill, tok_s, tpot_p90, model="m"):
    return {"run_id": run_id, "target": {"model": model},
            "results": {"prefill_tok_per_s": prefill, "output_tok_per_s": tok_s, "tpot_ms": {"p90": tpot_p90}}}


def test_rates_take_the_best_run_within_the_tpot_slo():
    records = [history_record("low", 900.0, 30.0, 40.0), history_record("mid", 600.0, 120.0, 90.0),
               history_record("high", 300.0, 200.0, 250.0), history_record("other", 5000.0, 900.0, 1.0, model="x")]
    rates = rates_from_history(records, "m", slo_tpot_ms=100.0)
    assert (rates.prefill_tok_per_s, rates.prefill_run) == (900.0, "low")
    assert (rates.decode_tok_per_s, rates.decode_run) == (120.0, "mid")
    with pytest.raises(ValueError, match="TPOT p90 <= 10"):
        rates_from_history(records, "m", slo_tpot_ms=10.0)
