"""`multiserve bench` (run, `compare`, `plot`), `multiserve profile` and `multiserve plan-capacity`.

    multiserve bench --url http://127.0.0.1:8000 --model smollm2 --workload chat --rate 2 --num-requests 100
    multiserve bench --url ... --model ... --workload sweep --concurrency 1 4 16 --slo-ttft 500 --slo-tpot 100
    multiserve bench compare            # the latest run against earlier runs of the same configuration
    multiserve bench plot --out plots/  # latency CDFs and throughput/goodput vs load of the latest invocation
    multiserve profile --traffic .multiserve/traffic.jsonl --shapes configs/model_shapes.json --model smollm2-...
    multiserve plan-capacity --model M --profile .multiserve/traffic.jsonl --slo-tpot 100 --slo-ttft 1000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from bench import history

SWEEP_CONCURRENCY = (1, 4, 16)  # `--workload sweep` without levels: low, mid, high


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    from bench.capacity_cli import add_capacity_parsers

    bench = sub.add_parser("bench", help="load-test any OpenAI-compatible server (TTFT, TPOT, ITL, goodput)",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_options(bench)
    bench.set_defaults(func=_run)
    actions = bench.add_subparsers(dest="bench_command")
    compare = actions.add_parser("compare", help="a run against earlier runs of the same configuration")
    compare.add_argument("--history", default=str(history.DEFAULT_HISTORY))
    compare.add_argument("--run", default=None, help="run id (prefix) to judge; default: the latest")
    compare.add_argument("--against", nargs="+", default=None, help="run ids to compare with instead of the "
                         "earlier runs of the same configuration (e.g. prefix caching on vs off)")
    compare.add_argument("--last", type=int, default=5, help="earlier runs in the baseline (default 5)")
    compare.add_argument("--threshold", type=float, default=0.10, help="noise floor, relative (default 0.10)")
    compare.set_defaults(func=_compare)
    plot = actions.add_parser("plot", help="PNG charts: latency CDFs, throughput and goodput vs load")
    plot.add_argument("--history", default=str(history.DEFAULT_HISTORY))
    plot.add_argument("--runs", nargs="+", default=None, help="run ids; default: the latest invocation's runs")
    plot.add_argument("--out", default=".multiserve/bench/plots", help="output folder")
    plot.set_defaults(func=_plot)
    add_capacity_parsers(sub)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the model name to send")
    p.add_argument("--endpoint", default="chat", choices=("chat", "completions"))
    p.add_argument("--workload", default="chat", help="chat | long-document | mixed | shared-prefix | sweep")
    p.add_argument("--rate", type=float, nargs="+", default=None, help="open loop: requests/s (several: a sweep)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="closed loop: requests in flight (several: a sweep); with --rate: a cap on requests in flight")
    p.add_argument("--arrival", default="poisson", choices=("poisson", "gamma", "constant"))
    p.add_argument("--burstiness-cv", type=float, default=2.0, help="gamma arrivals' coefficient of variation")
    p.add_argument("--trace", default=None, help="JSONL trace (timestamp, prompt_tokens, output_tokens) to replay")
    p.add_argument("--num-requests", type=int, default=64, help="measured requests per load level")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds per level")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per level (not measured)")
    p.add_argument("--prompt-len", default=None, help="fixed:N | uniform:LOW:HIGH | lognormal:MEDIAN:SIGMA")
    p.add_argument("--output-len", default=None, help="as --prompt-len, for max_tokens")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extra): exact output lengths")
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO, ms")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO, ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default=None, help="a label kept in the record (e.g. prefix-caching-on)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--history", default=str(history.DEFAULT_HISTORY), help="JSONL history to append to")
    p.add_argument("--no-progress", action="store_true")


def _loads(args: argparse.Namespace) -> list:
    from bench.loadgen import LoadSpec

    common = {"arrival": args.arrival, "cv": args.burstiness_cv, "duration_s": args.duration,
              "num_warmup": args.warmup}
    if args.trace:
        return [LoadSpec(concurrency=(args.concurrency or [None])[0], **{**common, "arrival": "trace"})]
    if args.rate:
        cap = args.concurrency[0] if args.concurrency else None
        return [LoadSpec(rate_per_s=rate, concurrency=cap, **common) for rate in args.rate]
    levels = args.concurrency or (list(SWEEP_CONCURRENCY) if args.workload == "sweep" else None)
    if not levels:
        raise ValueError("give --rate (open loop), --concurrency (closed loop) or --trace")
    return [LoadSpec(concurrency=c, **common) for c in levels]


def build_config(args: argparse.Namespace):  # -> BenchConfig (imports kept lazy for the CLI's start-up time)
    from bench.arrivals import load_trace
    from bench.client import Target
    from bench.runner import BenchConfig
    from bench.stats import Slo
    from bench.workloads import BUILTIN, parse_length, with_lengths

    if not args.url or not args.model:
        raise ValueError("--url and --model are required")
    if args.workload not in BUILTIN:
        raise ValueError(f"unknown workload {args.workload!r}; known: {', '.join(BUILTIN)}")
    workload = with_lengths(BUILTIN[args.workload], parse_length(args.prompt_len) if args.prompt_len else None,
                            parse_length(args.output_len) if args.output_len else None)
    trace = load_trace(args.trace) if args.trace else None
    slo = Slo(ttft_s=args.slo_ttft and args.slo_ttft / 1e3, tpot_s=args.slo_tpot and args.slo_tpot / 1e3)
    target = Target(args.url, args.model, args.endpoint, args.api_key, ignore_eos=args.ignore_eos)
    return BenchConfig(target, workload, _loads(args), len(trace) if trace else args.num_requests, args.seed, slo,
                       Path(args.history), args.tag, trace, progress=not args.no_progress)


def _run(args: argparse.Namespace) -> int:
    from bench.runner import BenchError, format_record, run_bench

    try:
        config = build_config(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        records = asyncio.run(run_bench(config))
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for record in records:
        print(format_record(record))
    print(f"appended {len(records)} record(s) to {args.history}")
    failed = any(r["results"]["num_ok"] == 0 for r in records)
    return 1 if failed else 0


def _compare(args: argparse.Namespace) -> int:
    from bench.compare import baselines_for, compare, format_table

    records = history.load(args.history)
    if not records:
        print(f"error: {args.history} holds no runs", file=sys.stderr)
        return 2
    try:
        current = history.find(records, args.run) if args.run else records[-1]
        baselines = ([history.find(records, r) for r in args.against] if args.against
                     else baselines_for(records, current, args.last))
    except KeyError as err:
        print(f"error: {err.args[0]}", file=sys.stderr)
        return 2
    if not baselines:
        print(f"run {current.get('run_id')}: no earlier run of the same configuration to compare with")
        return 0
    rows = compare(current, baselines, args.threshold)
    print(format_table(current, baselines, rows))
    return 1 if any(r.verdict == "REGRESSION" for r in rows) else 0


def _plot(args: argparse.Namespace) -> int:
    from bench.plot import plot_runs

    records = history.load(args.history)
    try:
        if args.runs:
            chosen = [history.find(records, r) for r in args.runs]
        else:
            last_sweep = records[-1].get("sweep_id") if records else None
            chosen = [r for r in records if r.get("sweep_id") == last_sweep]
        paths = plot_runs(chosen, args.out)
    except (KeyError, ValueError) as err:
        print(f"error: {err.args[0]}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path}")
    return 0

