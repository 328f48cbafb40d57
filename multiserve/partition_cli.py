"""`multiserve partition plan|simulate|apply|status`: the partitioner from the command line (multiserve/cli.py
registers it).

Exit status: 0 done; 1 the plan is infeasible or a device read failed (the message says what and where);
2 bad input (registry, inventory or shapes file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from foundation.config_files import shown_path
from partitioner.applying.applied_state import DEFAULT_STATE_FILE, AppliedStateFile
from partitioner.devices.backend import DeviceError
from partitioner.devices.catalog import INVENTORY_DIR
from partitioner.devices.inventory import Inventory, InventoryFileError, inventory_to_dict
from partitioner.devices.read import load_host_inventory
from partitioner.planning.plan import InfeasiblePlan, Plan
from registry.fields import GIB

if TYPE_CHECKING:
    from partitioner.planning.demand import ModelShape
    from partitioner.planning.placement import PlanOptions
    from partitioner.simulate.evaluate import Evaluated
    from registry.schema import Registry

    _PlanInputs = tuple[Registry, dict[str, ModelShape], Inventory, PlanOptions]

INVENTORIES = shown_path(INVENTORY_DIR)  # as an operator would type it, for the hints printed to them


def add_partition_parser(sub: argparse._SubParsersAction, default_config: Path) -> argparse._SubParsersAction:
    """Register `partition plan` and `status` on the `multiserve` parser (`--config` defaults to `default_config`);
    returns the partition subcommands, for `apply` (multiserve/partition_apply.py)."""
    part = sub.add_parser("partition", help="plan and inspect how replicas share GPUs (MIG, MPS, time-slicing)")
    actions = part.add_subparsers(dest="partition_command", required=True)
    plan = actions.add_parser("plan", help="print where every replica of the registry would run, and with what")
    add_plan_arguments(plan, default_config)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--objective", choices=["configured", "goodput"], default="configured",
                      help="configured (default): the registry's placements as written; goodput: the candidate "
                           "plan (`partition simulate`) that serves the most requests within their SLOs")
    add_traffic_arguments(plan)
    plan.set_defaults(func=run_plan)
    simulate = actions.add_parser("simulate", help="simulate the traffic on candidate plans (MIG, MPS, "
                                  "time-slicing, nested) and rank them by goodput")
    add_plan_arguments(simulate, default_config)
    add_traffic_arguments(simulate)
    simulate.add_argument("--json", action="store_true", help="print every candidate's results as JSON")
    simulate.set_defaults(func=run_simulate)
    status = actions.add_parser("status", help="print the device inventory (NVML, or a fake/CPU one)")
    _add_inventory_argument(status)
    status.add_argument("--json", action="store_true", help="print the inventory as JSON")
    status.add_argument("--state-file", default=DEFAULT_STATE_FILE, help="what `partition apply` recorded")
    status.set_defaults(func=run_status)
    return actions


def add_plan_arguments(parser: argparse.ArgumentParser, default_config: Path) -> None:
    """What a plan is made from: the registry, an inventory, and the operator's options."""
    parser.add_argument("--config", default=str(default_config), help="the registry YAML")
    _add_inventory_argument(parser)
    parser.add_argument("--gpus", default=None, help="GPU indices the plan may use, e.g. 0,1 (default: all)")
    parser.add_argument("--shapes", default=None,
                        help="JSON of model name -> {num_layers, num_kv_heads, head_dim, weights_bytes, ...}")
    parser.add_argument("--mig-fallback", choices=["mps", "timeslice"], default=None,
                        help="isolation for mig models when MIG cannot be had (no MIG GPU, MIG mode off, no root)")
    parser.add_argument("--max-memory-fraction", type=float, default=0.95,
                        help="of each GPU's (or MIG device's) memory, at most this much for our replicas")


def add_traffic_arguments(parser: argparse.ArgumentParser) -> None:
    """What the simulator serves (partitioner/simulate/traffic.py describes the file)."""
    parser.add_argument("--traffic", default=None,
                        help="YAML/JSON of model -> rate, prompt/output lengths (or a gateway traffic log to "
                             "replay) and SLOs; default: 1 request/s, 512 + 128 tokens, TTFT 1 s, TPOT 100 ms")
    parser.add_argument("--duration-s", type=float, default=None, help="arrivals over this long (default: the "
                        "file's duration_s, else 60)")
    parser.add_argument("--seed", type=int, default=None, help="the traffic's seed (default: the file's, else 0)")
    parser.add_argument("--drain-s", type=float, default=30.0,
                        help="simulate this long after the last arrival, so that late requests can finish")


def _add_inventory_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inventory", default=None,
                        help=f"plan for the GPUs of this file (e.g. {INVENTORIES}/h100-80gb.json) instead of NVML's")


def run_plan(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
             env: Mapping[str, str] | None = None) -> int:
    """`partition plan`: the registry's replicas planned onto the inventory, as a table or JSON."""
    out, err, env = out or sys.stdout, err or sys.stderr, os.environ if env is None else env
    from partitioner.planning.demand import replica_demands
    from partitioner.planning.planner import plan

    inputs = plan_inputs_or_exit_code(args, env, err)
    if isinstance(inputs, int):
        return inputs
    registry, shapes, inventory, options = inputs
    if args.objective == "goodput":
        return _plan_for_goodput(args, inputs, out, err)
    try:
        result = plan(inventory, replica_demands(registry, shapes), options)
    except InfeasiblePlan as exc:
        _print_infeasible(args, inventory, exc, err)
        return 1
    out.write(json.dumps(result.to_dict(), indent=2) + "\n" if args.json else render_plan(result))
    return 0


def _print_infeasible(args: argparse.Namespace, inventory: Inventory, exc: InfeasiblePlan, err: TextIO) -> None:
    print(f"error: infeasible plan for {args.config} on {inventory.source}:", file=err)
    for problem in exc.problems:
        print(f"  - {problem}", file=err)


def _plan_for_goodput(args: argparse.Namespace, inputs: _PlanInputs, out: TextIO, err: TextIO) -> int:
    """`partition plan --objective goodput`: the simulated best candidate, printed as a plan."""
    from partitioner.simulate.evaluate import best, static_mig

    evaluated = _evaluate_candidates(args, inputs, err)
    if isinstance(evaluated, int):
        return evaluated
    chosen = best(evaluated)
    if chosen is None or chosen.candidate.plan is None:
        print(f"error: no candidate plan for {args.config} on {inputs[2].source} could be simulated:", file=err)
        for e in evaluated:
            print(f"  - {e.candidate.name}: {e.error}", file=err)
        return 1
    static = static_mig(evaluated)
    if args.json:
        data = {**chosen.candidate.plan.to_dict(), "objective": {
            "name": "goodput", "candidate": chosen.candidate.name, "goodput_per_s": chosen.goodput_per_s,
            "static_mig_goodput_per_s": None if static is None else static.goodput_per_s}}
        out.write(json.dumps(data, indent=2) + "\n")
        return 0
    versus = "" if static is None else f" (static MIG: {static.goodput_per_s:.2f} req/s)"
    out.write(f"objective goodput: {chosen.candidate.name}: {chosen.goodput_per_s:.2f} requests/s within their "
              f"SLOs{versus}, of {len(evaluated)} candidates (`partition simulate` lists them)\n\n")
    out.write(render_plan(chosen.candidate.plan))
    return 0


def run_simulate(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
                 env: Mapping[str, str] | None = None) -> int:
    """`partition simulate`: every candidate plan simulated on the traffic, best first; infeasible ones with the
    planner's reasons."""
    out, err, env = out or sys.stdout, err or sys.stderr, os.environ if env is None else env
    inputs = plan_inputs_or_exit_code(args, env, err)
    if isinstance(inputs, int):
        return inputs
    evaluated = _evaluate_candidates(args, inputs, err)
    if isinstance(evaluated, int):
        return evaluated
    out.write(json.dumps([_evaluated_dict(e) for e in evaluated], indent=2) + "\n" if args.json
              else render_simulation(evaluated))
    return 0


def _evaluate_candidates(args: argparse.Namespace, inputs: _PlanInputs, err: TextIO) -> list[Evaluated] | int:
    """The candidate plans of the registry, each simulated on the traffic; or the exit code after saying why not."""
    from bench.profile import load_traffic as read_traffic_log
    from partitioner.planning.demand import replica_demands
    from partitioner.simulate.evaluate import evaluate_candidates, sim_models
    from partitioner.simulate.traffic import default_traffic, load_traffic

    registry, shapes, inventory, options = inputs
    try:
        demands = replica_demands(registry, shapes)
    except InfeasiblePlan as exc:
        _print_infeasible(args, inventory, exc, err)
        return 1
    models = sim_models(registry, shapes)
    try:
        traffic = load_traffic(args.traffic, read_traffic_log) if args.traffic else \
            default_traffic(sorted({d.model for d in demands}))
        traffic = replace(traffic, duration_s=args.duration_s or traffic.duration_s,
                          seed=traffic.seed if args.seed is None else args.seed)
        missing = sorted({d.model for d in demands} - set(models))
        if missing:
            raise ValueError(f"no shape for model(s) {missing}: the simulator needs each one's layers, KV heads, "
                             f"head size and weight bytes (--shapes)")
    except ValueError as exc:
        print(f"error: {exc}", file=err)
        return 2
    return evaluate_candidates(inventory, demands, models, traffic, options, drain_s=args.drain_s)


def _evaluated_dict(e: Evaluated) -> dict[str, Any]:
    return {"candidate": e.candidate.name, "family": e.candidate.family, "feasible": e.candidate.plan is not None,
            "error": e.error, "goodput_per_s": e.goodput_per_s, "throughput_per_s": e.throughput_per_s,
            "unplanned_bytes": e.unplanned_bytes, "models": {m: asdict(r) for m, r in e.models.items()},
            "tree": None if e.candidate.plan is None else e.candidate.plan.tree()}


def render_simulation(evaluated: Sequence[Evaluated]) -> str:
    """Simulated candidates by goodput (best first), the best and the static MIG one per model, then the rest."""
    from partitioner.simulate.evaluate import best, static_mig

    ran = sorted((e for e in evaluated if e.error is None), key=lambda e: -e.goodput_per_s)
    rows = [[str(i), f"{e.goodput_per_s:.2f}", f"{e.throughput_per_s:.2f}", _gib(e.unplanned_bytes),
             " ".join(f"{m}={r.goodput_per_s:.2f}" for m, r in e.models.items()), e.candidate.name]
            for i, e in enumerate(ran, 1)]
    lines = table(["#", "GOODPUT/S", "DONE/S", "UNPLANNED", "GOODPUT/S BY MODEL", "CANDIDATE"], rows)
    top, static = best(evaluated), static_mig(evaluated)
    for label, e in (("best", top), ("static MIG", static)):
        if e is not None:
            lines += ["", f"{label}: {e.candidate.name}", *_model_table(e)]
    if top is not None and static is not None and static.goodput_per_s > 0:
        lines += ["", f"best / static MIG goodput: {top.goodput_per_s / static.goodput_per_s:.2f}x"]
    failed = [e for e in evaluated if e.error is not None]
    if failed:
        lines += ["", "not simulated:", *(f"  - {e.candidate.name}: {e.error}" for e in failed)]
    return "\n".join(lines) + "\n"


def _model_table(e: Evaluated) -> list[str]:
    rows = [[m, f"{r.goodput_per_s:.2f}", f"{r.throughput_per_s:.2f}", f"{r.output_tokens_per_s:.0f}",
             f"{r.ttft_ms['p50']:.0f} / {r.ttft_ms['p99']:.0f}", f"{r.tpot_ms['p50']:.1f} / {r.tpot_ms['p99']:.1f}",
             f"{r.kv_peak_fraction:.0%}", f"{r.arrived} / {r.finished} / {r.in_flight} / {r.rejected}"]
            for m, r in e.models.items()]
    return ["  " + line for line in table(["MODEL", "GOODPUT/S", "DONE/S", "OUT TOK/S", "TTFT P50/P99 MS",
                                           "TPOT P50/P99 MS", "KV PEAK", "ARRIVED/DONE/IN FLIGHT/REJECTED"], rows)]


def plan_inputs_or_exit_code(args: argparse.Namespace, env: Mapping[str, str], err: TextIO) -> _PlanInputs | int:
    """`plan_inputs`, or the exit code after saying what is wrong: 2 for bad input, 1 when reading the devices
    failed."""
    from registry.errors import RegistryError

    try:
        return plan_inputs(args, env)
    except (RegistryError, InventoryFileError, ValueError) as exc:
        print(f"error: {exc}", file=err)
        return 2
    except DeviceError as exc:
        print(f"error: reading the devices: {exc}", file=err)
        return 1


def plan_inputs(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[Registry, dict[str, ModelShape],
                                                                          Inventory, PlanOptions]:
    """The registry, shapes, inventory and options the plan arguments name. Raises RegistryError,
    InventoryFileError, ValueError (bad input) or DeviceError (reading the devices)."""
    from partitioner.planning.demand import load_shapes
    from partitioner.planning.placement import PlanOptions
    from partitioner.planning.shapes import plan_shapes
    from registry.store import load_registry

    registry = load_registry(args.config)
    gpus = _gpu_indices(args.gpus) if args.gpus is not None else None
    inventory = load_host_inventory(args.inventory, env)
    # a model with neither a given shape nor placement.memory_gib: estimated from its weights when they are here
    shapes, _ = plan_shapes(registry, load_shapes(args.shapes) if args.shapes else {}, inventory)
    options = PlanOptions(gpus=gpus, mig_fallback=args.mig_fallback, max_memory_fraction=args.max_memory_fraction)
    return registry, shapes, inventory, options


def run_status(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None,
               env: Mapping[str, str] | None = None) -> int:
    """`partition status`: the inventory (saying plainly when it is a CPU or fake one), what apply recorded, and
    the live time-slice shares of running arbiters."""
    out, err, env = out or sys.stdout, err or sys.stderr, os.environ if env is None else env
    try:
        inventory = load_host_inventory(args.inventory, env)
    except InventoryFileError as exc:
        print(f"error: {exc}", file=err)
        return 2
    except DeviceError as exc:
        print(f"error: reading the devices: {exc}", file=err)
        return 1
    extra = applied_and_live(args.state_file, env)
    if args.json:
        data = {"kind": inventory_kind(inventory), **inventory_to_dict(inventory), **extra}
        out.write(json.dumps(data, indent=2) + "\n")
    else:
        out.write(render_inventory(inventory) + render_applied_and_live(extra))
    return 0


def _gpu_indices(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(i) for i in text.split(",") if i.strip())
    except ValueError:
        raise ValueError(f"--gpus: expected GPU indices such as 0,1; got {text!r}") from None


def inventory_kind(inventory: Inventory) -> str:
    """"nvml" (this host's GPUs), "fake" (a file's) or "cpu" (no GPU)."""
    return "cpu" if inventory.is_cpu else "fake" if inventory.source.startswith("fake:") else "nvml"


def render_inventory(inventory: Inventory) -> str:
    kind = inventory_kind(inventory)
    lines = [f"inventory: {inventory.source}"]
    if kind == "cpu":
        lines.append("CPU inventory: no GPU listed because " + (inventory.note or "none was found") + ".")
        lines.append(f"To plan for a GPU host, pass --inventory {INVENTORIES}/<gpu>.json.")
    elif kind == "fake":
        lines.append(f"FAKE inventory read from {inventory.source[5:]}: not this machine's GPUs.")
    if inventory.note and kind != "cpu":
        lines.append(f"note: {inventory.note}")
    rows = [[f"gpu{d.index}", d.name, d.uuid, f"{_gib(d.memory_used_bytes)} / {_gib(d.memory_total_bytes)}",
             _mig_mode(d.mig_mode, d.mig_mode_pending),
             ", ".join(f"{m.profile}@{m.start}" for m in d.mig_devices) or "-",
             ", ".join(str(p.pid) for p in d.processes) or "-"] for d in inventory.devices]
    if rows:
        lines += ["", *table(["GPU", "NAME", "UUID", "MEMORY USED", "MIG", "MIG DEVICES", "PIDS"], rows)]
    mps = inventory.mps
    lines.append("")
    lines.append("MPS control daemon: " + (f"running (pids {list(mps.control_pids)}, pipe directories "
                                           f"{list(mps.pipe_directories)})" if mps.running else "not running"))
    return "\n".join(lines) + "\n"


def render_plan(plan: Plan) -> str:
    lines = [f"inventory: {plan.inventory_source}", ""]
    rows = [[d.key, d.name, d.mode + ("" if d.managed else " (not ours)"),
             f"{_gib(d.planned_bytes)} / {_gib(d.capacity_bytes)}" if d.capacity_bytes is not None else "-",
             _gib(d.foreign_bytes) if d.foreign_bytes else "-", ", ".join(d.replica_ids) or "-"]
            for d in plan.devices]
    lines += table(["DEVICE", "NAME", "MODE", "PLANNED / USABLE", "OTHERS USE", "REPLICAS"], rows)
    lines += ["", "tree:", *render_tree(plan)]
    rows = [[r.replica_id, r.device_key, r.isolation, _gib(r.memory_bytes),
             "-" if r.memory_fraction is None else f"{r.memory_fraction:.3f}", _gib(r.kv_cache_bytes),
             "-" if r.sm_percent is None else str(r.sm_percent), f"{r.weight:g} ({r.weight_share:.0%})",
             r.env.get("CUDA_VISIBLE_DEVICES") or "(none)"] for r in plan.replicas]
    lines += ["", *table(["REPLICA", "DEVICE", "ISOLATION", "MEMORY", "FRACTION", "KV CACHE", "SM %", "WEIGHT",
                          "CUDA_VISIBLE_DEVICES"], rows)]
    actions = plan.actions()
    lines += ["", "actions:" if actions else "actions: none (the devices already match the plan)"]
    lines += [f"  - {a.describe()}" for a in actions]
    notes = [*plan.notes, *(f"{r.replica_id}: {r.note}" for r in plan.replicas if r.note)]
    if notes:
        lines += ["", "notes:", *(f"  - {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def render_tree(plan: Plan) -> list[str]:
    """`Plan.tree()` indented: each device, its MIG devices, and the replicas in each, with their shares."""
    lines = []
    for device in plan.tree():
        if not device["mig_devices"] and not device["replicas"]:
            continue
        lines.append(f"  {device['device']} ({device['name']}): {device['mode']}")
        for mig in device["mig_devices"]:
            new = ", to create" if mig["to_create"] else ""
            how = "" if mig["sharing"] == "mig" else f", {mig['sharing']} in MIG instance {mig['instance']!r}"
            daemon = f", MPS pipe {mig['mps_pipe_directory']}" if mig["mps_pipe_directory"] else ""
            lines.append(f"    MIG {mig['profile']} at slot {mig['start']} ({_gib(mig['memory_bytes'])}{new}{how}"
                         f"{daemon}): {mig['device']}")
            lines += [f"      {_tree_client(r)}" for r in mig["replicas"]]
        lines += [f"    {_tree_client(r)}" for r in device["replicas"]]
    return lines or ["  (no replica)"]


def _tree_client(replica: Mapping[str, Any]) -> str:
    isolation = replica["isolation"]
    share = (f", {replica['sm_percent']} % of the SMs" if isolation == "mps" and replica["sm_percent"] is not None
             else f", {replica['weight_share']:.0%} of the time" if isolation == "timeslice" else "")
    return f"{replica['replica_id']}: {isolation}, {_gib(replica['memory_bytes'])}{share}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=False)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in [list(headers), *rows]]


def _mig_mode(current: bool | None, pending: bool | None) -> str:
    if current is None:
        return "n/a"
    state = "on" if current else "off"
    return state if pending == current else f"{state} (pending {'on' if pending else 'off'})"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB"


def applied_and_live(state_file: str, env: Mapping[str, str]) -> dict[str, Any]:
    """For `partition status`: what apply recorded, and each running arbiter's shares (or why it did not answer)."""
    from partitioner.planning.placer import arbiter_dir
    from partitioner.timeslice.service import read_stats

    try:
        applied: dict[str, Any] = AppliedStateFile(state_file).load().to_dict()
    except ValueError as exc:
        applied = {"error": str(exc)}
    live = []
    for sock in sorted(arbiter_dir(env).glob("*.sock")):
        try:
            live.append(read_stats(sock))
        except OSError as exc:  # a socket left by a gateway that died: nobody answers
            live.append({"device": sock.stem, "error": f"{sock}: {exc}"})
    return {"applied": applied, "time_shares": live}


def _daemon_device(daemon: Mapping[str, Any]) -> str:
    """What an MPS daemon serves: a whole GPU, or one MIG device of it (a nested plan's shared instance)."""
    uuid = str(daemon["device_uuid"])
    return f"MIG device {uuid} of GPU {daemon['gpu_index']}" if uuid.startswith("MIG-") else \
        f"GPU {daemon['gpu_index']}"


def render_applied_and_live(data: dict[str, Any]) -> str:
    applied = data["applied"]
    lines = ["", "applied by multiserve:"]
    if "error" in applied:
        lines.append(f"  {applied['error']}")
    else:
        lines += [f"  MIG device {uuid} on GPU {gpu}" for uuid, gpu in applied["mig_devices"].items()]
        lines += [f"  MPS daemon for {_daemon_device(d)} (pipe {pipe}): {', '.join(d['settings']) or 'defaults'}"
                  for pipe, d in applied["mps_daemons"].items()]
        if len(lines) == 2:
            lines.append("  nothing")
    lines += ["", "time-slice shares (live):" if data["time_shares"] else "time-slice shares: no arbiter running"]
    for device in data["time_shares"]:
        if "error" in device:
            lines.append(f"  {device['device']}: {device['error']}")
            continue
        lines += [f"  {device['device']}: {c['client_id']} weight {c['weight']:g}: {c['recent_share']:.1%} recently, "
                  f"{c['busy_s']:.1f} s in {c['num_steps']} steps" for c in device["clients"]]
    return "\n".join(lines) + "\n"
