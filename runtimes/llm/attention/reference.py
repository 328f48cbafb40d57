"""PyTorch reference for paged attention. Runs anywhere; the CPU path of the engine uses it.

Decode-only rows (one query each) are batched into one SDPA call over gathered, length-masked keys;
rows with several queries (prefill or chunked prefill) run one SDPA call each with a causal mask
offset by the tokens already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class _Plan:
    """What the reference path derives from the metadata once per step (not once per layer)."""

    starts: list[int]
    decode_rows: torch.Tensor | None  # [B] rows of `query` with one new token
    decode_tables: torch.Tensor | None  # [B, nb] their block tables, trimmed to the longest
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] key position < length
    prefill: list[tuple[int, int, int, torch.Tensor]]  # (seq, start, q_len, causal mask [q, s])


def _plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
    cached = meta.derived.get("reference")
    if cached is not None:
        return cached
    starts = [0]
    for q_len in meta.query_lens_host:
        starts.append(starts[-1] + q_len)
    rows = [i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1]
    rows_t = tables = mask = None
    if rows:
        lens = torch.tensor([meta.seq_lens_host[i] for i in rows], device=device)
        max_len = int(max(meta.seq_lens_host[i] for i in rows))
        num_blocks = -(-max_len // block_size)
        tables = meta.block_tables.index_select(0, torch.tensor(rows, device=device))[:, :num_blocks].long()
        rows_t = torch.tensor([starts[i] for i in rows], device=device)
        mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None, :]
    prefill = []
    for i, q_len in enumerate(meta.query_lens_host):
        if q_len > 1:
            s_len = meta.seq_lens_host[i]
            q_pos = torch.arange(s_len - q_len, s_len, device=device)
            prefill.append((i, starts[i], q_len, torch.arange(s_len, device=device)[None, :] <= q_pos[:, None]))
    plan = _Plan(starts, rows_t, tables, mask, prefill)
    meta.derived["reference"] = plan
    return plan


def paged_attention_ref(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's new tokens over its whole cached context."""
    gqa = query.shape[1] != k_cache.shape[2]  # query head h reads KV head h // group, without copies
    out = torch.empty_like(query)
    plan = _plan(meta, k_cache.shape[1], query.device)
    if plan.decode_rows is not None:
        assert plan.decode_tables is not None and plan.decode_mask is not None
        max_len = plan.decode_mask.shape[-1]
        q = query.index_select(0, plan.decode_rows).unsqueeze(2)  # [B, H, 1, D]
        k = k_cache[plan.decode_tables].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, KVH, L, D]
        v = v_cache[plan.decode_tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=plan.decode_mask,
                                           scale=scale, enable_gqa=gqa)  # [B, H, 1, D]
        out.index_copy_(0, plan.decode_rows, o.squeeze(2))
    for i, start, q_len, mask in plan.prefill:
        s_len = meta.seq_lens_host[i]
        q = query[start : start + q_len].transpose(0, 1)  # [H, q, D]
        k = _gather(k_cache, meta.block_tables[i], s_len).transpose(0, 1)  # [KVH, s, D]
        v = _gather(v_cache, meta.block_tables[i], s_len).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)
        out[start : start + q_len] = o.transpose(0, 1)
    return out
