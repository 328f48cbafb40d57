"""Turn the planner's placements into a `Plan`: MIG slots, MPS shares and pipe directories, env, fractions, weights."""

from __future__ import annotations

from dataclasses import replace

from partitioner.devices.inventory import Inventory
from partitioner.devices.mig_fit import Slot, fit_placements, max_compute_slices
from partitioner.planning.placement import GpuState, Placed, PlanOptions, shared_key
from partitioner.planning.plan import DevicePlan, Plan, PlannedMigDevice, ReplicaPlan
from registry.fields import MIB


def build_plan(inventory: Inventory, gpus: list[GpuState], cpu: list[Placed], options: PlanOptions) -> Plan:
    devices, replicas = [], []
    for gpu in gpus:
        device, planned = _gpu_plan(gpu, inventory, options)
        devices.append(device)
        replicas += planned
    if cpu:
        total_weight = sum(p.demand.weight for p in cpu)
        devices.append(DevicePlan(key="cpu", name="cpu", mode="timeslice", managed=True,
                                  replica_ids=tuple(sorted(p.demand.replica_id for p in cpu))))
        replicas += [_replica(p, "cpu", "timeslice", {"CUDA_VISIBLE_DEVICES": ""}, None, p.demand.weight / total_weight)
                     for p in cpu]
    notes = [inventory.note] if inventory.note else []
    replicas.sort(key=lambda r: (r.model, r.replica))
    return Plan(inventory_source=inventory.source, devices=tuple(devices), replicas=tuple(replicas),
                notes=tuple(notes))


def _gpu_plan(gpu: GpuState, inventory: Inventory, options: PlanOptions) -> tuple[DevicePlan, list[ReplicaPlan]]:
    dev, key = gpu.dev, f"gpu{gpu.dev.index}"
    base = {"key": key, "name": dev.name, "index": dev.index, "uuid": dev.uuid, "managed": gpu.managed,
            "foreign_bytes": gpu.foreign_bytes}
    if not gpu.placed:
        capacity = gpu.capacity_bytes if gpu.managed else None
        return DevicePlan(mode="none", capacity_bytes=capacity, **base), []  # type: ignore[arg-type]
    placed = sorted(gpu.placed, key=lambda p: p.demand.replica_id)
    ids = tuple(sorted(rid for p in placed for rid in p.replica_ids()))
    if gpu.mode == "mig":
        return _mig_plan(gpu, placed, ids, base, inventory, options)
    pipe = f"{options.mps_pipe_root}/{key}" if gpu.mode == "mps" else None
    start_daemon = pipe is not None and pipe not in inventory.mps.pipe_directories
    replicas = _sharing_replicas(placed, key, gpu.mode, dev.uuid, dev.memory_total_bytes, pipe, dev.index)
    device = DevicePlan(mode=gpu.mode, capacity_bytes=gpu.capacity_bytes, planned_bytes=gpu.planned_bytes,
                        mps_pipe_directory=pipe, start_mps_daemon=start_daemon, replica_ids=ids,
                        **base)  # type: ignore[arg-type]
    return device, replicas


def _mig_plan(gpu: GpuState, placed: list[Placed], ids: tuple[str, ...], base: dict, inventory: Inventory,
              options: PlanOptions) -> tuple[DevicePlan, list[ReplicaPlan]]:
    dev = gpu.dev
    new = [p for p in gpu.placed if p.profile is not None]  # planning order: the order the slot search saw
    starts = fit_placements([p.profile for p in new if p.profile is not None], [Slot.of(m) for m in dev.mig_devices],
                            max_compute_slices(dev))
    if starts is None:  # the planner checked this very layout when it accepted the last of them
        raise AssertionError(f"GPU {dev.index}: planned MIG layout no longer fits: {[p.profile for p in new]}")
    start_of = {p.demand.replica_id: s for p, s in zip(new, starts, strict=True)}
    full_sm = max((q.sm_count for q in dev.mig_profiles), default=0) or 1
    migs, replicas = [], []
    for p in placed:
        rid = p.demand.replica_id
        if p.reused is not None:
            m = p.reused
            known = dev.profile(m.profile)
            mig = PlannedMigDevice(profile=m.profile, profile_id=known.profile_id if known else -1, start=m.start,
                                   memory_slices=m.memory_slices, memory_bytes=m.memory_total_bytes, replica_id=rid,
                                   uuid=m.uuid)
            sm = known.sm_count if known else 0
        else:
            q = p.profile
            assert q is not None
            mig = PlannedMigDevice(profile=q.name, profile_id=q.profile_id, start=start_of[rid],
                                   memory_slices=q.memory_slices, memory_bytes=q.memory_bytes, replica_id=rid)
            sm = q.sm_count
        if p.instance is not None:
            mig, clients = _shared_mig_device(mig, p, dev.index, inventory, options)
            replicas += clients
        else:
            replicas.append(_replica(p, f"gpu{dev.index}", "mig", {"CUDA_VISIBLE_DEVICES": mig.device_ref},
                                     (p.demand.memory_bytes or 0) / mig.memory_bytes, 1.0,
                                     sm_percent=round(100 * sm / full_sm), gpu_index=dev.index))
        migs.append(mig)
    capacity = sum(int(m.memory_bytes * options.max_memory_fraction) for m in migs)
    device = DevicePlan(mode="mig", capacity_bytes=capacity, planned_bytes=gpu.planned_bytes,
                        enable_mig=not dev.mig_mode, mig_devices=tuple(sorted(migs, key=lambda m: (m.start or 0))),
                        replica_ids=ids, **base)
    return device, replicas


def _shared_mig_device(mig: PlannedMigDevice, p: Placed, gpu_index: int, inventory: Inventory,
                       options: PlanOptions) -> tuple[PlannedMigDevice, list[ReplicaPlan]]:
    """The MIG device of a shared instance, with its own MPS daemon when its members use MPS, and its members'
    plan entries: each sees only that MIG device, and MPS clients reach its daemon through its pipe directory.

    The device key (and so the pipe and log directories and the arbiter's socket) follows the MIG device's slot,
    not the instance's name: a daemon serves one MIG device, so a re-plan that moves the instance must start a
    new daemon rather than find the old one, which still serves the old device."""
    key = f"gpu{gpu_index}-mig{mig.start}" if mig.start is not None else f"gpu{gpu_index}-{mig.uuid}"
    members = list(p.members)
    pipe = f"{options.mps_pipe_root}/{key}" if p.sharing == "mps" else None
    replicas = _sharing_replicas(members, key, str(p.sharing), mig.device_ref, mig.memory_bytes, pipe, gpu_index)
    shared = replace(mig, replica_id=shared_key(str(p.instance)), instance=p.instance, sharing=p.sharing,
                     clients=tuple(m.demand.replica_id for m in members), device_key=key, mps_pipe_directory=pipe,
                     start_mps_daemon=pipe is not None and pipe not in inventory.mps.pipe_directories)
    return shared, replicas


def _sharing_replicas(placed: list[Placed], key: str, mode: str, visible: str, memory_total: int, pipe: str | None,
                      gpu_index: int | None) -> list[ReplicaPlan]:
    """The plan entries of replicas that share one device (`visible`: a GPU's or a MIG device's UUID, or its
    placeholder) in `mode`: time shares by weight, and with an MPS `pipe`, thread percentages and the MPS env."""
    shares = _mps_shares(placed) if pipe is not None else {}
    total_weight = sum(p.demand.weight for p in placed)
    replicas = []
    for p in placed:
        env = {"CUDA_VISIBLE_DEVICES": visible}
        if pipe is not None:
            env |= _mps_env(pipe, shares[p.demand.replica_id], p.demand.memory_bytes)
        replicas.append(_replica(p, key, mode, env, (p.demand.memory_bytes or 0) / memory_total,
                                 p.demand.weight / total_weight, sm_percent=shares.get(p.demand.replica_id),
                                 gpu_index=gpu_index))
    return replicas


def _mps_shares(placed: list[Placed]) -> dict[str, int]:
    """Thread percentages: as asked; replicas that did not ask split what is left equally (at least 1 each)."""
    asked = sum(p.demand.sm_percent or 0 for p in placed)
    open_ = [p for p in placed if p.demand.sm_percent is None]
    each = max(1, (100 - asked) // len(open_)) if open_ else 0
    return {p.demand.replica_id: p.demand.sm_percent or each for p in placed}


def _mps_env(pipe: str, percent: int, memory_bytes: int | None) -> dict[str, str]:
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent)}
    if memory_bytes:  # device ordinal 0: the client sees only its GPU (CUDA_VISIBLE_DEVICES is its UUID)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={memory_bytes // MIB}M"
    return env


def _replica(p: Placed, key: str, isolation: str, env: dict[str, str], fraction: float | None, share: float,
             sm_percent: int | None = None, gpu_index: int | None = None) -> ReplicaPlan:
    d = p.demand
    return ReplicaPlan(replica_id=d.replica_id, model=d.model, replica=d.replica, device_key=key,
                       isolation=isolation, requested_isolation=d.isolation, env=env, gpu_index=gpu_index,
                       memory_bytes=d.memory_bytes, memory_fraction=fraction, kv_cache_bytes=d.kv_cache_bytes,
                       sm_percent=sm_percent, weight=d.weight, weight_share=share, note=p.note)

