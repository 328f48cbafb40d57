"""What the kernel and step-time checks decide, as pure functions of what they measured (check_attention.py,
check_quant.py, check_steptime.py). The check scripts pick their device and Triton's mode when they are imported, so
their decisions live here, where the CPU tests (test_check_kernels.py) can import them without a GPU.

On `--device cpu` speeds are reported, never judged: Triton's interpreter and a shared CPU say nothing about a GPU
kernel, and a dry run only shows that the measuring code runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

# --- numerical agreement ---------------------------------------------------------------------------------------
# An error bound of `atol + ULPS * eps * |reference|` per element, eps being the dtype's spacing at 1.0
# (torch.finfo(dtype).eps: 2^-7 for bf16, 2^-10 for fp16). Why both terms, for bf16:
# * bf16 keeps 8 significant bits, so neighbouring values at |x| in [2^e, 2^(e+1)) are 2^(e-7) <= eps * |x| apart:
#   0.016 at 2-4, 0.031 at 4-8. Two correct bf16 results of one sum, each rounded once from fp32, can be one such
#   step apart (a flat 3e-2 failed them at |x| >= 4). The kernels also round the softmax weights P to bf16 before
#   P @ V (flash-attention practice): a relative 2^-8 each, which where the softmax is peaked is a relative error of
#   the output. 4 steps of |reference| cover the final rounding and that.
# * Where the softmax is spread, the output (a weighted average of V rows) can be near 0 while the error from P's
#   rounding scales with sum(p * |v|), the size of V's entries (~1 here): per kernel at most 2^-8 * sum(p * |v|),
#   for two kernels eps * sum(p * |v|). The absolute term, 2 * eps, covers that up to sum(p * |v|) = 2 even with
#   every rounding error of the same sign; random signs make the real error far smaller.
# fp32 keeps its flat 2e-4: there the difference is the summation order over up to ~1000 keys, not a rounding of
# the stored result. A wrong kernel (a mask off by one, a wrong scale, a stale slot) is off by 0.1 or more.
ULPS = 4
ATOL = {torch.float32: 2e-4, torch.float16: 2 * 2.0**-10, torch.bfloat16: 2 * 2.0**-7}


def error_bound(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on |result - reference| for results in `dtype` (see the comment above)."""
    return ATOL[dtype] + ULPS * torch.finfo(dtype).eps * reference.float().abs()


@dataclass(frozen=True)
class Agreement:
    ok: bool
    max_abs_err: float
    err_over_bound: float  # the worst element's |error| / its bound: at most 1 passes; NaN (a masked key read) fails


def compare(result: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> Agreement:
    """`result` against `reference`, both computed from inputs in `dtype`."""
    err = (result.float() - reference.float()).abs()
    worst = (err / error_bound(reference, dtype)).max().item()  # max propagates NaN
    return Agreement(math.isfinite(worst) and worst <= 1.0, err.max().item(), worst)


# --- speed floors -----------------------------------------------------------------------------------------------
# Decode attention (batch 64, context 2048, 32 query heads over 8 KV heads, bf16): its KV bytes, counted once, per
# second, as a fraction of the device-to-device copy bandwidth measured in the same run. The decode kernel runs one
# program per query head, so each KV head is read by its 4 query heads' programs; the first read comes from HBM,
# the others mostly from L2, whose bandwidth then bounds the kernel: ~30-60 % of the copy bandwidth expected on an
# H100/H200. The floor is half the low end: below it the kernel is broken (serialized, spilling, re-reading HBM).
DECODE_ATTENTION_FLOOR = 0.15
# The weight-only quantized matmul at M = 1 (a decode step): one call may take at most the time of reading its
# packed weight at QUANT_FLOOR of the copy bandwidth, plus QUANT_LAUNCH_MS for the launch. At M = 1 the kernel's
# grid is one program per 64 output rows: 64 programs for the 4096-row projections, fewer than an H200's 132 SMs, so
# those shapes are bound by memory latency (a 14336-long K loop in `down`), not bandwidth, and the smallest
# (`o` in Q4_1, ~10 MB, 2.4 us at 4.3 TB/s) by the Python side of a Triton launch (~10-30 us). A working kernel
# is expected at 2-10x inside this bound; a kernel run by the interpreter, compiled per call or synchronized with
# the host per call is far outside it.
QUANT_FLOOR = 0.05
QUANT_LAUNCH_MS = 0.05


@dataclass(frozen=True)
class Verdict:
    ok: bool
    judged: bool  # False on CPU: reported only
    why: str


def _not_judged_on_cpu(device: str) -> Verdict | None:
    return Verdict(True, False, "cpu: reported, not judged") if device == "cpu" else None


def decode_attention_verdict(kv_read_gbs: float, copy_gbs: float, device: str) -> Verdict:
    """The decode kernel's KV-read bandwidth against DECODE_ATTENTION_FLOOR x the copy bandwidth."""
    if (cpu := _not_judged_on_cpu(device)) is not None:
        return cpu
    floor_gbs = DECODE_ATTENTION_FLOOR * copy_gbs
    ok = math.isfinite(kv_read_gbs) and math.isfinite(copy_gbs) and copy_gbs > 0 and kv_read_gbs >= floor_gbs
    return Verdict(ok, True, f"kv read {kv_read_gbs:.4g} GB/s {'>=' if ok else 'below'} floor {floor_gbs:.4g} GB/s "
                             f"({DECODE_ATTENTION_FLOOR:.0%} of copy {copy_gbs:.4g} GB/s)")


def quant_limit_ms(weight_bytes: int, copy_gbs: float) -> float:
    """The longest a decode-size (M = 1) call may take: its weight read at QUANT_FLOOR of the copy bandwidth, plus
    the launch; NaN without a measured bandwidth."""
    if not (math.isfinite(copy_gbs) and copy_gbs > 0):
        return math.nan
    return weight_bytes / (QUANT_FLOOR * copy_gbs * 1e9) * 1e3 + QUANT_LAUNCH_MS


def quant_speed_verdict(ms: float, weight_bytes: int, copy_gbs: float, device: str) -> Verdict:
    if (cpu := _not_judged_on_cpu(device)) is not None:
        return cpu
    limit = quant_limit_ms(weight_bytes, copy_gbs)
    ok = math.isfinite(ms) and ms <= limit  # False against a NaN limit
    return Verdict(ok, True, f"{ms:.4g} ms {'within' if ok else 'over'} limit {limit:.4g} ms")


# --- copy bandwidth ---------------------------------------------------------------------------------------------
# A 1 GiB device-to-device copy reaches ~85-90 % of the theoretical bandwidth on an H100/H200 (counting read and
# write). Below half of it the measurement, or the device, is wrong (a shared or throttled GPU, a MIG slice); above
# the theoretical bandwidth the timing is. Without a theoretical number, a datacenter GPU's minimum: every HBM part
# from the A100 (1.56 TB/s theoretical) on copies faster than 1 TB/s.
COPY_MIN_OF_PEAK, COPY_MAX_OF_PEAK = 0.5, 1.1
DATACENTER_MIN_COPY_GBS = 1000.0


def peak_bandwidth_gbs(memory_clock_khz: float, bus_width_bits: float) -> float | None:
    """Theoretical memory bandwidth from the memory clock and bus width the driver reports (double data rate, as
    CUDA's deviceQuery computes it: an H100 SXM's 2619 MHz x 5120 bits gives 3.35 TB/s); None if either is unknown."""
    if not memory_clock_khz or not bus_width_bits or memory_clock_khz <= 0 or bus_width_bits <= 0:
        return None
    return 2 * memory_clock_khz * 1e3 * bus_width_bits / 8 / 1e9


def copy_bandwidth_verdict(measured_gbs: float, peak_gbs: float | None, device: str) -> Verdict:
    """A measured copy bandwidth that is plausible for the device: within [COPY_MIN_OF_PEAK, COPY_MAX_OF_PEAK] of
    its theoretical bandwidth, or at least DATACENTER_MIN_COPY_GBS where that is unknown. On CPU: a finite positive
    number."""
    if not (math.isfinite(measured_gbs) and measured_gbs > 0):
        return Verdict(False, True, f"no bandwidth measured ({measured_gbs})")
    if device == "cpu":
        return Verdict(True, False, "cpu: reported, not judged")
    if peak_gbs is None:
        ok = measured_gbs >= DATACENTER_MIN_COPY_GBS
        return Verdict(ok, True, f"{measured_gbs:.4g} GB/s {'>=' if ok else 'below'} the datacenter minimum "
                                 f"{DATACENTER_MIN_COPY_GBS:.4g} GB/s (theoretical bandwidth unknown)")
    low, high = COPY_MIN_OF_PEAK * peak_gbs, COPY_MAX_OF_PEAK * peak_gbs
    ok = low <= measured_gbs <= high
    return Verdict(ok, True, f"{measured_gbs:.4g} GB/s {'within' if ok else 'outside'} [{low:.4g}, {high:.4g}] "
                             f"GB/s ({measured_gbs / peak_gbs:.0%} of theoretical {peak_gbs:.4g} GB/s)")


# --- token identity across step modes ---------------------------------------------------------------------------


def first_disagreement(tokens_by_mode: Mapping[str, Mapping[str, Sequence[int]]]) -> str | None:
    """None when every mode (eager, graphs, overlap, ...) produced the same greedy tokens for every request, and at
    least one token each; else where they first differ."""
    modes = list(tokens_by_mode)
    if not modes:
        return "no modes recorded"
    base_mode, base = modes[0], tokens_by_mode[modes[0]]
    if not base or any(len(tokens) == 0 for tokens in base.values()):
        return f"{base_mode}: a request without tokens"
    for mode in modes[1:]:
        other = tokens_by_mode[mode]
        if set(other) != set(base):
            return f"{mode} ran requests {sorted(other)}, {base_mode} {sorted(base)}"
        for request_id in sorted(base):
            a, b = list(base[request_id]), list(other[request_id])
            if a != b:
                # the first differing token, else where the shorter one ends
                at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                return (f"{request_id}: {base_mode} and {mode} differ at token {at} of {len(a)}/{len(b)} "
                        f"({a[at] if at < len(a) else None} vs {b[at] if at < len(b) else None})")
    return None
