"""CPU attention per layer on SmolLM2's head shapes (9 query heads, 3 KV heads, head_dim 64), fp32, paged KV.

Side by side in one run, interleaved, median of `--repeats` rounds of best-of-5 calls:
- prefill and chunked prefill: `reference.prefill_attention_ref` (SDPA on its fused CPU kernel: `is_causal` for a
  whole prompt, an additive float mask for a chunk after cached tokens) against the same gathered keys and values
  through SDPA with a boolean mask on 3-D tensors, the form the reference used before (SDPA's unfused math path);
- decode: the C++ kernel (`cpu_paged.paged_attention_cpu`) against the reference's batched SDPA path.

    python -m bench.measure.cpu_attention
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from bench.measure.timing import best_time
from runtimes.llm.attention.cpu_paged import load_kernel, paged_attention_cpu
from runtimes.llm.attention.metadata import AttentionMetadata
from runtimes.llm.attention.reference import paged_attention_ref, prefill_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def _case(query_lens: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                AttentionMetadata]:
    """Random query rows and a paged cache holding every sequence's tokens, blocks scattered in the pool."""
    gen = torch.Generator().manual_seed(0)
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen).tolist()
    tables, at = [], 0
    for n in blocks:
        tables.append(order[at : at + n])
        at += n
    shape = (sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=gen)
    return query, k_cache, v_cache, AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)


def _bool_mask_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, out: torch.Tensor) -> None:
    """The baseline: the same prefill rows through SDPA with a boolean causal mask on 3-D tensors."""
    start = 0
    for i, q_len in enumerate(meta.query_lens_host):
        s_len = meta.seq_lens_host[i]
        table = meta.block_tables[i][: -(-s_len // BLOCK_SIZE)].long()
        k = k_cache.index_select(0, table).flatten(0, 1)[:s_len].transpose(0, 1)  # [KVH, s, D]
        v = v_cache.index_select(0, table).flatten(0, 1)[:s_len].transpose(0, 1)
        visible = torch.arange(s_len)[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]
        o = F.scaled_dot_product_attention(query[start : start + q_len].transpose(0, 1), k, v, attn_mask=visible,
                                           scale=scale, enable_gqa=True)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    load_kernel()
    scale = HEAD_DIM**-0.5
    prefill = {"prompt 600": ([600], [600]), "chunk 128 after 600": ([128], [728]),
               "chunk 32 after 600": ([32], [632])}
    decode = {"decode b=32, ctx 64-256": ([1] * 32, [64 + 6 * i for i in range(32)]),
              "decode b=8, ctx 600": ([1] * 8, [600] * 8)}
    rows = [_prefill_row(name, *lens, scale, args.repeats) for name, lens in prefill.items()]
    rows += [_decode_row(name, *lens, scale, args.repeats) for name, lens in decode.items()]
    print(f"torch threads: {torch.get_num_threads()}, {args.repeats} rounds of best-of-5, medians, ms per layer\n")
    print("| case | baseline | ms | ours | ms | ours ÷ baseline |\n|---|---|---|---|---|---|")
    for name, base_name, ours_name, ms in rows:
        print(f"| {name} | {base_name} | {ms['baseline']:.3f} | {ours_name} | {ms['ours']:.3f} | "
              f"**{ms['ours'] / ms['baseline']:.2f}** |")
    return 0


Row = tuple[str, str, str, dict[str, float]]


def _prefill_row(name: str, query_lens: list[int], seq_lens: list[int], scale: float, repeats: int) -> Row:
    query, k_cache, v_cache, meta = _case(query_lens, seq_lens)
    out, expected = torch.empty_like(query), torch.empty_like(query)
    _bool_mask_prefill(query, k_cache, v_cache, meta, scale, expected)
    prefill_attention_ref(query, k_cache, v_cache, meta, scale, out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # the same attention, only faster
    arms: dict[str, Callable[[], object]] = {
        "baseline": partial(_bool_mask_prefill, query, k_cache, v_cache, meta, scale, out),
        "ours": partial(prefill_attention_ref, query, k_cache, v_cache, meta, scale, out)}
    return name, "SDPA, boolean mask (before)", "prefill_attention_ref", _time(arms, repeats)


def _decode_row(name: str, query_lens: list[int], seq_lens: list[int], scale: float, repeats: int) -> Row:
    query, k_cache, v_cache, meta = _case(query_lens, seq_lens)
    torch.testing.assert_close(paged_attention_cpu(query, k_cache, v_cache, meta, scale),
                               paged_attention_ref(query, k_cache, v_cache, meta, scale), atol=1e-5, rtol=1e-5)
    arms: dict[str, Callable[[], object]] = {
        "baseline": partial(paged_attention_ref, query, k_cache, v_cache, meta, scale),
        "ours": partial(paged_attention_cpu, query, k_cache, v_cache, meta, scale)}
    return name, "reference (gather + SDPA)", "C++ decode kernel", _time(arms, repeats)


def _time(arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median over rounds of each arm's best-of-5 time in ms; the arms alternate within every round."""
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(repeats):
        for arm, fn in arms.items():
            times[arm].append(best_time(fn) * 1e3)
    return {arm: statistics.median(values) for arm, values in times.items()}


if __name__ == "__main__":
    raise SystemExit(main())
