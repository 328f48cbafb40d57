"""`multiserve profile` and `multiserve plan-capacity`: the command-line faces of bench/profile.py and
bench/capacity.py. Model shapes come from a JSON file in the partitioner's `--shapes` format."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from bench import history
from partitioner.planning.demand import SHIPPED_SHAPES

DEFAULT_SHAPES = SHIPPED_SHAPES


def add_capacity_parsers(sub: argparse._SubParsersAction) -> None:
    profile = sub.add_parser("profile", help="summarize the gateway's traffic log: lengths, load over time, KV demand")
    profile.add_argument("--traffic", required=True, help="the log (gateway.traffic.path); rotated copies are read too")
    profile.add_argument("--bucket-s", type=float, default=60.0, help="window for requests/s over time")
    profile.add_argument("--model", default=None, help="only this model's requests; with its shape: KV memory")
    _add_shape_options(profile)
    profile.set_defaults(func=_profile)
    plan = sub.add_parser("plan-capacity", help="replicas, KV memory and a prefill:decode split for a traffic profile")
    plan.add_argument("--model", required=True, help="the model (its name in the traffic log, history and shapes)")
    plan.add_argument("--profile", required=True, help="the traffic log (gateway.traffic.path)")
    plan.add_argument("--history", default=str(history.DEFAULT_HISTORY), help="bench history with the model's runs")
    plan.add_argument("--bench-model", default=None, help="the model's name in the history, if it was benched by "
                      "an alias (default: --model)")
    plan.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO, ms")
    plan.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO, ms: decode rate from runs within it")
    plan.add_argument("--headroom", type=float, default=0.2, help="spare capacity and memory, relative (0.2)")
    plan.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    plan.add_argument("--bucket-s", type=float, default=60.0, help="window over which the peak rate is taken")
    _add_shape_options(plan)
    plan.set_defaults(func=_plan)


def _add_shape_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default=str(DEFAULT_SHAPES), help="model shapes JSON (partitioner --shapes format)")
    p.add_argument("--kv-dtype-bytes", type=int, default=None, help="override the shape's KV element size")


def _shape(args: argparse.Namespace, required: bool):  # -> ModelShape | None
    from partitioner.planning.demand import load_shapes

    if args.model is None:
        return None
    shapes = load_shapes(args.shapes)
    if args.model not in shapes:
        if required:
            raise ValueError(f"{args.shapes}: no shape for model {args.model!r}; known: {', '.join(shapes)}")
        return None
    shape = shapes[args.model]
    return dataclasses.replace(shape, kv_dtype_bytes=args.kv_dtype_bytes) if args.kv_dtype_bytes else shape


def _profile_of(args: argparse.Namespace, path: str):  # -> TrafficProfile
    from bench.profile import build_profile, load_traffic

    rows = load_traffic(path)
    if args.model is not None:
        rows = [r for r in rows if r.get("model") == args.model]
    return build_profile(rows, args.bucket_s)


def _profile(args: argparse.Namespace) -> int:
    from bench.profile import format_profile

    try:
        profile = _profile_of(args, args.traffic)
        shape = _shape(args, required=False)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_profile(profile, shape))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from bench.capacity import format_plan, plan_capacity, rates_from_history

    try:
        profile = _profile_of(args, args.profile)
        shape = _shape(args, required=True)
        rates = rates_from_history(history.load(args.history), args.bench_model or args.model, args.slo_tpot)
        plan = plan_capacity(profile, shape, rates, args.headroom, args.block_size, args.slo_ttft)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_plan(plan, rates, shape, profile))
    return 0
