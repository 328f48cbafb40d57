"""Random paged-attention inputs shared by the kernel tests (Triton, CPU) that compare against the reference."""

import torch

from runtimes.llm.attention.metadata import AttentionMetadata


def paged_case(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Random query [T, H, D] and caches; shuffled non-contiguous block tables.

    Returns (query, k_cache, v_cache, meta, valid): every cache slot no sequence owns (spare blocks, the
    tail of each last block) is NaN, so a kernel that reads or weights a masked key produces NaN; `valid`
    [num_blocks, block_size] marks the owned slots.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3  # spare blocks, never referenced
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, valid = [], torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for n, s_len in zip(needed, seq_lens, strict=True):
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        for pos in range(s_len):
            valid[table[pos // block_size], pos % block_size] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_cache[~valid] = float("nan")
    v_cache[~valid] = float("nan")
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)
    return query.to(device), k_cache.to(device), v_cache.to(device), meta, valid.to(device)
