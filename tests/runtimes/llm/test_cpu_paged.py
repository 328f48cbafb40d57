"""The CPU attention kernel (C++, built on first use): against the PyTorch reference, and bit for bit the same row
however it is computed (decoded, prefilled whole or in chunks, alone or in any batch, on any thread count)."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtimes.llm.attention import select_attention
from runtimes.llm.attention.cpu_paged import decode_rows, load_kernel, paged_attention_cpu
from runtimes.llm.attention.metadata import AttentionMetadata
from runtimes.llm.attention.reference import paged_attention_ref
from tests.runtimes.llm.paged_case import paged_case

SCENARIOS = {
    "decode": ([1] * 6, [1, 5, 16, 23, 40, 300]),
    "mixed": ([1, 9, 1, 4], [13, 9, 30, 20]),  # decodes next to a prefill and a chunked prefill
    "prefill": ([7, 20], [7, 20]),
    "chunked": ([17, 3, 70], [50, 33, 300]),  # chunks after cached tokens
}


@pytest.fixture(scope="module", autouse=True)
def _kernel() -> None:
    load_kernel()


def _case(query_lens: list[int], seq_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int,
          head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """`paged_case` with the query as a strided view, as the model's fused q|k|v projection gives it."""
    query, k_cache, v_cache, meta, valid = paged_case(query_lens, seq_lens, block_size, num_heads, num_kv_heads,
                                                      head_dim, torch.float32)
    return torch.cat([query, torch.zeros_like(query)], dim=1)[:, :num_heads], k_cache, v_cache, meta, valid


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim"),
                         [(16, 9, 3, 64), (4, 4, 4, 32), (8, 8, 2, 128), (5, 6, 3, 20)])  # 20: padded to 24 lanes
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])  # fp16: widened as it is read
def test_matches_reference(scenario: str, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           cache_dtype: torch.dtype) -> None:
    query_lens, seq_lens = SCENARIOS[scenario]
    query, k_cache, v_cache, meta, valid = _case(query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scale = head_dim**-0.5
    out = paged_attention_cpu(query, k_cache, v_cache, meta, scale)
    # The reference gathers whole blocks and pads decodes to the longest, so it must not see NaN.
    k_ref, v_ref = (torch.where(valid[:, :, None, None], c, 0) for c in (k_cache, v_cache))
    ref_meta = AttentionMetadata.build(query_lens, seq_lens, [list(t) for t in meta.block_tables.tolist()],
                                       block_size)
    expected = paged_attention_ref(query, k_ref, v_ref, ref_meta, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_other_dtypes_take_the_reference() -> None:
    query, k_cache, v_cache, meta, valid = _case([1, 1], [5, 17], 16, 4, 2, 16)
    k_cache, v_cache = (torch.where(valid[:, :, None, None], c, 0).bfloat16() for c in (k_cache, v_cache))
    out = paged_attention_cpu(query.bfloat16(), k_cache, v_cache, meta, 0.25)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()


def test_auto_backend_on_cpu_is_the_kernel() -> None:
    assert select_attention("auto", torch.device("cpu")) is paged_attention_cpu
    assert select_attention("torch", torch.device("cpu")) is paged_attention_ref


# ---- batch invariance ----

# A sequence's whole context: queries [S, H, D] at every position, keys and values [S, KVH, D].
Context = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _context(length: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> Context:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(length, heads, head_dim, generator=gen),
            torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype),
            torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype))


def _attend(step: list[tuple[Context, int, int]], block_size: int, layout_seed: int,
            window: int = 0) -> list[torch.Tensor]:
    """One step over `(context, start, stop)` entries: each sequence's rows [start, stop) with its first `stop` tokens
    cached, their blocks scattered over a shared pool in an order `layout_seed` picks (unowned slots NaN, and with a
    `window` the blocks wholly before the first row's window too, as if freed). Returns each entry's output rows."""
    shuffle = random.Random(layout_seed)
    needed = [-(-stop // block_size) for _, _, stop in step]
    ids = list(range(sum(needed) + 2))  # two spare blocks
    shuffle.shuffle(ids)
    (q0, k0, _), _, _ = step[0]
    k_cache = torch.full((len(ids), block_size, *k0.shape[1:]), float("nan"), dtype=k0.dtype)
    v_cache = k_cache.clone()
    tables, queries = [], []
    for ((q, k, v), start, stop), n in zip(step, needed, strict=True):
        table, ids = ids[:n], ids[n:]
        tables.append(table)
        first = max(0, start + 1 - window) // block_size * block_size if window else 0
        for pos in range(first, stop):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        queries.append(q[start:stop])
    meta = AttentionMetadata.build([stop - start for _, start, stop in step], [stop for _, _, stop in step], tables,
                                   block_size)
    out = paged_attention_cpu(torch.cat(queries), k_cache, v_cache, meta, q0.shape[-1] ** -0.5, window)
    return list(out.split([stop - start for _, start, stop in step]))


SHAPES = [(4, 2, 16), (3, 3, 8), (9, 3, 64), (2, 1, 128), (6, 2, 12)]  # heads, KV heads, head_dim


@settings(max_examples=60, deadline=None)  # each example is ~10-100 small kernel calls
@given(length=st.integers(1, 70), data=st.data(), shape=st.sampled_from(SHAPES), block_size=st.sampled_from([1, 3, 16]),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**16),
       window=st.sampled_from([0, 0, 1, 5, 24]))
def test_a_row_is_the_same_however_it_is_computed(length: int, data: st.DataObject, shape: tuple[int, int, int],
                                                  block_size: int, dtype: torch.dtype, seed: int, window: int) -> None:
    """A row's output depends on its query, its length and the cached values only: decoded on its own, inside its
    whole prompt's prefill, inside any chunking of that prefill, next to other sequences (decodes, prefills, chunks)
    in any order and over any block placement, it is the same, bit for bit; with a sliding window too, whose
    earlier blocks are never read."""
    ctx = _context(length, *shape, dtype, seed)
    whole = _attend([(ctx, 0, length)], block_size, seed, window)[0]
    assert not whole.isnan().any()
    decoded = torch.cat([_attend([(ctx, p, p + 1)], block_size, seed + p, window)[0] for p in range(length)])
    assert torch.equal(decoded, whole)
    cuts = sorted(data.draw(st.sets(st.integers(1, length - 1), max_size=6), label="cuts")) if length > 1 else []
    chunks = list(pairwise([0, *cuts, length]))
    chunked = torch.cat([_attend([(ctx, a, b)], block_size, seed + a, window)[0] for a, b in chunks])
    assert torch.equal(chunked, whole)
    # one chunk of it, in a batch of other sequences at a random place
    a, b = data.draw(st.sampled_from(chunks), label="chunk")
    others = []
    for i, (other_len, other_new) in enumerate(data.draw(st.lists(
            st.tuples(st.integers(1, 40), st.integers(1, 40)), max_size=4), label="others")):
        other = _context(other_len, *shape, dtype, seed + 1000 + i)
        others.append((other, max(0, other_len - other_new), other_len))
    at = data.draw(st.integers(0, len(others)), label="place")
    step = [*others[:at], (ctx, a, b), *others[at:]]
    assert torch.equal(_attend(step, block_size, seed + 7, window)[at], whole[a:b])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_the_thread_count_changes_nothing(cache_dtype: torch.dtype) -> None:
    """Work is split by sequence and KV head, or by blocks of rows, depending on the thread count; rows do not care."""
    query, k_cache, v_cache, meta, _ = _case([1, 300, 1, 40, 1], [90, 300, 7, 200, 64], 16, 9, 3, 64)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(paged_attention_cpu(query, k_cache, v_cache, meta, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_an_fp16_cache_gives_what_fp32_holding_the_same_values_gives() -> None:
    """fp16 rows are widened exactly, then take the same operations."""
    query, k_cache, v_cache, meta, _ = _case(*SCENARIOS["mixed"], 16, 9, 3, 64)
    k_half, v_half = k_cache.half(), v_cache.half()
    assert torch.equal(paged_attention_cpu(query, k_half, v_half, meta, 0.125),
                       paged_attention_cpu(query, k_half.float(), v_half.float(), meta, 0.125))


@pytest.mark.parametrize("scenario", ["decode", "mixed"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 7])
def test_the_decode_op_agrees_with_the_general_op(scenario: str, cache_dtype: torch.dtype, window: int) -> None:
    """`paged_decode_attention` (the fused decode step's op) gives a decode row what `paged_attention` gives it, in a
    decode-only step or a mixed one, with or without a window."""
    query_lens, seq_lens = SCENARIOS[scenario]
    query, k_cache, v_cache, meta, _ = _case(query_lens, seq_lens, 16, 9, 3, 64)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    general = paged_attention_cpu(query, k_cache, v_cache, meta, 0.125, window)
    rows = decode_rows(meta)
    assert rows is not None
    decoded = torch.full(query.shape, float("nan"))
    torch.ops.multiserve_cpu.paged_decode_attention(query, k_cache, v_cache, rows.rows, rows.block_tables,
                                                    rows.seq_lens, 0.125, window, decoded)
    assert torch.equal(decoded[rows.rows], general[rows.rows])


def test_bad_metadata_is_refused() -> None:
    query, k_cache, v_cache, meta, _ = _case([1, 4], [5, 9], 4, 4, 2, 16)
    too_long = torch.tensor([5, 9 + 4 * meta.block_tables.shape[1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.multiserve_cpu.paged_attention(query, k_cache, v_cache, meta.query_start_loc, too_long,
                                                 meta.block_tables, 0.25, 0, 0.0, torch.empty(query.shape))
    with pytest.raises(RuntimeError, match="window -1 < 0"):
        torch.ops.multiserve_cpu.paged_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                                 meta.block_tables, 0.25, -1, 0.0, torch.empty(query.shape))
