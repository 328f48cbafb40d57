"""From a `Plan` to the simulator's pools: what each replica gets of its device.

- a mig replica: its MIG device alone, with the profile's SMs over the GPU's (the largest profile's count) and its
  memory slices over the GPU's (the largest profile's) as its bandwidth fraction;
- mps / timeslice replicas of a shared MIG instance: that MIG device's fractions, shared by MPS or by weight;
- mps / timeslice / exclusive replicas of a whole GPU: all of it, shared the same ways;
- the CPU: time-sliced, at `cpu_speed` (there is no datasheet for it: measure it, bench/measure/).

Each member's KV cache is the plan's KV budget for it.
"""

from __future__ import annotations

from collections.abc import Mapping

from partitioner.devices.inventory import Inventory
from partitioner.planning.plan import DevicePlan, Plan, PlannedMigDevice, ReplicaPlan
from partitioner.simulate.cost import GPU_SPEEDS, DeviceSpeed, Share
from partitioner.simulate.simulator import Member, Pool

WHOLE = Share(1.0, 1.0)


def plan_pools(plan: Plan, inventory: Inventory, speeds: Mapping[str, DeviceSpeed] = GPU_SPEEDS,
               cpu_speed: DeviceSpeed | None = None) -> list[Pool]:
    """The pools of `plan`'s replicas. Raises ValueError for a device with no known speed or a replica with no KV
    budget."""
    pools = []
    for device in plan.devices:
        if not device.replica_ids:  # (shared MIG instances' members included)
            continue
        speed = _speed(device, speeds, cpu_speed)
        if device.mode == "mig":
            pools += [_mig_pool(m, device, plan, inventory, speed) for m in device.mig_devices]
            continue
        replicas = [r for r in plan.replicas if r.device_key == device.key]
        if device.mode in ("mps", "timeslice"):
            pools.append(Pool(device.key, device.mode, WHOLE, speed, tuple(_member(r) for r in replicas)))
        else:
            pools += [Pool(r.replica_id, "alone", WHOLE, speed, (_member(r),)) for r in replicas]
    return pools


def _speed(device: DevicePlan, speeds: Mapping[str, DeviceSpeed], cpu_speed: DeviceSpeed | None) -> DeviceSpeed:
    if device.key == "cpu":
        if cpu_speed is None:
            raise ValueError("the plan time-slices replicas on the CPU, whose speed has no datasheet: pass a "
                             "measured cpu_speed (bench/measure/timeslice_simulation.py measures one)")
        return cpu_speed
    if device.name not in speeds:
        raise ValueError(f"{device.key}: no speed known for {device.name!r} (known: {sorted(speeds)})")
    return speeds[device.name]


def _mig_pool(mig: PlannedMigDevice, device: DevicePlan, plan: Plan, inventory: Inventory,
              speed: DeviceSpeed) -> Pool:
    assert device.index is not None  # a MIG device is on a GPU
    gpu = inventory.gpu(device.index)
    profile = gpu.profile(mig.profile)
    if profile is None:
        raise ValueError(f"{device.key}: MIG profile {mig.profile!r} is not in the inventory's table "
                         f"({[p.name for p in gpu.mig_profiles]}), so its share of the GPU is unknown")
    full_sm = max(p.sm_count for p in gpu.mig_profiles)
    full_slices = max(p.memory_slices for p in gpu.mig_profiles)
    share = Share(profile.sm_count / full_sm, mig.memory_slices / full_slices)
    if mig.sharing is None:
        return Pool(mig.device_ref, "alone", share, speed, (_member(plan.replica(mig.replica_id)),))
    clients = tuple(_member(plan.replica(rid)) for rid in mig.clients)
    return Pool(mig.device_key or mig.device_ref, "mps" if mig.sharing == "mps" else "timeslice", share, speed,
                clients)


def _member(r: ReplicaPlan) -> Member:
    if r.kv_cache_bytes is None:
        raise ValueError(f"{r.replica_id}: the plan gives it no KV budget: set the model's engine.kv_cache_gib, or "
                         f"placement.memory_gib with its shape")
    percent = r.sm_percent if r.isolation == "mps" and r.sm_percent is not None else 100
    return Member(r.replica_id, r.model, r.kv_cache_bytes, sm_fraction=percent / 100, weight=r.weight)
