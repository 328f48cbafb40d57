"""The CPU int8 kernel (runtimes/llm/quant/cpu_quant.cpp) built two ways on this machine, side by side: its best code
here (`-march=native`: 512-bit tiles where the CPU has AVX-512 VNNI) against its 256-bit code (the same flags and
`-DMULTISERVE_NO_AVX512`), each under its own op namespace.

The work is a SmolLM2-135M decoder's projections in Q4_1 blocks (random weights of its shapes: q|k|v 960 x 576, o 576
x 576, gate|up 3072 x 576, down 576 x 1536, for 30 layers: 66 MB, more than the caches hold, as in a real step), at
row counts a decode step, a speculative verify step and a prefill bring. Both builds' outputs are checked equal bit
for bit first (the script stops if they differ); then per round each build runs every layer once, alternating, and the
table shows medians over rounds: milliseconds for the 30 layers, GMAC/s, and the speedup.

    python -m bench.measure.quant_kernel                  # ~1 min
    python -m bench.measure.quant_kernel --rows 1 9 --rounds 50
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from runtimes.llm.quant import cpu as quant_cpu
from runtimes.llm.quant.formats import Q4_1, quantize

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per projection of one layer
BUILDS = {"native": ("multiserve_quant_bench", ()), "256-bit": ("multiserve_quant_bench256", ("MULTISERVE_NO_AVX512",))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 9, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args(argv)
    for namespace, defines in BUILDS.values():
        quant_cpu.build_kernel(namespace, "native", defines)
    ops = {name: getattr(torch.ops, namespace) for name, (namespace, _) in BUILDS.items()}
    rng = np.random.default_rng(0)
    rows = [[(n, k, torch.from_numpy(quantize(rng.standard_normal((n, k), dtype=np.float32), Q4_1)))
             for n, k in SHAPES] for _ in tqdm(range(LAYERS), desc="quantizing", leave=False)]
    panels = {name: [[(n, k, op.pack_panels(r, Q4_1.ggml_id, k)) for n, k, r in layer] for layer in rows]
              for name, op in ops.items()}
    macs_per_row = LAYERS * sum(n * k for n, k in SHAPES)

    def run(name: str, x: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        op = ops[name].quant_linear
        return [op(x[k], p, Q4_1.ggml_id, k, n) for layer in panels[name] for n, k, p in layer]

    print(f"SmolLM2-135M's projections (Q4_1, {LAYERS} layers, {macs_per_row / 1e6:.0f} M MACs a row), "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds")
    if not _has_avx512_vnni():
        print("(this CPU has no AVX-512 VNNI: both builds are the 256-bit code, and the speedup is ~1 by design)")
    print("| rows | native ms | 256-bit ms | native GMAC/s | 256-bit GMAC/s | speedup | outputs |")
    print("|---|---|---|---|---|---|---|")
    for m in args.rows:
        generator = torch.Generator().manual_seed(m)
        x = {k: torch.randn(m, k, generator=generator) for k in {k for _, k in SHAPES}}
        outputs = {name: run(name, x) for name in ops}
        if not all(torch.equal(a, b) for a, b in zip(*outputs.values(), strict=True)):
            print(f"| {m} | the builds' outputs differ: the kernel's contract is broken; not timed |")
            return 1
        seconds: dict[str, list[float]] = {name: [] for name in ops}
        for r in tqdm(range(args.rounds), desc=f"{m} rows", leave=False):
            for name in (list(ops) if r % 2 else list(reversed(ops))):
                started = time.perf_counter()
                run(name, x)
                seconds[name].append(time.perf_counter() - started)
        native, narrow = (statistics.median(seconds[name]) for name in BUILDS)
        print(f"| {m} | {native * 1e3:.2f} | {narrow * 1e3:.2f} | {m * macs_per_row / native / 1e9:.0f} | "
              f"{m * macs_per_row / narrow / 1e9:.0f} | {narrow / native:.2f}x | equal |")
    return 0


def _has_avx512_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next(line for line in cpuinfo if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return {"avx512f", "avx512bw", "avx512_vnni"} <= set(flags)


if __name__ == "__main__":
    raise SystemExit(main())
