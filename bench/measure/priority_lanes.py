"""Priority lanes under saturation: interactive, normal and background traffic against SmolLM2 served five times
in one gateway (same file, same limits; `POLICIES` below): `fcfs`, `multilevel` without urgent steps, with urgent
steps that wait for the step in flight, with its defaults (urgent steps that stop it), and with short prompt chunks
while interactive traffic is about. Measured side by side and interleaved:

    python -m bench.measure.priority_lanes --repeats 2

Per model and repeat: first the idle TTFT of interactive requests (one at a time); then, for `--duration-s`,
a closed loop of long background requests (priority 2) that keeps the engine's seats full and its queue
non-empty, a closed loop of normal requests (priority 1), and interactive requests (priority 0) arriving as a
Poisson process. Reports TTFT and ITL p50/p99 per lane, the interactive TTFT p99 against its idle p50, and
each lane's output tokens/s. Loopback only, bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.client import Target, send_streaming
from bench.measure.served_runs import SOURCE, serving_registry
from bench.prompts import WORDS
from bench.stats import RequestResult, percentiles

MODEL_YAML = """\
  - name: smollm2-{scheduling}
    type: chat
    source: {source}
    device: cpu
    engine: {{block_size: 16, max_num_seqs: {max_num_seqs}, max_model_len: 4096,
             max_num_batched_tokens: {max_num_batched_tokens}, kv_cache_gib: 1}}
    policy: {policy}
"""
# what is compared: the registry policy of each, served side by side as `smollm2-<name>`
POLICIES = {
    "fcfs": "{scheduling: fcfs}",
    # multilevel without urgent steps: an interactive arrival's prefill runs inside the decode batch
    "multilevel-shared-steps": "{scheduling: multilevel, multilevel: {urgent_step_max_share: 0}}",
    # urgent steps, but the step in flight when an interactive request arrives runs to its end
    "multilevel-whole-steps": "{scheduling: multilevel, multilevel: {interrupt_steps: false}}",
    "multilevel": "{scheduling: multilevel}",  # the defaults: urgent steps that stop the step in flight
    # and short prompt chunks of the other lanes while interactive traffic is about
    "multilevel-short-chunks": "{scheduling: multilevel, multilevel: {busy_chunk_tokens: 32}}",
}
SCHEDULINGS = tuple(POLICIES)


@dataclass(frozen=True)
class Lane:
    name: str
    priority: int
    prompt_words: int
    max_tokens: int


INTERACTIVE = Lane("interactive", 0, 20, 16)
NORMAL = Lane("normal", 1, 150, 64)
BACKGROUND = Lane("background", 2, 600, 64)


def _prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def _send(http: httpx.AsyncClient, url: str, model: str, lane: Lane, rng: random.Random) -> RequestResult:
    target = Target(url, model, ignore_eos=True, extra_body={"priority": lane.priority})
    return await send_streaming(http, target, _prompt(rng, lane.prompt_words), lane.max_tokens)


async def _closed_loop(http: httpx.AsyncClient, url: str, model: str, lane: Lane, concurrency: int,
                       until_s: float, seed: int) -> list[RequestResult]:
    results: list[RequestResult] = []

    async def user(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.perf_counter() < until_s:
            results.append(await _send(http, url, model, lane, rng))

    await asyncio.gather(*(user(i) for i in range(concurrency)))
    return results


async def _poisson(http: httpx.AsyncClient, url: str, model: str, lane: Lane, rate_per_s: float, start_s: float,
                   until_s: float, seed: int) -> list[RequestResult]:
    rng = random.Random(seed)
    tasks = []
    await asyncio.sleep(max(0.0, start_s - time.perf_counter()))
    while (now := time.perf_counter()) < until_s:
        tasks.append(asyncio.create_task(_send(http, url, model, lane, random.Random(rng.random()))))
        await asyncio.sleep(min(rng.expovariate(rate_per_s), max(0.0, until_s - now)))
    return list(await asyncio.gather(*tasks))


async def _run_one(url: str, model: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600, trust_env=False,
                                 limits=httpx.Limits(max_connections=200, max_keepalive_connections=200)) as http:
        rng = random.Random(seed)
        await _send(http, url, model, INTERACTIVE, rng)  # warm-up
        idle = [await _send(http, url, model, INTERACTIVE, rng) for _ in range(args.num_idle)]
        start = time.perf_counter()
        until = start + args.duration_s
        background, normal, interactive = await asyncio.gather(
            _closed_loop(http, url, model, BACKGROUND, args.background_concurrency, until, seed),
            _closed_loop(http, url, model, NORMAL, args.normal_concurrency, until, seed + 1),
            _poisson(http, url, model, INTERACTIVE, args.interactive_rate, start + args.settle_s, until, seed + 2))
        elapsed = time.perf_counter() - start
    return {"idle": _lane_stats(idle, None), "interactive": _lane_stats(interactive, elapsed),
            "normal": _lane_stats(normal, elapsed), "background": _lane_stats(background, elapsed)}


def _lane_stats(results: Sequence[RequestResult], elapsed_s: float | None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    return {
        "num_requests": len(results), "num_failed": len(results) - len(ok),
        "ttft_ms": {k: v * 1e3 for k, v in percentiles([r.ttft_s for r in ok if r.ttft_s is not None]).items()},
        "itl_ms": {k: v * 1e3 for k, v in percentiles([gap for r in ok for gap in r.itl_s]).items()},
        "output_tok_per_s": None if elapsed_s is None else sum(r.num_output_tokens for r in ok) / elapsed_s,
    }


def _table(runs: dict[str, list[dict[str, Any]]]) -> str:
    def med(scheduling: str, lane: str, path: str) -> float:
        group, key = path.split(".") if "." in path else (path, "")
        values = [run[lane][group][key] if key else run[lane][group] for run in runs[scheduling]]
        return statistics.median(v for v in values if v is not None)

    lines = ["| scheduling | lane | requests | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for scheduling in runs:
        idle = med(scheduling, "idle", "ttft_ms.p50")
        lines.append(f"| {scheduling} | idle interactive | {runs[scheduling][0]['idle']['num_requests']} | "
                     f"{idle:.0f} | {med(scheduling, 'idle', 'ttft_ms.p99'):.0f} | "
                     f"{med(scheduling, 'idle', 'itl_ms.p50'):.1f} | {med(scheduling, 'idle', 'itl_ms.p99'):.1f} | |")
        for lane in ("interactive", "normal", "background"):
            count = statistics.median(run[lane]["num_requests"] for run in runs[scheduling])
            cells = [f"{med(scheduling, lane, 'ttft_ms.p50'):.0f}", f"{med(scheduling, lane, 'ttft_ms.p99'):.0f}",
                     f"{med(scheduling, lane, 'itl_ms.p50'):.1f}", f"{med(scheduling, lane, 'itl_ms.p99'):.1f}",
                     f"{med(scheduling, lane, 'output_tok_per_s'):.1f}"]
            lines.append(f"| {scheduling} | {lane} | {count:.0f} | {' | '.join(cells)} |")
        ratio = [run["interactive"]["ttft_ms"]["p99"] / run["idle"]["ttft_ms"]["p50"] for run in runs[scheduling]]
        lines.append(f"| {scheduling} | **interactive TTFT p99 ÷ idle p50** | | **{statistics.median(ratio):.2f}×** "
                     f"({', '.join(f'{r:.2f}' for r in ratio)}) | | | | |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--settle-s", type=float, default=5.0, help="background start-up before interactive load")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    # Unless a policy stops the step in flight for an arrival, it waits for it, so the per-step token budget bounds
    # what a policy can do for TTFT (Sarathi-Serve's chunk size trade-off between latency and throughput).
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--background-concurrency", type=int, default=12)
    parser.add_argument("--normal-concurrency", type=int, default=2)
    parser.add_argument("--interactive-rate", type=float, default=0.5, help="interactive arrivals per second")
    parser.add_argument("--num-idle", type=int, default=8)
    parser.add_argument("--policies", default=",".join(SCHEDULINGS),
                        help=f"which of {', '.join(SCHEDULINGS)} to compare (comma-separated)")
    args = parser.parse_args(argv)
    schedulings = [s.strip() for s in args.policies.split(",") if s.strip()]
    if unknown := [s for s in schedulings if s not in POLICIES]:
        parser.error(f"--policies: unknown {', '.join(unknown)}; known: {', '.join(SCHEDULINGS)}")
    models = "".join(MODEL_YAML.format(scheduling=s, policy=POLICIES[s], source=SOURCE,
                                       max_num_seqs=args.max_num_seqs,
                                       max_num_batched_tokens=args.max_num_batched_tokens) for s in schedulings)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in schedulings}
    with tempfile.TemporaryDirectory() as workdir, serving_registry(models, Path(workdir)) as url:
        for rep in range(args.repeats):
            for scheduling in schedulings if rep % 2 == 0 else schedulings[::-1]:
                run = asyncio.run(_run_one(url, f"smollm2-{scheduling}", args, seed=rep))
                runs[scheduling].append(run)
                print(f"rep {rep} {scheduling}: interactive TTFT p99 {run['interactive']['ttft_ms']['p99']:.0f} ms "
                      f"(idle p50 {run['idle']['ttft_ms']['p50']:.0f} ms), failures "
                      f"{sum(run[lane]['num_failed'] for lane in run)}", flush=True)
    print(_table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
