"""Triton kernels for attention over the paged KV cache; same semantics as `reference.paged_attention_ref`.

Two kernels, both with an online (flash-style) softmax in fp32 that walks a sequence's KV blocks through its
block table, so no gathered copy of the context is ever materialized:

* `_decode_kernel`: every sequence has exactly one query. One program per (sequence, query head); scores
  are an elementwise multiply + `tl.sum`, so any power-of-two block_size and head_dim work.
* `_prefill_kernel`: prefill, chunked prefill and mixed batches (varlen queries, possibly after a cached
  prefix). One program per (sequence, query head, tile of BLOCK_M queries). It uses `tl.dot` when
  BLOCK_M, block_size and head_dim are all >= 16 (the smallest MMA tile Triton accepts on a GPU), and
  otherwise a broadcast multiply + `tl.sum` that is slower but has no shape limit. BLOCK_M is the longest
  query rounded up to a power of two, clamped to [16, 64] with `tl.dot` and to at most 16 without.

Constraints (asserted in `paged_attention_triton`): head_dim and block_size are powers of two
(`tl.arange` sizes); num_heads is a multiple of num_kv_heads; dtypes fp32, fp16 or bf16 (the caches may also be
fp8 e4m3, widened to the query's dtype, or fp32, as they are loaded); the last dim of the
query and caches is contiguous. fp32 dots use `input_precision="ieee"`, so a GPU does not silently drop to
TF32 and the result stays comparable to the fp32 reference. Triton's interpreter cannot run a bf16 `tl.dot`
(triton-lang/triton#11584), so bf16 prefill with block_size and head_dim >= 16 runs only on a GPU.

Nothing is compiled or launched at import; this module imports fine on a machine without a GPU, and runs
on CPU tensors under `TRITON_INTERPRET=1` (which must be set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtimes.llm.attention.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634  # softmax uses exp2 (cheaper on GPU), so scores are pre-scaled by log2(e)
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CACHE_DTYPES = (*_SUPPORTED_DTYPES, torch.float8_e4m3fn)  # fp8 keys and values are widened as they are loaded
_MAX_BLOCK_M = 64
INVARIANT_BLOCK_M = 16  # the query tile of every batch-invariant step (the smallest `tl.dot` takes)


@triton.jit
def _softcap(s, cap):
    """Gemma 2's cap on log2-scaled scores s (cap = softcap * log2(e)): cap * tanh(s / cap), tanh from exp
    (1 - 2 / (e^2x + 1): exact at both ends, e^2x overflowing to inf gives 1)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * (s / cap)) + 1.0))


@triton.jit
def _decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, window, cap,
    stride_ot, stride_oh, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    token = tl.load(query_start_loc_ptr + seq)  # the sequence's single query token
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_SIZE)

    q = tl.load(q_ptr + token * stride_qt + head * stride_qh + offs_d).to(tl.float32)  # [D]
    m_i = tl.full([], float("-inf"), tl.float32)  # running max of the (log2-scaled) scores
    l_i = tl.zeros([], tl.float32)  # running softmax denominator
    acc = tl.zeros([HEAD_DIM], tl.float32)  # [D] running numerator
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # the first key in the window
    for b in range(first // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        # int64: block_id * stride_kb overflows int32 for caches over 2**31 elements.
        block_id = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
        k_pos = b * BLOCK_SIZE + offs_n
        key_mask = (k_pos < seq_len) & (k_pos >= first)  # [N], only the first and last blocks are partial
        k_off = block_id * stride_kb + offs_n[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=key_mask[:, None], other=0.0).to(tl.float32)  # [N, D]
        s = tl.sum(k * q[None, :], axis=1) * qk_scale  # [N]
        if SOFTCAP:
            s = _softcap(s, cap)
        s = tl.where(key_mask, s, float("-inf"))
        # The first block read holds a valid key (`first`), so m_new is finite and exp2 never sees inf - inf.
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new)  # [N]
        v_off = block_id * stride_vb + offs_n[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=key_mask[:, None], other=0.0).to(tl.float32)  # [N, D]
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, window, cap,
    stride_ot, stride_oh, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    USE_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile_start = tl.program_id(2) * BLOCK_M  # first query of this tile, relative to the sequence
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile_start >= q_len:  # the grid is sized for the longest sequence; shorter ones have spare tiles
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens already cached before this step's queries
    offs_m = tile_start + tl.arange(0, BLOCK_M)  # [M]
    offs_n = tl.arange(0, BLOCK_SIZE)  # [N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    q_mask = offs_m < q_len
    q_pos = ctx_len + offs_m  # [M] absolute position of each query

    q_off = (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask[:, None], other=0.0)  # [M, D], query dtype (tl.dot operand)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Causal limit: no query of the tile sees past the tile's last position, so later blocks are skipped.
    kv_len = tl.minimum(seq_len, ctx_len + tile_start + BLOCK_M)
    # Window limit: no query of the tile sees before the tile's first query's window, so earlier blocks are skipped.
    first = tl.where(window > 0, tl.maximum(ctx_len + tile_start + 1 - window, 0), 0)
    for b in range(first // BLOCK_SIZE, tl.cdiv(kv_len, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)  # int64: see decode kernel
        k_pos = b * BLOCK_SIZE + offs_n  # [N]
        k_valid = k_pos < seq_len
        k_off = block_id * stride_kb + offs_n[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=k_valid[:, None], other=0.0).to(q.dtype)  # [N, D]
        v_off = block_id * stride_vb + offs_n[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=k_valid[:, None], other=0.0).to(q.dtype)  # [N, D]
        if USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [M, N] fp32
        else:
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [M, N]
        s = s * qk_scale
        if SOFTCAP:
            s = _softcap(s, cap)
        # Causal mask. For real rows q_pos <= seq_len - 1, so it also drops keys >= seq_len (whose K/V the
        # loads above zero, so stale or NaN slot contents never reach the sums). Padded rows
        # (offs_m >= q_len) still see key 0, so every row has a finite max after block 0 and no NaN
        # appears; the store drops them.
        mask = k_pos[None, :] <= q_pos[:, None]  # [M, N]
        # a real row's window; padded rows keep every key they see causally
        mask = mask & ((k_pos[None, :] > q_pos[:, None] - window) | (window <= 0) | (offs_m[:, None] >= q_len))
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [M]
        # A row whose window starts in a later block has seen no key yet (m_new = -inf): a zero shift keeps its
        # state at exact zeros (alpha = p = 0) instead of inf - inf; elsewhere m_safe is m_new, bit for bit.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # [M, N]
        if USE_DOT:
            # Flash-attention practice: P in the operand dtype (exact for fp32, rounded for fp16/bf16).
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")  # [M, D]
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # [M, D]
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    o_off = (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask[:, None])


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + kv_head * stride_kh + offs_d)
    v = tl.load(value_ptr + token * stride_vt + kv_head * stride_vh + offs_d)
    kc_off = block_id * stride_kcb + offset * stride_kcs + kv_head * stride_kch + offs_d
    vc_off = block_id * stride_vcb + offset * stride_vcs + kv_head * stride_vch + offs_d
    tl.store(k_cache_ptr + kc_off, k.to(k_cache_ptr.dtype.element_ty))
    tl.store(v_cache_ptr + vc_off, v.to(v_cache_ptr.dtype.element_ty))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    head_dim, block_size = query.shape[2], k_cache.shape[1]
    assert _is_pow2(head_dim), f"head_dim must be a power of two, got {head_dim}"
    assert _is_pow2(block_size), f"block_size must be a power of two, got {block_size}"
    assert k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}"
    assert k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}"
    assert query.shape[1] % k_cache.shape[2] == 0, (
        f"num_heads {query.shape[1]} must be a multiple of num_kv_heads {k_cache.shape[2]}"
    )
    for name, t, dtypes in (("query", query, _SUPPORTED_DTYPES), ("k_cache", k_cache, _CACHE_DTYPES),
                            ("v_cache", v_cache, _CACHE_DTYPES)):
        assert t.dtype in dtypes, f"{name} dtype {t.dtype} unsupported; use one of {dtypes}"
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last (head_dim) dimension"


def paged_attention_triton(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    batch_invariant: bool = False,
) -> torch.Tensor:  # [T, H, D], query dtype
    """Causal attention of each sequence's new tokens over its whole cached context (Triton).

    Drop-in for `paged_attention_ref`: the new tokens' K/V must already be in the cache. Accumulates in fp32
    and returns the query dtype. Uses the decode kernel when every sequence has one query, else the general
    varlen kernel; with `batch_invariant`, the varlen kernel for every step, its query tile fixed at
    `INVARIANT_BLOCK_M`: a token's row then takes the same instructions decoded or in a prompt, in any batch (each
    row's online softmax is its own; masked keys past a row's position add exact zeros). See the module docstring
    for the shape and dtype constraints. `window`: each query sees the keys at (p - window, p] (0: all); blocks
    wholly before a query tile's windows are not read. `softcap` > 0: each score s capped to
    softcap * tanh(s / softcap) before the softmax (Gemma 2).
    """
    _check_inputs(query, k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    args = (
        out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale * _LOG2E, window, softcap * _LOG2E,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0),
    )
    group = num_heads // num_kv_heads
    if meta.is_pure_decode and not batch_invariant:
        _decode_kernel[(meta.num_seqs, num_heads)](
            *args, GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, SOFTCAP=softcap > 0
        )
        return out
    # tl.dot needs every tile dim >= 16 on a GPU; below that, the broadcast-sum path with small tiles.
    use_dot = block_size >= 16 and head_dim >= 16
    if batch_invariant:
        block_m = INVARIANT_BLOCK_M
    else:
        block_m = triton.next_power_of_2(meta.max_query_len)
        block_m = max(16, min(block_m, _MAX_BLOCK_M)) if use_dot else min(block_m, 16)
    grid = (meta.num_seqs, num_heads, triton.cdiv(meta.max_query_len, block_m))
    _prefill_kernel[grid](
        *args, GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=block_m, USE_DOT=use_dot,
        SOFTCAP=softcap > 0,
    )
    return out


def paged_attention_triton_invariant(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     meta: AttentionMetadata, scale: float, window: int = 0,
                                     softcap: float = 0.0) -> torch.Tensor:
    """`paged_attention_triton` with `batch_invariant` (`engine.deterministic`: runtimes/llm/batch_invariant.py)."""
    return paged_attention_triton(query, k_cache, v_cache, meta, scale, window, softcap, batch_invariant=True)


def write_kv_triton(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Scatter the new tokens' keys and values into their cache slots (Triton `reference.write_kv`)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert _is_pow2(head_dim), f"write_kv_triton: head_dim must be a power of two, got {head_dim}"
    assert key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, (
        "write_kv_triton: key, value and caches must be contiguous in the last dimension"
    )
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
    )
