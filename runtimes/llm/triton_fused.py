"""A decoder layer's small operations fused for CUDA, in Triton: the counterpart of `cpu_fused.cpp`.

* `add_rms_norm(x, residual, weight, eps)`: residual += x in place, returns RMSNorm(residual) * weight;
  `rms_norm(x, weight, eps)`: the same without the residual. One program per row; the reduction is in fp32.
* `rotary_(qk, cos, sin)`: rotate-halves RoPE in place over [T, heads, D] (a view into the fused q|k|v output).
* `silu_mul(gate_up)`: silu(gate) * up for gate_up = [gate | up] per row.

Each rounds where the PyTorch reference in model.py rounds (the norm's output to the model dtype before the
weight multiplies it, the residual sum and the activation to the model dtype), so in fp32 the results agree
to float rounding and in half types to one rounding step. Nothing is compiled at import; on CPU tensors they run
under Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is imported), which is how the tests
check them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, n_cols, eps, stride_x, stride_r, stride_o,
                 HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        total = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask,
                                            other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + cols, total, mask=mask)
        x = total
    x32 = x.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * scale).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(x.dtype), mask=mask)


@triton.jit
def _rotary_kernel(qk_ptr, cos_ptr, sin_ptr, stride_t, stride_h, HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = qk_ptr + token * stride_t + head * stride_h
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    c = tl.load(cos_ptr + token * HALF + offs, mask=mask, other=0.0)
    s = tl.load(sin_ptr + token * HALF + offs, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + offs, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(base + HALF + offs, (b * c + a * s).to(x1.dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_g + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (activated * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with unit stride in its last dim, got {tuple(t.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _rows(x, "x")
    out = torch.empty_like(x)
    block = triton.next_power_of_2(x.shape[1])
    _norm_kernel[(x.shape[0],)](x, x, weight, out, x.shape[1], eps, x.stride(0), x.stride(0), out.stride(0),
                                HAS_RESIDUAL=False, BLOCK=block)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual) * weight."""
    _rows(x, "x")
    _rows(residual, "residual")
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    out = torch.empty_like(x)
    block = triton.next_power_of_2(x.shape[1])
    _norm_kernel[(x.shape[0],)](x, residual, weight, out, x.shape[1], eps, x.stride(0), residual.stride(0),
                                out.stride(0), HAS_RESIDUAL=True, BLOCK=block)
    return out


def rotary_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """qk [T, heads, D] rotated in place; cos, sin [T, D/2] contiguous fp32."""
    if qk.dim() != 3 or qk.stride(2) != 1:
        raise ValueError(f"qk must be [T, heads, D] with unit stride in D, got {tuple(qk.shape)}")
    tokens, heads, dim = qk.shape
    half = dim // 2
    _rotary_kernel[(tokens, heads)](qk, cos.contiguous(), sin.contiguous(), qk.stride(0), qk.stride(1),
                                    HALF=half, BLOCK=triton.next_power_of_2(half))


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    _rows(gate_up, "gate_up")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(block, triton.next_power_of_2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
