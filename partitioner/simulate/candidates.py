"""Candidate plans for one registry: the same replicas shared in each way the planner knows, each planned by it.

Families (every replica of the registry in each):
- `as configured`: the registry's own placements;
- `mig`: each replica its own MIG device. First as the planner sizes it (the smallest profile that holds its
  memory: static MIG partitioning), then every assignment of larger compute sizes (asked for with `sm_percent`,
  which a mig demand's profile must cover) that fits, keeping only layouts no other layout beats on every replica's
  SMs and memory slices (a larger slice never serves worse: the simulator's monotonicity, tested);
- `mps` and `timeslice` on a whole GPU: thread percentages or weights equal, and by load (each replica's share of
  the offered tokens/s × weight bytes, the work it brings);
- `nested`: one model's replicas on MIG devices of their own (sized as in `mig`), the others sharing one MIG
  instance by MPS or by weight, by load.

A candidate the planner refuses keeps its problems (enumerated mig sizes that do not fit are dropped instead:
there are too many to list).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from partitioner.devices.inventory import Inventory
from partitioner.devices.mig_fit import plannable_profiles
from partitioner.planning.demand import ReplicaDemand
from partitioner.planning.placement import PlanOptions
from partitioner.planning.plan import InfeasiblePlan, Plan
from partitioner.planning.planner import plan

MAX_MIG_LAYOUTS = 4096  # assignments of sizes tried per family before falling back to the memory-sized layout
SHARED_INSTANCE = "shared"


@dataclass(frozen=True)
class Candidate:
    name: str
    family: str  # as configured | mig | mps | timeslice | nested
    plan: Plan | None
    problems: tuple[str, ...] = ()
    static: bool = False  # the memory-sized all-MIG layout: static partitioning, the baseline


def candidate_plans(inventory: Inventory, demands: Sequence[ReplicaDemand], options: PlanOptions,
                    load: Mapping[str, float]) -> list[Candidate]:
    """Every family's candidates (module docstring), in a fixed order. `load`: offered work by model."""
    out = [_planned("as configured", "as configured", inventory, demands, options)]
    sizes = _compute_sizes(inventory)
    out += _mig_family(inventory, [_alone(d) for d in demands], options, sizes, "mig", "{layout}")
    equal = {d.replica_id: 1.0 for d in demands}
    by_load = _replica_load(demands, load)
    for mode in ("mps", "timeslice"):
        for label, weights in (("equal", equal), ("by load", by_load)):
            shared = _shared(demands, mode, weights, instance=None)
            out.append(_planned(f"{mode} {label}: {_shares_text(shared, mode)}", mode, inventory, shared, options))
    models = sorted({d.model for d in demands})
    for alone_model in models if len(models) > 2 else []:
        alone = [_alone(d) for d in demands if d.model == alone_model]
        rest = [d for d in demands if d.model != alone_model]
        for mode in ("mps", "timeslice"):
            shared = _shared(rest, mode, by_load, instance=SHARED_INSTANCE)
            out += _mig_family(inventory, alone, options, sizes, "nested",
                               f"nested: {{layout}}; {_shares_text(shared, mode)} in one MIG instance", shared)
    return out


def _planned(name: str, family: str, inventory: Inventory, demands: Sequence[ReplicaDemand],
             options: PlanOptions) -> Candidate:
    try:
        return Candidate(name, family, plan(inventory, demands, options))
    except InfeasiblePlan as exc:
        return Candidate(name, family, None, exc.problems)


def _alone(d: ReplicaDemand) -> ReplicaDemand:
    return replace(d, isolation="mig", mig_instance=None, sm_percent=None, weight=1.0)


def _shared(demands: Sequence[ReplicaDemand], mode: str, weights: Mapping[str, float],
            instance: str | None) -> list[ReplicaDemand]:
    """`demands` sharing one device by `mode`, their MPS percentages or time-slice weights in proportion to
    `weights` (percentages rounded down, at least 1 each, so they never sum past 100)."""
    total = sum(weights[d.replica_id] for d in demands)
    return [replace(d, isolation=mode, mig_instance=instance,  # type: ignore[arg-type]
                    sm_percent=max(1, int(100 * weights[d.replica_id] / total)) if mode == "mps" else None,
                    weight=round(weights[d.replica_id] / total, 4) if mode == "timeslice" else 1.0)
            for d in demands]


def _replica_load(demands: Sequence[ReplicaDemand], load: Mapping[str, float]) -> dict[str, float]:
    """Each replica's part of its model's load (a model's replicas share it evenly); a model without load gets
    the smallest positive one, so that it still gets a share."""
    counts = {m: sum(1 for d in demands if d.model == m) for m in {d.model for d in demands}}
    positive = [v for v in load.values() if v > 0]
    floor = min(positive, default=1.0) / 100
    return {d.replica_id: max(load.get(d.model, 0.0), floor) / counts[d.model] for d in demands}


def _shares_text(demands: Sequence[ReplicaDemand], mode: str) -> str:
    if mode == "mps":
        return f"mps {' '.join(f'{d.replica_id}={d.sm_percent}%' for d in demands)}"
    return f"timeslice {' '.join(f'{d.replica_id}={d.weight:.0%}' for d in demands)}"


def _compute_sizes(inventory: Inventory) -> list[tuple[int, int]]:
    """(SMs, percent of the GPU) of each distinct compute size a MIG profile offers, on the first MIG-capable GPU;
    the percent asks for at least those SMs (planner: ceil(percent × full / 100) <= SMs)."""
    gpu = next((d for d in inventory.devices if d.mig_capable and plannable_profiles(d)), None)
    if gpu is None:
        return []
    full = max(p.sm_count for p in gpu.mig_profiles)
    return [(sm, max(1, sm * 100 // full)) for sm in sorted({p.sm_count for p in plannable_profiles(gpu)})]


def _mig_family(inventory: Inventory, alone: list[ReplicaDemand], options: PlanOptions, sizes: list[tuple[int, int]],
                family: str, template: str, shared: Sequence[ReplicaDemand] = ()) -> list[Candidate]:
    """The memory-sized layout of `alone` (kept even when infeasible or beaten), then the feasible, undominated
    layouts of larger compute sizes; `shared` replicas ride along unchanged."""
    base = _planned("", family, inventory, [*alone, *shared], options)
    static = None if base.plan is None else _layout(base.plan, alone)
    found = {} if static is None or base.plan is None else {static: base.plan}
    choices = [None, *(pct for _, pct in sizes)]
    if len(choices) ** len(alone) <= MAX_MIG_LAYOUTS:
        for combo in itertools.product(choices, repeat=len(alone)):
            sized = [replace(d, sm_percent=pct) for d, pct in zip(alone, combo, strict=True)]
            if sized == alone:  # the memory-sized layout: planned above
                continue
            try:
                result = plan(inventory, [*sized, *shared], options)
            except InfeasiblePlan:
                continue
            found.setdefault(_layout(result, alone), result)
    kept = [(layout, p) for layout, p in found.items()
            if layout == static or not any(_dominates(other, layout) for other in found)]
    named = [Candidate(template.replace("{layout}", _layout_text(layout) + (" (memory-sized)"
                                                                           if layout == static else "")), family, p,
                       static=family == "mig" and layout == static)
             for layout, p in sorted(kept, key=lambda item: item[0] != static)]
    if base.plan is None:
        text = "memory-sized mig " + " ".join(d.replica_id for d in alone)
        named.insert(0, Candidate(template.replace("{layout}", text), family, None, base.problems))
    return named


_Layout = tuple[tuple[str, str, int, int], ...]  # (replica, profile, SMs, memory slices), by replica


def _layout(result: Plan, alone: Sequence[ReplicaDemand]) -> _Layout:
    ids = {d.replica_id for d in alone}
    rows = []
    for device in result.devices:
        for m in device.mig_devices:
            if m.replica_id in ids:
                sm = result.replica(m.replica_id).sm_percent or 0
                rows.append((m.replica_id, m.profile, sm, m.memory_slices))
    return tuple(sorted(rows))


def _dominates(a: _Layout, b: _Layout) -> bool:
    """Every replica gets at least as many SMs and memory slices in `a` as in `b`, and one gets more."""
    pairs = list(zip(a, b, strict=True))
    return all(x[2] >= y[2] and x[3] >= y[3] for x, y in pairs) and any(x[2:] != y[2:] for x, y in pairs)


def _layout_text(layout: _Layout) -> str:
    return "mig " + " ".join(f"{rid}={profile}" for rid, profile, _, _ in layout)
