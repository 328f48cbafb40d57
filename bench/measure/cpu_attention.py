"""CPU attention per layer on SmolLM2's head shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16), fp32,
paged KV: the kernel as it is (`cpu_paged.paged_attention_cpu`, every row) against the path before it took prefill rows.

The path before: the C++ decode kernel of commit `--before` (built from git under another op namespace) for decode
rows, `reference.prefill_attention_ref` (SDPA on its fused CPU kernel) for prefill rows. Both arms run side by side
in one process, alternating within every round; median of `--repeats` rounds of best-of-5 calls; both arms' outputs
are checked equal to 1e-5 first.

    python -m bench.measure.cpu_attention
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from bench.measure.timing import best_time
from runtimes.cpu_extension import build
from runtimes.llm.attention.cpu_paged import decode_rows, load_kernel, paged_attention_cpu
from runtimes.llm.attention.metadata import AttentionMetadata
from runtimes.llm.attention.reference import prefill_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# the last commit whose kernel served decode rows only (prefill rows went to SDPA), and its build flags
BEFORE = "5695711"
BEFORE_FLAGS = ["-march=native", "-mprefer-vector-width=512"]

CASES = {
    "decode b=1, ctx 600": ([1], [600]),
    "decode b=32, ctx 64-250": ([1] * 32, [64 + 6 * i for i in range(32)]),
    "prefill 1 x 1,400": ([1400], [1400]),
    "prefill 32 x 28-34": ([28 + i % 7 for i in range(32)], [28 + i % 7 for i in range(32)]),
    "chunk 128 after 600": ([128], [728]),
    "mixed: 8 decodes (ctx 600) + chunk 128": ([1] * 8 + [128], [600] * 8 + [728]),
}


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


def load_before(rev: str) -> None:
    """Build `rev`'s cpu_paged.cpp with its ops under `multiserve_cpu_before` (cached like any kernel build)."""
    source = subprocess.run(["git", "show", f"{rev}:runtimes/llm/attention/cpu_paged.cpp"], check=True,
                            capture_output=True, text=True).stdout
    renamed = source.replace("TORCH_LIBRARY(multiserve_cpu,", "TORCH_LIBRARY(multiserve_cpu_before,")
    assert renamed != source, f"{rev}'s kernel registers no multiserve_cpu library"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cpu_paged_before.cpp"
        path.write_text(renamed)
        build("multiserve_cpu_paged_before", path, BEFORE_FLAGS)


def attention_before(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """The path before: decode rows by the old kernel, prefill rows by SDPA."""
    out = torch.empty(query.shape, dtype=query.dtype)
    decode = decode_rows(meta)
    if decode is not None:
        torch.ops.multiserve_cpu_before.paged_decode_attention(query, k_cache, v_cache, decode.rows,
                                                               decode.block_tables, decode.seq_lens, scale, out)
    prefill_attention_ref(query, k_cache, v_cache, meta, scale, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before", default=BEFORE, help="the commit whose decode kernel the old path runs")
    args = parser.parse_args(argv)
    load_kernel()
    load_before(args.before)
    scale = HEAD_DIM**-0.5
    print(f"torch threads: {torch.get_num_threads()}, {args.repeats} rounds of best-of-5, medians, ms per layer\n")
    print(f"| case | before ({args.before}: old decode kernel + SDPA prefill) | now (one kernel) | now ÷ before |\n"
          "|---|---|---|---|")
    for name, (query_lens, seq_lens) in CASES.items():
        query, k_cache, v_cache, meta = _case(query_lens, seq_lens)
        torch.testing.assert_close(paged_attention_cpu(query, k_cache, v_cache, meta, scale),
                                   attention_before(query, k_cache, v_cache, meta, scale), atol=1e-5, rtol=1e-5)
        ms = _time({"before": partial(attention_before, query, k_cache, v_cache, meta, scale),
                    "now": partial(paged_attention_cpu, query, k_cache, v_cache, meta, scale)}, args.repeats)
        print(f"| {name} | {ms['before']:.3f} | {ms['now']:.3f} | **{ms['now'] / ms['before']:.2f}** |", flush=True)
    return 0


def _time(arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median over rounds of each arm's best-of-5 time in ms; the arms alternate within every round."""
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(repeats):
        for arm, fn in arms.items():
            times[arm].append(best_time(fn) * 1e3)
    return {arm: statistics.median(values) for arm, values in times.items()}


if __name__ == "__main__":
    raise SystemExit(main())
