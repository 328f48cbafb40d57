"""A mixture of experts' MLPs for CUDA as two grouped GEMM launches, in Triton: the counterpart of the per-expert
loop in `model.MixtureOfExperts.forward`, which costs ~6 launches per expert a step.

The step's (token, expert) picks are sorted by expert (`order`), each expert's picks a contiguous run of rows
between `offsets[e]` and `offsets[e + 1]`. Both launches cover those runs in tiles of BLOCK_M rows, one expert per
tile; a program finds its expert and tile from `offsets` itself (a prefix sum of each expert's tile count), so
nothing is read back to the host: the grid is sized for the worst case (every non-empty expert's last tile partly
filled) and the programs past the last tile return at once. That keeps a step free of host synchronisation, so a
decode step with experts can be captured as a CUDA graph (the loop reads each expert's count on the host).

* `_gate_up_act_kernel`: act = silu(x @ W_gate^T) * (x @ W_up^T) for the sorted rows, gathering each row's token
  from `x`; W_gate_up [E, 2I, H] is the experts' fused gate|up weights, stacked.
* `_down_kernel`: act @ W_down^T [E, H, I], each row scaled by its pick's routing weight and stored at the pick's
  own place ([T * k, H] in pick order), so a token's k outputs are summed afterwards in a fixed order.

Both accumulate in fp32 (fp32 inputs multiplied in full precision, never TF32) and round where the reference MLP
rounds: gate and up to the model dtype, the activation to the model dtype before it multiplies up, the product to
the model dtype. Nothing is compiled at import; on CPU tensors the kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`, set before this module is imported), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows per tile: small where a step has few picks per expert (a decode step), larger for a prefill's, where the
# weight tile read per program then serves more rows.
SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64
BLOCK_N, BLOCK_K = 64, 32


@triton.jit
def _tile(offsets_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's expert, its first sorted row and the end of the expert's rows; expert == E past the last
    tile. Each expert's rows [offsets[e], offsets[e + 1]) are ceil(count / BLOCK_M) tiles, in expert order."""
    experts = tl.arange(0, BLOCK_E)
    starts = tl.load(offsets_ptr + experts, mask=experts < E, other=0)
    ends = tl.load(offsets_ptr + experts + 1, mask=experts < E, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    pid = tl.program_id(0)
    expert = tl.sum((tile_ends <= pid).to(tl.int32), 0)  # experts whose tiles all come before this one
    first_tile = tl.sum(tl.where(experts < expert, tiles, 0), 0)
    start = tl.sum(tl.where(experts == expert, starts, 0), 0)
    end = tl.sum(tl.where(experts == expert, ends, 0), 0)
    return expert, start + (pid - first_tile) * BLOCK_M, end


@triton.jit
def _gate_up_act_kernel(x_ptr, w_ptr, order_ptr, offsets_ptr, act_ptr, E, H, INTER, stride_xm, stride_we, stride_wn,
                        stride_am, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert, first, end = _tile(offsets_ptr, E, BLOCK_M, BLOCK_E)
    if expert >= E:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_in = rows < end
    tokens = tl.load(order_ptr + rows, mask=row_in, other=0) // TOP_K  # each sorted row's token
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate columns: gate rows rn, up rows I + rn
    n_in = rn < INTER
    w = w_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_in = k < H
        a = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=row_in[:, None] & k_in[None, :], other=0.0)
        w_in = k_in[:, None] & n_in[None, :]
        w_gate = tl.load(w + rn.to(tl.int64)[None, :] * stride_wn + k[:, None], mask=w_in, other=0.0)  # [BK, BN]
        w_up = tl.load(w + (rn + INTER).to(tl.int64)[None, :] * stride_wn + k[:, None], mask=w_in, other=0.0)
        gate = tl.dot(a, w_gate, gate, input_precision="ieee")
        up = tl.dot(a, w_up, up, input_precision="ieee")
    dtype = act_ptr.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    act = silu * up.to(dtype).to(tl.float32)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_am + rn[None, :], act.to(dtype),
             mask=row_in[:, None] & n_in[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, order_ptr, offsets_ptr, weights_ptr, out_ptr, E, H, INTER, stride_am, stride_we,
                 stride_wn, stride_om, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    expert, first, end = _tile(offsets_ptr, E, BLOCK_M, BLOCK_E)
    if expert >= E:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_in = rows < end
    picks = tl.load(order_ptr + rows, mask=row_in, other=0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns
    n_in = rn < H
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_in = k < INTER
        a = tl.load(act_ptr + rows.to(tl.int64)[:, None] * stride_am + k[None, :],
                    mask=row_in[:, None] & k_in[None, :], other=0.0)
        w_down = tl.load(w + rn.to(tl.int64)[None, :] * stride_wn + k[:, None], mask=k_in[:, None] & n_in[None, :],
                         other=0.0)
        acc = tl.dot(a, w_down, acc, input_precision="ieee")
    dtype = out_ptr.dtype.element_ty
    scale = tl.load(weights_ptr + picks, mask=row_in, other=0.0).to(tl.float32)  # the pick's routing weight
    out = acc.to(dtype).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + picks.to(tl.int64)[:, None] * stride_om + rn[None, :], out.to(dtype),
             mask=row_in[:, None] & n_in[None, :])


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, chosen: torch.Tensor,
                    weights: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """sum over j of weights[t, j] * expert_{chosen[t, j]}(x[t]) for each token t, the k terms added in the order
    of `chosen`'s columns (ascending experts gives the per-expert loop's order).

    x [T, H]; gate_up [E, 2I, H] (each expert's gate rows, then its up rows); down [E, H, I]; chosen [T, k] expert
    ids; weights [T, k] routing weights (fp32 or x's dtype). Returns [T, H] in x's dtype. `block_m`: rows per tile,
    else by the number of picks per expert."""
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"x must be [T, H], gate_up [E, 2I, H] and down [E, H, I], got {tuple(x.shape)}, "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    if hidden != x.shape[1] or tuple(down.shape) != (experts, hidden, inter) or two_inter % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit x "
                         f"{tuple(x.shape)}: need gate_up [E, 2I, {x.shape[1]}] and down [E, {x.shape[1]}, I]")
    if chosen.shape != weights.shape or chosen.dim() != 2 or chosen.shape[0] != x.shape[0]:
        raise ValueError(f"chosen {tuple(chosen.shape)} and weights {tuple(weights.shape)} must both be "
                         f"[{x.shape[0]}, k]")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"gate_up ({gate_up.dtype}) and down ({down.dtype}) must be in x's dtype {x.dtype}")
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("gate_up and down need unit stride in their last dim")
    tokens, top_k = chosen.shape
    picks = tokens * top_k
    out = torch.zeros_like(x)
    if picks == 0:
        return out
    x = x.contiguous()
    flat = chosen.flatten()
    order = flat.argsort(stable=True)  # sorted rows -> picks, grouped by expert, each group in token order
    bounds = torch.arange(experts + 1, device=x.device, dtype=flat.dtype)
    offsets = torch.searchsorted(flat[order], bounds)  # expert e's sorted rows: [offsets[e], offsets[e + 1])
    if block_m is None:
        block_m = SMALL_BLOCK_M if picks <= 4 * experts * SMALL_BLOCK_M else LARGE_BLOCK_M
    # at most one partly filled tile per expert that has picks: ceil(c / m) <= c / m + 1 over those experts
    tiles = triton.cdiv(picks, block_m) + min(experts, picks)
    block_e = triton.next_power_of_2(experts)
    act = torch.empty((picks, inter), dtype=x.dtype, device=x.device)
    _gate_up_act_kernel[(tiles, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, order, offsets, act, experts, hidden, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        act.stride(0), TOP_K=top_k, BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    each = torch.empty((picks, hidden), dtype=x.dtype, device=x.device)  # each pick's weighted output, pick order
    _down_kernel[(tiles, triton.cdiv(hidden, BLOCK_N))](
        act, down, order, offsets, weights.contiguous().flatten(), each, experts, hidden, inter, act.stride(0),
        down.stride(0), down.stride(1), each.stride(0), BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K)
    each = each.view(tokens, top_k, hidden)
    for j in range(top_k):  # in `chosen`'s column order, from zero as the loop adds
        out += each[:, j]
    return out
