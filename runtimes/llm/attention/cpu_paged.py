"""Paged attention on CPU: a small C++ kernel (`cpu_paged.cpp`) for every query row of a step, decode or prefill.

The kernel walks each sequence's block table and reads every cached key and value row once per block of query rows
(fp32 queries over an fp32 or fp16 cache, any head_dim, GQA); the PyTorch reference instead copies the blocks into a
padded tensor that SDPA reads again. Other dtypes go to the reference.

One routine computes every row, whatever the step: a row's output for a head is a fixed sequence of float operations
on its query, its length and the cached keys and values, never on the chunk it came in, the batch around it or the
threads (cpu_paged.cpp says which sequence). So a token's attention is the same bit for bit whether it was decoded or
prefilled (whole, chunked, or re-prefilled with its generated tokens when a request resumes) and whatever else is in
the batch, which a greedy request needs for its tokens not to depend on either. (SDPA for prefill rows next to a
decode kernel computes the same attention rounded differently.) `paged_decode_attention`, the fused decode step's op,
runs the same routine.

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
from runtimes.llm.attention.reference import paged_attention_ref

_SOURCE = Path(__file__).with_name("cpu_paged.cpp")


@functools.cache
def load_kernel() -> None:
    """Build (or reuse the cached build of) the kernel and register `torch.ops.multiserve_cpu`."""
    # -ffp-contract=off: every fma in the kernel is written out, so no inlined copy of a routine rounds differently
    build("multiserve_cpu_paged", _SOURCE, ["-march=native", "-ffp-contract=off"])


# the cache types the CPU kernels take (this attention, and the fused KV write and decode_layers in
# runtimes/llm/cpu_fused.cpp); their queries and keys are fp32
KERNEL_CACHE_DTYPES = (torch.float32, torch.float16)


@dataclass(frozen=True)
class DecodeRows:
    rows: torch.Tensor  # [B] int64 query row of each decode sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32


def decode_rows(meta: AttentionMetadata) -> DecodeRows | None:
    """The decode sequences' rows, tables and lengths, as `paged_decode_attention` takes them (the fused decode step,
    runtimes/llm/cpu_fused.cpp), derived once per step (None: no decode rows)."""
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


def kernel_takes(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernel computes these dtypes (fp32 queries over an fp32 or fp16 cache), not the reference."""
    return query_dtype == torch.float32 and cache_dtype in KERNEL_CACHE_DTYPES


def paged_attention_cpu(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:  # [T, H, D]
    """Drop-in for `paged_attention_ref` on CPU: every row by the kernel (fp32 queries over an fp32 or fp16 cache),
    other dtypes by the reference. The kernel reads only the metadata's tensors; the reference also its host copies
    (so only the kernel's dtypes may be captured in a decode graph: `kernel_takes`). `window`, `softcap`: as the
    reference's."""
    if not (k_cache.dtype == v_cache.dtype and kernel_takes(query.dtype, k_cache.dtype) and query.device.type == "cpu"):
        return paged_attention_ref(query, k_cache, v_cache, meta, scale, window, softcap)
    load_kernel()
    out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.multiserve_cpu.paged_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                             meta.block_tables, scale, window, softcap, out)
    return out
