"""CPU cost of one scheduling step: `Scheduler.schedule()` + `Scheduler.update()`, no model.

Setup per configuration: `--num-seqs` requests with `--prompt-len`-token prompts (distinct, so no prefix hits)
are admitted and prefilled (not timed), then `--warmup-steps` decode steps run, then `--steps` pure-decode
steps are timed one by one with `time.perf_counter`. A fake runner stands in for the model: it returns one
deterministic token for every planned item that samples. Only `schedule()` and `update()` are timed; the
fake runner, and building a real runner's inputs (block tables, positions, slot mappings), are not.
Requests get `max_tokens` large enough that none finishes while timed, and the KV pool is big enough
that nothing is preempted, so every timed step is the steady state of `num_seqs` running decodes.
Prefix caching (a cache namespace per request) is on unless `--no-prefix-caching`: a decode that fills a
block then hashes and registers it, as in the engine.

Each configuration is rebuilt and timed `--repeats` times; the per-step times of all repeats are pooled
for the median and p90. Results: a markdown table on stdout and one JSON line (also appended to `--out`
if given). `--profile` runs cProfile over one extra timed repeat of the first configuration and prints
the top functions by cumulative and by own time.

    python -m bench.measure.scheduler_overhead                           # 256 and 64 sequences, 5 x 2000 steps
    python -m bench.measure.scheduler_overhead --num-seqs 256 --steps 500 --repeats 3 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import platform
import pstats
import statistics
import sys
import time

from bench.stats import nearest_rank
from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.request import Request
from runtimes.llm.sampling_params import SamplingParams
from runtimes.llm.scheduler import Scheduler, SchedulerOutput


def fake_runner(plan: SchedulerOutput) -> dict[str, list[int]]:
    return {item.request.request_id: [1000 + item.request.num_tokens % 1000] for item in plan.scheduled
            if item.samples}


def build(args: argparse.Namespace, num_seqs: int) -> Scheduler:
    """A scheduler with `num_seqs` prefilled requests, each having sampled its first token."""
    # Requests admitted early decode while the rest prefill (and their decodes shrink the prefill budget).
    prefill_steps = -(-num_seqs * args.prompt_len // max(1, args.max_num_batched_tokens - num_seqs))
    max_tokens = prefill_steps + args.warmup_steps + args.steps + 8
    blocks_per_seq = -(-(args.prompt_len + max_tokens) // args.block_size)
    kv = KVCacheManager(num_seqs * blocks_per_seq + 16, args.block_size)
    scheduler = Scheduler(kv, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.prompt_len + max_tokens + 1)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    namespace = None if args.no_prefix_caching else "bench"
    for i in range(num_seqs):
        prompt = [(i * 7919 + j) % 32000 + 10 for j in range(args.prompt_len)]
        scheduler.add_request(Request(f"seq-{i}", prompt, params, max_tokens, float(i), cache_namespace=namespace))
    for _ in range(10 * num_seqs):  # prefill (untimed)
        if all(r.num_output_tokens > 0 for r in scheduler.requests.values()) and len(scheduler.running) == num_seqs:
            break
        plan = scheduler.schedule()
        scheduler.update(plan, fake_runner(plan))
    else:
        raise RuntimeError("prefill did not finish; is max_num_seqs < num_seqs?")
    return scheduler


def timed_steps(scheduler: Scheduler, steps: int, num_seqs: int) -> tuple[list[float], list[float], list[float]]:
    """Per-step seconds: (schedule, update, total)."""
    clock = time.perf_counter
    sched_t, update_t, total_t = [], [], []
    for _ in range(steps):
        t0 = clock()
        plan = scheduler.schedule()
        t1 = clock()
        sampled = fake_runner(plan)
        t2 = clock()
        scheduler.update(plan, sampled)
        t3 = clock()
        sched_t.append(t1 - t0)
        update_t.append(t3 - t2)
        total_t.append((t1 - t0) + (t3 - t2))
    if len(plan.scheduled) != num_seqs or plan.preempted or scheduler.num_preemptions:
        raise RuntimeError(f"not a steady decode state: {len(plan.scheduled)} scheduled, "
                           f"{scheduler.num_preemptions} preemptions")
    return sched_t, update_t, total_t


def measure(args: argparse.Namespace, num_seqs: int) -> dict[str, object]:
    sched_all, update_all, total_all, repeat_means = [], [], [], []
    for _ in range(args.repeats):
        scheduler = build(args, num_seqs)
        timed_steps(scheduler, args.warmup_steps, num_seqs)
        gc.collect()
        sched_t, update_t, total_t = timed_steps(scheduler, args.steps, num_seqs)
        sched_all += sched_t
        update_all += update_t
        total_all += total_t
        repeat_means.append(statistics.fmean(total_t))
    us = 1e6
    return {
        "num_seqs": num_seqs,
        "median_us": statistics.median(total_all) * us,
        "p90_us": nearest_rank(total_all, 0.9) * us,
        "schedule_median_us": statistics.median(sched_all) * us,
        "update_median_us": statistics.median(update_all) * us,
        "mean_of_repeats_us": [round(m * us, 1) for m in repeat_means],
        "per_seq_median_us": statistics.median(total_all) * us / num_seqs,
    }


def profile(args: argparse.Namespace, num_seqs: int, top: int = 20) -> str:
    scheduler = build(args, num_seqs)
    timed_steps(scheduler, args.warmup_steps, num_seqs)
    profiler = cProfile.Profile()
    profiler.enable()
    timed_steps(scheduler, args.steps, num_seqs)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    out.write(f"cProfile, {num_seqs} sequences, {args.steps} steps (profiler overhead inflates all times)\n")
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--steps", type=int, default=2000, help="timed decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also cProfile the first configuration")
    parser.add_argument("--out", help="append the JSON line to this file")
    args = parser.parse_args(argv)
    if max(args.num_seqs) > args.max_num_seqs or max(args.num_seqs) > args.max_num_batched_tokens:
        parser.error("--num-seqs must fit --max-num-seqs and --max-num-batched-tokens (one decode token each)")

    results = [measure(args, n) for n in args.num_seqs]
    print(f"scheduler step = schedule() + update(); {args.repeats} x {args.steps} decode steps, prompt "
          f"{args.prompt_len}, block {args.block_size}, prefix caching {'off' if args.no_prefix_caching else 'on'}")
    print()
    print("| seqs | median µs/step | p90 µs/step | schedule median | update median | µs/seq | mean per repeat |")
    print("|-----:|---------------:|------------:|----------------:|--------------:|-------:|-----------------|")
    for r in results:
        print(f"| {r['num_seqs']} | {r['median_us']:.1f} | {r['p90_us']:.1f} | {r['schedule_median_us']:.1f} | "
              f"{r['update_median_us']:.1f} | {r['per_seq_median_us']:.2f} | {r['mean_of_repeats_us']} |")
    record = {
        "bench": "scheduler_overhead",
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "profile")},
        "results": [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in results],
    }
    line = json.dumps(record)
    print()
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    if args.profile:
        print()
        print(profile(args, args.num_seqs[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
