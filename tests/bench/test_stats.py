"""Percentiles, TPOT, goodput under SLOs and the run summary."""

import math

import pytest

from bench.stats import RequestResult, meets_slo, percentiles, prefill_rate, summarize
from partitioner.simulate.workload import Slo


def ok(ttft_s: float, e2e_s: float, num_output: int, num_prompt: int = 10) -> RequestResult:
    gap_s = (e2e_s - ttft_s) / max(num_output - 1, 1)
    return RequestResult(sent_s=0.0, status=200, num_prompt_tokens=num_prompt, num_output_tokens=num_output,
                         ttft_s=ttft_s, e2e_s=e2e_s, itl_s=[gap_s] * (num_output - 1))


def test_percentiles_interpolate_linearly():
    values = list(range(1, 101))  # 1..100
    got = percentiles(values)
    assert got == {"p50": pytest.approx(50.5), "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}


def test_percentiles_of_nothing_are_nan():
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_tpot_excludes_the_first_token():
    assert ok(0.5, 2.5, 5).tpot_s == pytest.approx(0.5)  # 2 s over the 4 tokens after the first
    assert ok(0.5, 0.5, 1).tpot_s is None


def test_slo_judges_ttft_and_tpot_per_request():
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    assert meets_slo(ok(0.9, 0.9 + 9 * 0.1, 10), slo)
    assert not meets_slo(ok(1.1, 1.2, 2), slo)  # TTFT too slow
    assert not meets_slo(ok(0.2, 0.2 + 9 * 0.2, 10), slo)  # TPOT too slow
    assert not meets_slo(RequestResult(sent_s=0, status=429, error="busy"), slo)
    assert meets_slo(ok(0.5, 5.0, 1), slo)  # one token: no TPOT to judge
    assert not meets_slo(RequestResult(sent_s=0, status=200, num_output_tokens=0), slo)  # no first token


def test_summary_counts_goodput_errors_and_throughput():
    results = [ok(0.1, 1.0, 10), ok(0.1, 1.0, 10), ok(2.0, 3.0, 10),  # the third misses the TTFT SLO
               RequestResult(sent_s=0, status=429, error="busy"), RequestResult(sent_s=0, status=0, error="refused")]
    summary = summarize(results, duration_s=2.0, slo=Slo(ttft_s=1.0))
    assert summary["num_ok"] == 3
    assert summary["request_per_s"] == pytest.approx(1.5)
    assert summary["output_tok_per_s"] == pytest.approx(15.0)
    assert summary["goodput_req_per_s"] == pytest.approx(1.0)
    assert summary["slo_attainment"] == pytest.approx(2 / 5)
    assert summary["errors"] == {"429": 1, "0": 1}
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)


def test_summary_without_slos_counts_every_success_as_good():
    summary = summarize([ok(5.0, 6.0, 3)], duration_s=1.0)
    assert summary["goodput_req_per_s"] == summary["request_per_s"] == 1.0


def test_summary_refuses_a_non_positive_duration():
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], duration_s=0.0)


def test_prefill_rate_is_prompt_tokens_per_second_of_ttft():
    assert prefill_rate([ok(0.5, 1.0, 2, num_prompt=100), ok(1.5, 2.0, 2, num_prompt=300)]) == pytest.approx(200.0)
    assert math.isnan(prefill_rate([ok(0.5, 1.0, 2, num_prompt=0)]))
