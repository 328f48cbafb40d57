"""Weight-only quantized matmul for CUDA, in Triton: y = x @ W.T with W in the packed block layout of `formats`
(Q8_0, Q4_0, Q4_1: `w = d * u + c` per block of 32, the values, then the float16 scales, then the float16 offsets of
each row). The weights stay in their 4 or 8 bits in device memory and are dequantized tile by tile inside the
kernel, in registers, right before the tensor-core product; x and y keep the model's dtype (bf16 / fp16; fp32 too,
which is how the tests check it), the products accumulate in fp32.

One program computes a [BLOCK_M, BLOCK_N] tile of y, walking K in steps of BLOCK_K (a multiple of the block size, so
a step never splits a block's scale). Nothing is compiled at import; on CPU tensors the kernel runs under Triton's
interpreter (`TRITON_INTERPRET=1`, set before this module is imported), which is how `make test` checks it against
`dequantize_rows` without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtimes.llm.quant.formats import BLOCK, BlockFormat, padded_blocks


@triton.jit
def _quant_matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_ym, row_bytes, scales_at, offsets_at,
                         BITS: tl.constexpr, QK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = rm < M, rn < N
    rows = w_ptr + rn.to(tl.int64)[:, None] * row_bytes  # [BN, 1]: each weight row's first byte
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_in = k < K
        block, j = k // QK, k % QK  # [BK]: each column's block and place in it
        w_in = n_in[:, None] & k_in[None, :]
        if BITS == 4:  # byte j of a block: value j in the low nibble, value j + 16 in the high one
            byte = tl.load(rows + (block * (QK // 2) + j % (QK // 2))[None, :], mask=w_in, other=0).to(tl.int32)
            u = (byte >> ((j // (QK // 2)) * 4)[None, :]) & 0xF
        else:
            u = tl.load(rows + (block * QK + j)[None, :], mask=w_in, other=0).to(tl.int32)
        d = tl.load((rows + scales_at + block[None, :] * 2).to(tl.pointer_type(tl.float16)), mask=w_in, other=0.0)
        c = tl.load((rows + offsets_at + block[None, :] * 2).to(tl.pointer_type(tl.float16)), mask=w_in, other=0.0)
        w = d.to(tl.float32) * u.to(tl.float32) + c.to(tl.float32)  # [BN, BK]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_in[:, None] & n_in[None, :])


def quant_matmul(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat, in_features: int,
                 block_m: int = 16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """x `[M, K]` @ W.T for W `[N, packed_row_bytes]`, packed rows of `fmt`: `[M, N]` in x's dtype."""
    if x.dim() != 2 or x.shape[1] != in_features or in_features % BLOCK:
        raise ValueError(f"x must be [M, {in_features}] with in_features a multiple of {BLOCK}, got {tuple(x.shape)}")
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != fmt.packed_row_bytes(in_features):
        raise ValueError(f"{fmt.name} weight must be uint8 [N, {fmt.packed_row_bytes(in_features)}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if block_k % BLOCK:
        raise ValueError(f"block_k must be a multiple of {BLOCK}")
    x, weight = x.contiguous(), weight.contiguous()
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    scales_at = padded_blocks(in_features) * BLOCK * fmt.bits // 8
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](x, weight, y, m, n, in_features, x.stride(0), y.stride(0), weight.stride(0),
                               scales_at, scales_at + 2 * padded_blocks(in_features), BITS=fmt.bits, QK=BLOCK,
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
