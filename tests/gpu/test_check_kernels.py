"""The decisions of the GPU kernel and step-time checks (tests/gpu/verdicts.py), on numbers made up to sit on each
side of every bound: two correct bf16 results one rounding step apart agree, a wrong one does not; speeds below
their floor fail on a GPU and are only reported on CPU; a copy bandwidth must be plausible for the device; the step
modes must produce the same tokens."""

from __future__ import annotations

import math

import pytest
import torch

from tests.gpu.verdicts import (
    DATACENTER_MIN_COPY_GBS,
    DECODE_ATTENTION_FLOOR,
    QUANT_LAUNCH_MS,
    compare,
    copy_bandwidth_verdict,
    decode_attention_verdict,
    first_disagreement,
    peak_bandwidth_gbs,
    quant_limit_ms,
    quant_speed_verdict,
)

H200_PEAK_GBS = 4800.0


def next_up(values: torch.Tensor) -> torch.Tensor:
    """Each bf16 value's neighbour away from zero: one rounding step."""
    return (values.view(torch.int16) + 1).view(torch.bfloat16)


# --- numerical agreement ---------------------------------------------------------------------------------------


def test_bf16_results_one_step_apart_agree_at_every_magnitude():
    reference = torch.tensor([0.01, 0.3, 1.0, 2.5, 4.0, 5.5, 7.9, -6.25], dtype=torch.bfloat16)
    result = next_up(reference)
    assert (result.float() - reference.float()).abs().max().item() == pytest.approx(2.0**-5)  # 0.031 at 4-8
    agreement = compare(result, reference, torch.bfloat16)
    assert agreement.ok, agreement


def test_bf16_bound_grows_with_the_values_and_keeps_an_absolute_floor():
    # three steps at 6 (0.094) still agree: P's rounding where the softmax is peaked
    reference = torch.full((4,), 6.0, dtype=torch.bfloat16)
    assert compare(next_up(next_up(next_up(reference))), reference, torch.bfloat16).ok
    # near zero, 0.01 agrees (P's rounding over a spread softmax) but a wrong result does not
    zero = torch.zeros(4)
    assert compare(zero + 0.01, zero, torch.bfloat16).ok
    assert not compare(zero + 0.05, zero, torch.bfloat16).ok


@pytest.mark.parametrize("error", [0.1, 0.5])
def test_a_wrong_bf16_result_fails(error):
    reference = torch.linspace(-4, 4, 64)
    assert not compare(reference + error, reference, torch.bfloat16).ok


def test_a_nan_fails_agreement():
    reference = torch.ones(8)
    result = reference.clone()
    result[3] = math.nan
    agreement = compare(result, reference, torch.bfloat16)
    assert not agreement.ok and math.isnan(agreement.err_over_bound)


def test_fp32_keeps_a_tight_bound():
    reference = torch.linspace(-2, 2, 16)
    assert compare(reference + 1e-4, reference, torch.float32).ok
    assert not compare(reference + 1e-3, reference, torch.float32).ok


# --- speed floors -----------------------------------------------------------------------------------------------


def test_decode_attention_below_its_floor_fails_on_a_gpu():
    copy = 4300.0
    slow = decode_attention_verdict(0.5 * DECODE_ATTENTION_FLOOR * copy, copy, "cuda")
    assert not slow.ok and slow.judged
    assert decode_attention_verdict(0.4 * copy, copy, "cuda").ok
    assert not decode_attention_verdict(1000.0, math.nan, "cuda").ok


def test_decode_attention_speed_is_not_judged_on_cpu():
    verdict = decode_attention_verdict(0.001, 30.0, "cpu")
    assert verdict.ok and not verdict.judged


def test_quant_call_over_its_limit_fails_on_a_gpu():
    weight_bytes, copy = 36_700_160, 4300.0  # Q4_1 `down`
    limit = quant_limit_ms(weight_bytes, copy)
    assert limit > QUANT_LAUNCH_MS
    assert quant_speed_verdict(0.08, weight_bytes, copy, "cuda").ok  # a working kernel, latency-bound
    slow = quant_speed_verdict(limit * 1.5, weight_bytes, copy, "cuda")
    assert not slow.ok and slow.judged
    assert not quant_speed_verdict(0.08, weight_bytes, math.nan, "cuda").ok


def test_quant_speed_is_not_judged_on_cpu():
    verdict = quant_speed_verdict(500.0, 6144, 20.0, "cpu")
    assert verdict.ok and not verdict.judged


# --- copy bandwidth ---------------------------------------------------------------------------------------------


def test_peak_bandwidth_from_clock_and_bus_width():
    assert peak_bandwidth_gbs(2_619_000, 5120) == pytest.approx(3352.3, rel=1e-4)  # H100 SXM
    assert peak_bandwidth_gbs(0, 5120) is None
    assert peak_bandwidth_gbs(2_619_000, 0) is None


@pytest.mark.parametrize(("measured", "ok"), [(4300.0, True), (2500.0, True), (1.0, False), (2000.0, False),
                                              (9000.0, False)])
def test_copy_bandwidth_must_be_plausible_for_the_device(measured, ok):
    verdict = copy_bandwidth_verdict(measured, H200_PEAK_GBS, "cuda")
    assert verdict.ok is ok and verdict.judged, verdict


def test_copy_bandwidth_without_a_peak_needs_a_datacenter_minimum():
    assert not copy_bandwidth_verdict(0.5 * DATACENTER_MIN_COPY_GBS, None, "cuda").ok
    assert copy_bandwidth_verdict(3 * DATACENTER_MIN_COPY_GBS, None, "cuda").ok


def test_copy_bandwidth_on_cpu_is_only_required_to_be_measured():
    assert copy_bandwidth_verdict(12.0, None, "cpu").ok
    assert not copy_bandwidth_verdict(math.nan, None, "cpu").ok
    assert not copy_bandwidth_verdict(0.0, None, "cpu").ok


# --- token identity across step modes ---------------------------------------------------------------------------


def make_tokens(**overrides: list[int]) -> dict[str, list[int]]:
    tokens = {"r0": [5, 9, 9, 2], "r1": [7, 7, 1, 3]}
    return {**tokens, **overrides}


def test_modes_with_the_same_tokens_agree():
    assert first_disagreement({"eager": make_tokens(), "graphs": make_tokens(), "overlap": make_tokens()}) is None


def test_modes_that_differ_in_one_token_disagree():
    why = first_disagreement({"eager": make_tokens(), "graphs": make_tokens(),
                              "overlap": make_tokens(r1=[7, 7, 4, 3])})
    assert why is not None and "r1" in why and "overlap" in why and "token 2" in why


def test_modes_that_differ_in_length_or_requests_disagree():
    assert first_disagreement({"eager": make_tokens(), "graphs": make_tokens(r0=[5, 9, 9])}) is not None
    assert first_disagreement({"eager": make_tokens(), "graphs": {"r0": [5, 9, 9, 2]}}) is not None


def test_no_tokens_is_not_agreement():
    assert first_disagreement({"eager": {}, "graphs": {}}) is not None
    assert first_disagreement({"eager": {"r0": []}, "graphs": {"r0": []}}) is not None
