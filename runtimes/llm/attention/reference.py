"""PyTorch reference for paged attention. Runs anywhere; the CPU path of the engine uses it.

Decode-only rows (one query each) are batched into one SDPA call over gathered, length-masked keys;
rows with several queries (prefill or chunked prefill) run one SDPA call each with a causal mask
offset by the tokens already in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtimes.llm.attention.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Scatter the new tokens' keys and values into their cache slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous [length, KVH, D] view of one sequence's cached tokens."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[table[:num_blocks].long()].flatten(0, 1)[:length]


def paged_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's new tokens over its whole cached context."""
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = [0]
    for q_len in meta.query_lens_host:
        starts.append(starts[-1] + q_len)

    decode_rows = [i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1]
    if decode_rows:
        _decode_batch(query, k_cache, v_cache, meta, scale, group, decode_rows, starts, out)
    for i, q_len in enumerate(meta.query_lens_host):
        if q_len == 1:
            continue
        s_len = meta.seq_lens_host[i]
        q = query[starts[i] : starts[i] + q_len].transpose(0, 1)  # [H, q, D]
        k = _gather(k_cache, meta.block_tables[i], s_len).transpose(0, 1)  # [KVH, s, D]
        v = _gather(v_cache, meta.block_tables[i], s_len).transpose(0, 1)
        q_pos = torch.arange(s_len - q_len, s_len, device=query.device)
        k_pos = torch.arange(s_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q, s]
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=group > 1)
        out[starts[i] : starts[i] + q_len] = o.transpose(0, 1)
    return out


def _decode_batch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    group: int,
    rows: list[int],
    starts: list[int],
    out: torch.Tensor,
) -> None:
    block_size = k_cache.shape[1]
    lens = [meta.seq_lens_host[i] for i in rows]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    index = torch.tensor(rows, device=query.device)
    tables = meta.block_tables.index_select(0, index)[:, :num_blocks].long()  # [B, nb]
    token_idx = torch.tensor([starts[i] for i in rows], device=query.device)
    q = query.index_select(0, token_idx).unsqueeze(2)  # [B, H, 1, D]
    k = k_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, KVH, L, D]
    v = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    lens_t = torch.tensor(lens, device=query.device)
    mask = torch.arange(max_len, device=query.device)[None, :] < lens_t[:, None]  # [B, L]
    # enable_gqa: query head h reads KV head h // group without copying K/V per query head
    o = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=group > 1
    )  # [B, H, 1, D]
    out.index_copy_(0, token_idx, o.squeeze(2))
