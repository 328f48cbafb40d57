"""Paged attention on CPU: a small C++ decode kernel (`cpu_paged.cpp`), the PyTorch reference for the rest.

The reference path copies every decode sequence's blocks into a padded tensor and SDPA reads that copy
again; at batch 32 that copy and the padding cost as much as the attention itself. The kernel walks
each sequence's block table and reads every cached key and value once (fp32 queries over an fp32 or fp16 cache,
any head_dim, GQA). Rows with several new tokens (prefill, chunked prefill) and other dtypes go to the reference.

The kernel is compiled on first use with torch's extension loader (about 15 s on 2 cores, then cached:
runtimes/cpu_extension.py); `load_kernel()` raises when there is no C++
compiler, and the engine then falls back to the reference path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from runtimes.cpu_extension import build
from runtimes.llm.attention.metadata import AttentionMetadata
from runtimes.llm.attention.reference import paged_attention_ref, prefill_attention_ref

_SOURCE = Path(__file__).with_name("cpu_paged.cpp")


@functools.cache
def load_kernel() -> None:
    """Build (or reuse the cached build of) the kernel and register `torch.ops.multiserve_cpu`."""
    # AVX-512 where the CPU has it, with 512-bit vectors preferred (6-8% faster here than GCC's default 256)
    build("multiserve_cpu_paged", _SOURCE, ["-march=native", "-mprefer-vector-width=512"])


# the cache types the CPU kernels take (this decode attention, and the fused KV write and decode_layers in
# runtimes/llm/cpu_fused.cpp); their queries and keys are fp32
KERNEL_CACHE_DTYPES = (torch.float32, torch.float16)


@dataclass(frozen=True)
class DecodeRows:
    rows: torch.Tensor  # [B] int64 query row of each decode sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32


def decode_rows(meta: AttentionMetadata) -> DecodeRows | None:
    """The decode sequences' rows, tables and lengths, derived once per step (None: no decode rows)."""
    if "cpu.decode" in meta.derived:
        return meta.derived["cpu.decode"]
    seqs = [i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1]
    plan = None
    if len(seqs) == meta.num_seqs:
        plan = DecodeRows(meta.query_start_loc[:-1].long(), meta.block_tables, meta.seq_lens)
    elif seqs:
        index = torch.tensor(seqs)
        plan = DecodeRows(meta.query_start_loc.index_select(0, index).long(),
                           meta.block_tables.index_select(0, index), meta.seq_lens.index_select(0, index))
    meta.derived["cpu.decode"] = plan
    return plan


def paged_attention_cpu(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Drop-in for `paged_attention_ref` on CPU: decode rows by the kernel, prefill rows by the reference."""
    if not (query.dtype == torch.float32 and k_cache.dtype == v_cache.dtype and k_cache.dtype in KERNEL_CACHE_DTYPES
            and query.device.type == "cpu"):
        return paged_attention_ref(query, k_cache, v_cache, meta, scale)
    load_kernel()
    out = torch.empty(query.shape, dtype=query.dtype)
    decode = decode_rows(meta)
    if decode is not None:
        torch.ops.multiserve_cpu.paged_decode_attention(query, k_cache, v_cache, decode.rows, decode.block_tables,
                                                        decode.seq_lens, scale, out)
    prefill_attention_ref(query, k_cache, v_cache, meta, scale, out)
    return out
