"""PyTorch reference for paged attention. Runs anywhere; the CPU path of the engine uses it.

Decode-only rows (one query each) are batched into SDPA calls over gathered, length-masked keys, one
call per group of similar lengths (see `_decode_groups`); rows with several queries (prefill or chunked
prefill) run one SDPA call each with a causal mask offset by the tokens already in the cache.

Every function takes `window`: a query at position p then sees the keys at (p - window, p] (sliding-window
attention: Mistral, Gemma's local layers); 0 is the whole context. And `softcap` (Gemma 2): each score s becomes
softcap * tanh(s / softcap) before the softmax; SDPA has no such step, so those calls compute attention in plain
ops (0: none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtimes.llm.attention.metadata import AttentionMetadata

FP8_KV = torch.float8_e4m3fn  # `kv_dtype: fp8`: no per-tensor scale (1.0), as vLLM's fp8 cache without calibration
FP8_MAX = torch.finfo(FP8_KV).max  # 448


def write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Scatter the new tokens' keys and values into their cache slots. An fp8 (e4m3) cache gets them clamped to its
    range (+-448) and rounded, and is written as bytes (index_copy_ has no fp8 kernel on every device)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for new, cache in ((key, k_cache), (value, v_cache)):
        if cache.dtype == FP8_KV:
            cache, new = cache.view(torch.uint8), new.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV).view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, new.to(cache.dtype))


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int, first: int = 0) -> torch.Tensor:
    """Contiguous [length - first, KVH, D] copy of one sequence's cached tokens [first, length)."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    skipped = first // block_size
    tokens = cache.index_select(0, table[skipped:num_blocks].long()).flatten(0, 1)
    return tokens[first - skipped * block_size : length - skipped * block_size]


# A decode group's rows have at least this fraction of its longest row's blocks, so padding adds at most
# 1/3 to the keys read. Each group costs two gathers and one SDPA call per layer, so groups smaller than
# _GROUP_MIN_ROWS are not split off. Measured at batch 32 (contexts 20-250 tokens, one layer, 1 thread):
# one padded call over the longest 2.2 ms, groups 1.5 ms.
_GROUP_MIN_FRACTION = 0.75
_GROUP_MIN_ROWS = 4


@dataclass(frozen=True)
class _DecodeGroup:
    rows: torch.Tensor  # [b] rows of `query` with one new token
    block_ids: torch.Tensor  # [b * nb] their block tables trimmed to the group's longest, flattened (int64)
    mask: torch.Tensor  # [b, 1, 1, L] the keys each row sees (before its length, in its window)


def _query_starts(meta: AttentionMetadata) -> list[int]:
    starts = [0]
    for q_len in meta.query_lens_host:
        starts.append(starts[-1] + q_len)
    return starts


def _decode_groups(meta: AttentionMetadata, block_size: int, device: torch.device,
                   window: int = 0) -> list[_DecodeGroup]:
    """Decode rows, longest first, cut into groups whose lengths are close, so padding stays small.
    Derived once per step and window (not once per layer)."""
    key = f"reference.decode.{window}"
    cached = meta.derived.get(key)
    if cached is not None:
        return cached
    starts = _query_starts(meta)
    # a row reads its blocks from the one holding its window's first key (with no window, from block 0)
    skip = {i: max(0, meta.seq_lens_host[i] - window) // block_size if window else 0
            for i, q_len in enumerate(meta.query_lens_host) if q_len == 1}
    reads = {i: -(-meta.seq_lens_host[i] // block_size) - skip[i] for i in skip}
    rows = sorted(skip, key=lambda i: (-reads[i], -meta.seq_lens_host[i]))
    cuts: list[list[int]] = []
    for i in rows:
        if not cuts or (len(cuts[-1]) >= _GROUP_MIN_ROWS and reads[i] < _GROUP_MIN_FRACTION * cuts[-1][0]):
            cuts.append([reads[i]])  # [group's block count, rows...]
        cuts[-1].append(i)
    groups = []
    width = meta.block_tables.shape[1]
    for num_blocks, *members in cuts:
        lens = torch.tensor([meta.seq_lens_host[i] for i in members], device=device)
        tables = meta.block_tables.index_select(0, torch.tensor(members, device=device))
        if window:  # each row's blocks from its own first; entries past a row's table are masked out
            first = torch.tensor([skip[i] for i in members], device=device)
            columns = (first[:, None] + torch.arange(num_blocks, device=device)[None, :]).clamp_(max=width - 1)
            tables = tables.gather(1, columns)
            positions = first[:, None] * block_size + torch.arange(num_blocks * block_size, device=device)[None, :]
            seen = (positions < lens[:, None]) & (positions >= lens[:, None] - window)
        else:
            tables = tables[:, :num_blocks]
            seen = torch.arange(meta.seq_lens_host[members[0]], device=device)[None, :] < lens[:, None]
        groups.append(_DecodeGroup(
            rows=torch.tensor([starts[i] for i in members], device=device),
            block_ids=tables.flatten().long(),
            mask=seen[:, None, None, :],
        ))
    meta.derived[key] = groups
    return groups


def _prefill_rows(meta: AttentionMetadata, dtype: torch.dtype, device: torch.device,
                  window: int = 0) -> list[tuple[int, int, int, int, torch.Tensor | None]]:
    """(seq, start, q_len, first key read, additive mask [q, keys read] or None) of each sequence with several new
    tokens, once per step and window.

    A whole prompt (nothing cached before it) is plain causal attention: no mask, `is_causal`. A chunk after
    cached tokens sees all of them and itself causally, and a window hides the keys before each query's: an additive
    float mask. Both keep SDPA on its fused CPU kernel; a boolean mask sends it to the unfused math path, measured
    3.5x slower for a 128-token chunk over 728 tokens of context and 2.6x for a 600-token prompt (SmolLM2's head
    shapes). Keys before the first query's window are not read (their blocks may have gone back to the pool).
    """
    key = f"reference.prefill.{window}"
    cached = meta.derived.get(key)
    if cached is not None:
        return cached
    starts, prefill = _query_starts(meta), []
    for i, q_len in enumerate(meta.query_lens_host):
        if q_len > 1:
            s_len = meta.seq_lens_host[i]
            first = max(0, s_len - q_len + 1 - window) if window else 0
            mask = None
            if q_len != s_len or (window and window < s_len):
                q_pos = torch.arange(s_len - q_len, s_len, device=device)
                k_pos = torch.arange(first, s_len, device=device)[None, :]
                hidden = k_pos > q_pos[:, None]
                if window:
                    hidden |= k_pos <= q_pos[:, None] - window
                mask = torch.zeros(q_len, s_len - first, dtype=dtype, device=device).masked_fill_(hidden,
                                                                                               float("-inf"))
            prefill.append((i, starts[i], q_len, first, mask))
    meta.derived[key] = prefill
    return prefill


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_rows: int, length: int) -> torch.Tensor:
    """[b, KVH, L, D] keys (or values) of `num_rows` sequences, whole blocks copied by `index_select`
    (rows of 16 x KVH x D contiguous floats; advanced indexing copies element by element, ~1.5x slower)."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    gathered = cache.index_select(0, block_ids).view(num_rows, -1, num_kv_heads, head_dim)
    return gathered[:, :length].transpose(1, 2)


def paged_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's new tokens over its cached context (the last `window` tokens of it)."""
    out = torch.empty_like(query)
    for group in _decode_groups(meta, k_cache.shape[1], query.device, window):
        num_rows, max_len = group.mask.shape[0], group.mask.shape[-1]
        q = query.index_select(0, group.rows).unsqueeze(2)  # [b, H, 1, D]
        k = _gather_blocks(k_cache, group.block_ids, num_rows, max_len)  # [b, KVH, L, D]
        v = _gather_blocks(v_cache, group.block_ids, num_rows, max_len)
        o = _sdpa(q, k.to(q.dtype), v.to(q.dtype), group.mask, scale, softcap)  # [b, H, 1, D]
        out.index_copy_(0, group.rows, o.squeeze(2))
    prefill_attention_ref(query, k_cache, v_cache, meta, scale, out, window, softcap)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          softcap: float) -> torch.Tensor:
    """SDPA (q [b, H, q, D] over k, v [b, KVH, s, D]; `mask` boolean (seen) or additive, None: causal), or with a
    `softcap` the same in plain ops with the scores capped."""
    gqa = q.shape[1] != k.shape[1]  # query head h reads KV head h // group, without copies
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [b, H, q, s]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        q_len, s_len = scores.shape[-2:]
        mask = torch.ones(q_len, s_len, dtype=torch.bool, device=q.device).tril(s_len - q_len)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def prefill_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [T, H, D]
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """The rows of sequences with several new tokens (prefill, chunked prefill): one SDPA call each, with a
    causal mask offset by the tokens already cached. Decode rows of `out` are left as they are."""
    for i, start, q_len, first, mask in _prefill_rows(meta, query.dtype, query.device, window):
        s_len = meta.seq_lens_host[i]
        q = query[start : start + q_len].transpose(0, 1)[None]  # [1, H, q, D]: 4-D, as the fused kernel wants
        k = _gather(k_cache, meta.block_tables[i], s_len, first).transpose(0, 1)[None]  # [1, KVH, s - first, D]
        v = _gather(v_cache, meta.block_tables[i], s_len, first).transpose(0, 1)[None]
        o = _sdpa(q, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap)
        out[start : start + q_len] = o[0].transpose(0, 1)
