"""The planner: a pure function from an inventory and replica demands to a `Plan` (or `InfeasiblePlan`).

Each GPU gets one mode. `mig`: every replica its own MIG device (an existing free one first, else the smallest
profile that holds it, placed by an exhaustive slot search). `mps`: replicas share the GPU under MPS with thread
percentages summing to at most 100 and pinned-memory limits. `timeslice`: replicas share it by weight (the
arbiter enforces it). `exclusive`: one replica alone. Replicas on the CPU are time-sliced by weight.

Plans nest one level: mps or timeslice replicas that name the same `mig_instance` share one MIG device, placed on a
`mig` GPU like a mig replica the size of their summed memory; inside it they share by MPS (thread percentages of
the instance's SMs, at most 100 in all) or by weight.

Demands are placed in a fixed order (exclusive, mig, mps, timeslice; larger first; then by id), each on the first
GPU that takes it (GPUs already in its mode first), so the same input always gives the same plan. Memory admission
counts what processes that are not ours use. GPUs outside `PlanOptions.gpus` are never touched, and MIG mode is
never turned off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from partitioner.devices.inventory import GpuDevice, Inventory, MigDevice, MigProfile
from partitioner.devices.mig_fit import Slot, fit_placements, max_compute_slices, plannable_profiles
from partitioner.planning.demand import ReplicaDemand
from partitioner.planning.placement import GpuState, Placed, PlanOptions, shared_key
from partitioner.planning.plan import InfeasiblePlan, Plan
from partitioner.planning.plan_build import build_plan
from registry.fields import Device, gib

_ORDER = {"exclusive": 0, "mig": 1, "mps": 2, "timeslice": 3}


def plan(inventory: Inventory, demands: Sequence[ReplicaDemand], options: PlanOptions | None = None) -> Plan:
    """Place every demand on a device of `inventory`. Raises `InfeasiblePlan` listing every demand that does not
    fit, where it was tried and by how much it missed."""
    options = options or PlanOptions()
    ids = [d.replica_id for d in demands]
    if len(set(ids)) != len(ids):
        raise ValueError(f"replica ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    missing = sorted(set(options.gpus or ()) - {dev.index for dev in inventory.devices})
    if missing:
        raise InfeasiblePlan([f"the config names GPU(s) {missing}, which the inventory ({inventory.source}) "
                              f"does not have (it has {[dev.index for dev in inventory.devices]})"])
    gpus = [_gpu_state(dev, options) for dev in inventory.devices]
    managed = [g for g in gpus if g.managed]
    resolved = [_resolve(d, managed, inventory, options) for d in demands]
    problems = [r for r in resolved if isinstance(r, str)]
    placeable, instance_problems = _fold_shared_instances([r for r in resolved if not isinstance(r, str)], options)
    problems += instance_problems
    cpu: list[Placed] = []
    for placed in sorted(placeable, key=_order_key):
        if placed.isolation == "cpu":
            cpu.append(placed)
            continue
        problem = _place(placed, managed, options)
        if problem:
            problems.append(problem)
    if problems:
        raise InfeasiblePlan(problems)
    _settle_mig_assignment(managed, options)
    return build_plan(inventory, gpus, cpu, options)


def _fold_shared_instances(placed: list[Placed], options: PlanOptions) -> tuple[list[Placed], list[str]]:
    """Replace the replicas that name a MIG instance by one mig placement per instance, sized to their summed
    memory, so the MIG rules (profiles, slots, reuse) treat the instance as one replica; and the problems of the
    instances whose members cannot share one (mixed isolation, MPS over 100 %)."""
    out: list[Placed] = []
    groups: dict[str, list[Placed]] = {}
    for p in placed:
        if p.isolation != "cpu" and p.demand.mig_instance is not None:
            groups.setdefault(p.demand.mig_instance, []).append(p)
        else:
            out.append(p)
    problems = []
    for name, members in sorted(groups.items()):
        members.sort(key=lambda m: m.demand.replica_id)
        problem = _shared_instance_problem(name, members, options)
        if problem is not None:
            problems.append(problem)
            continue
        memory = sum(m.demand.memory_bytes or 0 for m in members)
        device: Device = "cuda" if any(m.demand.device == "cuda" for m in members) else "auto"
        stand_in = ReplicaDemand(model=shared_key(name), replica=0, isolation="mig", memory_bytes=memory,
                                 device=device)
        out.append(Placed(stand_in, "mig", instance=name, members=tuple(members)))
    return out, problems


def _shared_instance_problem(name: str, members: list[Placed], options: PlanOptions) -> str | None:
    """Why `members` cannot share one MIG instance, or None."""
    ids = {kind: [m.demand.replica_id for m in members if m.isolation == kind] for kind in ("mps", "timeslice")}
    where = f"MIG instance {name!r}"
    if ids["mps"] and ids["timeslice"]:
        return (f"{where}: {', '.join(ids['mps'])} ask mps and {', '.join(ids['timeslice'])} timeslice; the "
                f"replicas of one instance share it one way (all mps or all timeslice)")
    if not ids["mps"]:
        return None
    if len(members) > options.max_mps_clients:
        return (f"{where}: {len(members)} mps replicas, but MPS allows {options.max_mps_clients} clients per device: "
                f"over by {len(members) - options.max_mps_clients}")
    shares = [m.demand.sm_percent or 1 for m in members]
    if sum(shares) > 100:
        return (f"{where} (mps: {', '.join(ids['mps'])}): MPS thread percentages {shares} of the instance's SMs "
                f"would sum to {sum(shares)} %: over 100 % by {sum(shares) - 100}")
    return None


def _settle_mig_assignment(gpus: list[GpuState], options: PlanOptions) -> None:
    """Re-deal the chosen MIG devices (reused and to be created) to the mig replicas, as a later re-plan of the
    applied state would: in placement order, each replica takes the smallest device of the final set that
    holds it. Greedy placement alone gave the reused devices out first, so a re-plan, which finds the created
    devices existing, could swap replicas between GPUs (and restart them) for nothing.

    Left as placed when the re-deal does not seat everyone (it always does when sizes are nested, as MIG
    profiles are; the fallback keeps a valid plan regardless).
    """
    mig = [(gpu, q) for gpu in gpus if gpu.mode == "mig" for q in gpu.placed]
    if len(mig) < 2:
        return

    def size(gpu: GpuState, q: Placed) -> tuple[int, int, int, int]:
        if q.reused is not None:
            return (q.reused.memory_total_bytes, q.reused.slice_count, gpu.dev.index, q.reused.start or 0)
        assert q.profile is not None
        return (q.profile.memory_bytes, q.profile.slice_count, gpu.dev.index, 1 << 30)  # start: decided later

    def holds(gpu: GpuState, q: Placed, demand: ReplicaDemand) -> bool:
        if q.reused is not None:
            return _fits_mig_device(demand, q.reused, gpu.dev, options)
        assert q.profile is not None
        return _fits(demand, q.profile.memory_bytes, q.profile.sm_count, gpu.dev, options)

    free = sorted(mig, key=lambda slot: size(*slot))
    dealt: list[tuple[GpuState, Placed]] = []
    for _, placed in sorted(mig, key=lambda slot: _order_key(slot[1])):
        slot = next(((g, q) for g, q in free if holds(g, q, placed.demand)), None)
        if slot is None:
            return
        free.remove(slot)
        gpu, device = slot
        dealt.append((gpu, replace(placed, profile=device.profile, reused=device.reused)))
    for gpu in {id(g): g for g, _ in mig}.values():
        gpu.placed = [q for g, q in dealt if g is gpu]


def _gpu_state(dev: GpuDevice, options: PlanOptions) -> GpuState:
    own = options.own_pids
    foreign = sum(p.used_memory_bytes or 0 for p in dev.processes if p.pid not in own)
    if not dev.mig_mode:  # the driver's own reservations show in `used` too; those are not ours either
        own_used = sum(p.used_memory_bytes or 0 for p in dev.processes if p.pid in own)
        foreign = max(foreign, dev.memory_used_bytes - own_used)
    managed = options.gpus is None or dev.index in options.gpus
    return GpuState(dev, managed, foreign, int(dev.memory_total_bytes * options.max_memory_fraction) - foreign)


def _order_key(p: Placed) -> tuple[int, int, int, str, int]:
    d = p.demand
    return (_ORDER.get(p.isolation, 4), -(d.memory_bytes or 0), -(d.sm_percent or 0), d.model, d.replica)


def _resolve(d: ReplicaDemand, managed: list[GpuState], inventory: Inventory,
             options: PlanOptions) -> Placed | str:
    """Where the demand goes (the CPU, or a GPU with which isolation), or the problem why it cannot go anywhere."""
    on_cpu = "" if d.isolation == "timeslice" else f"{d.isolation} isolation needs a GPU; time-sliced on the CPU"
    if d.device == "cpu":
        return Placed(d, "cpu", on_cpu)
    if not managed:
        if d.device == "cuda":
            why = (f"the inventory has none ({inventory.source}{': ' + inventory.note if inventory.note else ''})"
                   if inventory.is_cpu else f"the config names none of the inventory's GPUs {options.gpus}")
            return f"{d.replica_id}: needs a GPU (device: cuda), but {why}"
        return Placed(d, "cpu", on_cpu)
    if d.memory_bytes is None:
        if d.draft_unsized is not None:
            return (f"{d.replica_id}: its memory is unknown, so it cannot be admitted to a GPU: the shape of its draft "
                    f"model {d.draft_unsized!r} is not known (its files are not here): give that model's shape, or "
                    f"set this model's placement.memory_gib")
        return (f"{d.replica_id}: its memory is unknown, so it cannot be admitted to a GPU: set the model's "
                f"placement.memory_gib, or give its shape (layers, KV heads, head size, weight bytes)")
    if d.mig_instance is not None and not any(g.dev.mig_capable and plannable_profiles(g.dev) for g in managed):
        gpus = ", ".join(g.label() for g in managed)
        if options.mig_fallback is None:
            return (f"{d.replica_id}: shares MIG instance {d.mig_instance!r}, but no GPU it may use can do MIG "
                    f"({gpus}); set a fallback to share a whole GPU instead")
        return Placed(replace(d, mig_instance=None), d.isolation,
                      f"no MIG-capable GPU ({gpus}): {d.isolation} on a whole GPU, not in MIG instance "
                      f"{d.mig_instance!r}")
    if d.isolation == "mig" and not any(g.dev.mig_capable and plannable_profiles(g.dev) for g in managed):
        gpus = ", ".join(g.label() for g in managed)
        if options.mig_fallback is None:
            return f"{d.replica_id}: needs a MIG device, but no GPU it may use can do MIG ({gpus}); set a fallback"
        return Placed(d, options.mig_fallback, f"no MIG-capable GPU ({gpus}): {options.mig_fallback} instead of mig")
    return Placed(d, d.isolation)


def _place(p: Placed, gpus: list[GpuState], options: PlanOptions) -> str | None:
    """Put `p` on a GPU; the problem (with every GPU's reason) if none takes it."""
    if p.isolation == "mig":
        return _place_mig(p, gpus, options)
    reasons = []
    for gpu in sorted(gpus, key=lambda g: (g.mode != p.isolation, g.dev.index)):
        reason = _shared_gpu_refusal(p, gpu, options)
        if reason is None:
            gpu.mode = p.isolation  # type: ignore[assignment]  # mps | timeslice | exclusive
            gpu.placed.append(p)
            return None
        reasons.append(f"{gpu.label()}: {reason}")
    return _refused(p, reasons)


def _shared_gpu_refusal(p: Placed, gpu: GpuState, options: PlanOptions) -> str | None:
    if gpu.dev.mig_mode:
        return "MIG mode is on (only mig replicas; the planner never turns MIG off)"
    if gpu.mode not in ("none", p.isolation) or (p.isolation == "exclusive" and gpu.placed):
        hint = ("; mps/timeslice replicas share a MIG GPU only inside a MIG instance: set their "
                "placement.mig_instance" if gpu.mode == "mig" else "")
        return f"already planned for {gpu.mode} with {len(gpu.placed)} replica(s) (one mode per GPU{hint})"
    need, free = p.demand.memory_bytes or 0, gpu.capacity_bytes - gpu.planned_bytes
    if need > free:
        return (f"{gib(free)} free of {gib(gpu.capacity_bytes)} usable ({len(gpu.placed)} replica(s) planned, "
                f"{gib(gpu.foreign_bytes)} used by other processes): short by {gib(need - free)}")
    if p.isolation == "mps":
        if len(gpu.placed) >= options.max_mps_clients:
            return f"MPS allows {options.max_mps_clients} clients per device"
        shares = [q.demand.sm_percent or 1 for q in gpu.placed] + [p.demand.sm_percent or 1]
        if sum(shares) > 100:
            return f"MPS thread percentages would sum to {sum(shares)} %: over 100 % by {sum(shares) - 100}"
    return None


def _place_mig(p: Placed, gpus: list[GpuState], options: PlanOptions) -> str | None:
    reused = _free_mig_device(p, gpus, options)
    if reused is not None:
        gpu, device = reused
        gpu.mode = "mig"
        gpu.placed.append(replace(p, isolation="mig", reused=device))
        return None
    reasons = []
    order = sorted(gpus, key=lambda g: (0 if g.dev.mig_mode else 1 if g.mode == "mig" else 2, g.dev.index))
    for gpu in order:
        reason = _mig_refusal(gpu)
        if reason is None:
            profile = _first_fitting_profile(p, gpu, options)
            if profile is not None:
                gpu.mode = "mig"
                gpu.placed.append(replace(p, isolation="mig", profile=profile))
                return None
            reason = _no_profile_reason(p, gpu, options)
        reasons.append(f"{gpu.label()}: {reason}")
    return _refused(p, reasons)


def _mig_refusal(gpu: GpuState) -> str | None:
    dev = gpu.dev
    if not dev.mig_capable or not plannable_profiles(dev):
        return "cannot do MIG"
    if not dev.mig_mode:
        if gpu.mode not in ("none", "mig"):
            return f"already planned for {gpu.mode}"
        if dev.processes:
            return f"MIG mode is off and {len(dev.processes)} process(es) run on it (enabling MIG needs it idle)"
    if any(m.start is None for m in dev.mig_devices):
        return "the placements of its MIG devices are unknown (listing GPU instances needs root)"
    return None


def _sm_needed(demand: ReplicaDemand, dev: GpuDevice) -> int:
    full = max((q.sm_count for q in dev.mig_profiles), default=0)
    return math.ceil((demand.sm_percent or 0) * full / 100)


def _fits(demand: ReplicaDemand, memory_bytes: int, sm_count: int, dev: GpuDevice, options: PlanOptions) -> bool:
    return ((demand.memory_bytes or 0) <= int(memory_bytes * options.max_memory_fraction)
            and sm_count >= _sm_needed(demand, dev))


def _fits_mig_device(demand: ReplicaDemand, m: MigDevice, dev: GpuDevice, options: PlanOptions) -> bool:
    """`demand` fits the existing MIG device `m` (a profile the tables do not know offers no SMs)."""
    known = dev.profile(m.profile)
    return _fits(demand, m.memory_total_bytes, known.sm_count if known else 0, dev, options)


def _free_mig_device(p: Placed, gpus: list[GpuState],
                     options: PlanOptions) -> tuple[GpuState, MigDevice] | None:
    """The smallest existing MIG device that holds the demand and that nobody else uses."""
    candidates = []
    for gpu in gpus:
        if not gpu.dev.mig_mode:
            continue
        busy = {q.device_uuid for q in gpu.dev.processes if q.pid not in options.own_pids}
        taken = {q.reused.uuid for q in gpu.placed if q.reused is not None}
        for m in gpu.dev.mig_devices:
            if m.uuid not in busy | taken and _fits_mig_device(p.demand, m, gpu.dev, options):
                candidates.append(((m.memory_total_bytes, m.slice_count, gpu.dev.index, m.start or 0, m.uuid),
                                   gpu, m))
    if not candidates:
        return None
    _, gpu, device = min(candidates, key=lambda c: c[0])
    return gpu, device


def _first_fitting_profile(p: Placed, gpu: GpuState, options: PlanOptions) -> MigProfile | None:
    dev = gpu.dev
    planned = [q.profile for q in gpu.placed if q.profile is not None]
    taken = [Slot.of(m) for m in dev.mig_devices]
    for profile in plannable_profiles(dev):
        if _fits(p.demand, profile.memory_bytes, profile.sm_count, dev, options) and \
                fit_placements([*planned, profile], taken, max_compute_slices(dev)) is not None:
            return profile
    return None


def _no_profile_reason(p: Placed, gpu: GpuState, options: PlanOptions) -> str:
    fitting = [q for q in plannable_profiles(gpu.dev) if _fits(p.demand, q.memory_bytes, q.sm_count, gpu.dev, options)]
    if not fitting:
        largest = plannable_profiles(gpu.dev)[-1]
        usable = int(largest.memory_bytes * options.max_memory_fraction)
        short = max((p.demand.memory_bytes or 0) - usable, 0)
        sm = f" and {_sm_needed(p.demand, gpu.dev)} SMs" if p.demand.sm_percent else ""
        return (f"no MIG profile holds {gib(p.demand.memory_bytes or 0)}{sm}: the largest, {largest.name}, "
                f"gives {gib(usable)} usable ({largest.sm_count} SMs): short by {gib(short)}")
    taken = [f"{m.profile} at slot {m.start} (existing)" for m in gpu.dev.mig_devices]
    taken += [f"{q.profile.name} for {q.label()} ({gib(q.demand.memory_bytes or 0)})" for q in gpu.placed
              if q.profile is not None]
    return f"no free slots for {fitting[0].name} or larger: taken by " + ", ".join(taken) + _slot_shortfall(p, gpu,
                                                                                                          options)


def _slot_shortfall(p: Placed, gpu: GpuState, options: PlanOptions) -> str:
    """By how much the demand misses the largest profile that still has a free slot (or that none has)."""
    planned = [q.profile for q in gpu.placed if q.profile is not None]
    taken = [Slot.of(m) for m in gpu.dev.mig_devices]
    free = [q for q in plannable_profiles(gpu.dev)
            if fit_placements([*planned, q], taken, max_compute_slices(gpu.dev)) is not None]
    if not free:
        return "; no slot is left for any profile"
    largest = free[-1]
    usable = int(largest.memory_bytes * options.max_memory_fraction)
    short = (p.demand.memory_bytes or 0) - usable
    if short <= 0:  # its memory would fit; the SMs asked for do not
        return (f"; the largest that still fits, {largest.name}, has {largest.sm_count} SMs: short by "
                f"{_sm_needed(p.demand, gpu.dev) - largest.sm_count} SMs")
    return f"; the largest that still fits, {largest.name}, gives {gib(usable)} usable: short by {gib(short)}"


def _refused(p: Placed, reasons: list[str]) -> str:
    d = p.demand
    if p.instance is not None:  # the label already says who shares it and how
        head = f"MIG instance {p.instance!r} ({p.sharing} for {', '.join(p.replica_ids())}; needs " \
               f"{gib(d.memory_bytes or 0)} in all)"
    else:
        sm = f", {d.sm_percent} % SMs" if d.sm_percent else ""
        head = f"{d.replica_id} ({p.isolation}, needs {gib(d.memory_bytes or 0)}{sm})"
    return f"{head} does not fit: " + "; ".join(reasons)


