"""`engine.deterministic: true`: every kernel of a step computes a row with one fixed sequence of float operations,
whatever the batch (its size, the row's place in it, prefill, decode or mixed), so a greedy or seeded request gives
the same tokens alone or among others, and a request resumed from its tokens continues exactly.

What is already so by construction, deterministic or not:
- the CPU's int8 kernel (`quant/cpu_quant.cpp`: one output column per vector lane, a fixed per-element order) and
  its attention kernel (`attention/cpu_paged.cpp`: one kernel for every row, decode or prefill);
- the fused norm, RoPE and SiLU kernels, in C++ and in Triton (`triton_fused.py`): one program per row or element;
- the Triton quantized matmul on CUDA (`quant/triton_matmul.py`): fixed tiles, no split-K.

What `deterministic` changes (`apply`), in the model the engine is given:
- Triton attention: pure-decode steps leave the decode kernel for the prefill kernel every other step uses, with
  its query tile fixed at `INVARIANT_BLOCK_M` (it otherwise follows the longest query), so a token attends with the
  same instructions as part of a prompt or as a decode (`paged_attention_triton_invariant`);
- dense projections and the LM head on the Triton path: `dense_matmul` below, fixed tiles walking K in one order,
  instead of cuBLAS (or MKL/oneDNN), whose kernel and split-K choice follow the batch size.

What it refuses (a ValueError naming the setting): the PyTorch reference attention, and on the CPU kernel a dense
(fp32/bf16/fp16) projection, which goes through MKL/oneDNN: keep the weights in blocks there (`weights: auto` on a
Q8_0/Q4_0/Q4_1 GGUF, or `weights: q8`).

Not exercised here: the CUDA instructions themselves. The Triton kernels run on CPU tensors under
`TRITON_INTERPRET=1` in the tests (same programs, numpy arithmetic); on a GPU the claim rests on MMA results
depending only on their own row and column, which is how Hopper's and Ampere's tensor cores compute.
"""

from __future__ import annotations

from typing import cast

import torch
import triton
import triton.language as tl
from torch import nn

from runtimes.llm.attention.cpu_paged import paged_attention_cpu
from runtimes.llm.attention.triton_paged import paged_attention_triton, paged_attention_triton_invariant
from runtimes.llm.model import DecoderLayer, Linear, LlamaForCausalLM
from runtimes.llm.quant.cpu import BlockWeight

# One tile shape for every call: a row's K is walked in BLOCK_K steps in order, whatever M is.
BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64


@triton.jit
def _dense_matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_in = k < K
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + k[None, :], mask=m_in[:, None] & k_in[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=n_in[:, None] & k_in[None, :],
                    other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_in[:, None] & n_in[None, :])


def dense_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` @ weight.T (`[N, K]`), in x's dtype, accumulated in fp32 in one order per row (fp32 inputs are
    multiplied in full precision, never TF32)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"dense_matmul needs x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    x, weight = x.contiguous(), weight.contiguous()
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _dense_matmul_kernel[grid](x, weight, y, m, n, x.shape[1], x.stride(0), weight.stride(0), y.stride(0),
                                   BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y


def apply(model: LlamaForCausalLM) -> None:
    """Put `model` in its batch-invariant form (see the module docstring); ValueError, changing nothing, where a
    part of it has no batch-invariant kernel. Applying it twice is harmless."""
    layers = _layers(model)
    attention = {layer.self_attn.attention_fn for layer in layers}
    if attention <= {paged_attention_cpu}:
        dense = [name for name, module in _projections(model) if not isinstance(module, BlockWeight)]
        if dense:
            raise ValueError(
                f"engine.deterministic: on the CPU every projection must be in Q8_0/Q4_0/Q4_1 blocks (weights: auto "
                f"on such a GGUF, or weights: q8); {len(dense)} are dense ({dense[0]}, ...), computed by MKL/oneDNN, "
                "whose reduction order depends on the batch size")
        return
    if not attention <= {paged_attention_triton, paged_attention_triton_invariant}:
        raise ValueError("engine.deterministic needs attention_backend cpu or triton (or auto): the PyTorch "
                         "reference attention is not batch-invariant")
    model.set_attention(paged_attention_triton_invariant)
    for _, module in _projections(model):
        if isinstance(module, Linear):
            module.matmul = dense_matmul
    model.logits_matmul = dense_matmul


def _projections(model: LlamaForCausalLM) -> list[tuple[str, nn.Module]]:
    """Every weight a step multiplies by: the layers' projections and the LM head (the embeddings when tied)."""
    out: list[tuple[str, nn.Module]] = []
    for i, layer in enumerate(_layers(model)):
        out += [(f"layers.{i}.{name}", module) for name, module in layer.projections()]
    if model.lm_head is None:
        out.append(("embed_tokens (the tied LM head)", model.embed_tokens))
    else:
        out.append(("lm_head", model.lm_head))
    return out


def _layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return cast(list[DecoderLayer], list(model.layers))
