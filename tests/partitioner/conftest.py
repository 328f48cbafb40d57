"""Factories for the partitioner tests: inventories built from the shipped MIG tables, and replica demands."""

from __future__ import annotations

from dataclasses import replace

from foundation.config_files import config_path
from partitioner.devices.inventory import DeviceProcess, Inventory, load_inventory
from partitioner.planning.demand import ReplicaDemand
from registry.fields import GIB

INVENTORIES = config_path("inventories")
GPU_FILES = ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb")


def gpus(kind: str = "h100-80gb", count: int = 1, mig_mode: bool = False,
         processes: dict[int, list[DeviceProcess]] | None = None) -> Inventory:
    """`count` idle GPUs of one shipped kind, indices 0.., each with its own UUID; `processes` by GPU index."""
    base = load_inventory(INVENTORIES / f"{kind}.json")
    template = base.devices[0]
    devices = []
    for i in range(count):
        procs = tuple((processes or {}).get(i, ()))
        used = sum(p.used_memory_bytes or 0 for p in procs)
        devices.append(replace(template, index=i, uuid=f"{template.uuid[:-2]}{i:02d}", mig_mode=mig_mode,
                               mig_mode_pending=mig_mode, processes=procs, memory_used_bytes=used,
                               memory_free_bytes=template.memory_total_bytes - used))
    return replace(base, devices=tuple(devices), source=f"fake:{kind}")


def demand(model: str, replica: int = 0, isolation: str = "timeslice", gib: float | None = 1.0,
           **fields: object) -> ReplicaDemand:
    memory = None if gib is None else int(gib * GIB)
    return ReplicaDemand(model=model, replica=replica, isolation=isolation, memory_bytes=memory,
                         **fields)
