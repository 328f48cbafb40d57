"""The MIG profile tables shipped in `configs/inventories/`, looked up by GPU name.

NVML lists a GPU's MIG profiles only while MIG mode is on; to plan MIG for a GPU whose MIG mode is still off, the
planner uses the shipped table for the same product (same NVML name, same memory size within 2 %).
"""

from __future__ import annotations

import functools
from pathlib import Path

from foundation.config_files import config_path, shown_path
from partitioner.devices.inventory import GpuDevice, Inventory, MigProfile, load_inventory

INVENTORY_DIR = config_path("inventories")


@functools.cache
def shipped_inventories(directory: Path = INVENTORY_DIR) -> tuple[tuple[str, Inventory], ...]:
    """Every inventory file of `directory`, by file name, in name order."""
    return tuple((path.name, load_inventory(path)) for path in sorted(directory.glob("*.json")))


def known_mig_profiles(gpu: GpuDevice, directory: Path = INVENTORY_DIR) -> tuple[tuple[MigProfile, ...], str]:
    """The shipped profiles for `gpu`'s product and the file they came from, or `((), "")` when none matches."""
    for file_name, inventory in shipped_inventories(directory):
        for known in inventory.devices:
            same_size = abs(known.memory_total_bytes - gpu.memory_total_bytes) <= 0.02 * known.memory_total_bytes
            if known.name.lower() == gpu.name.lower() and same_size and known.mig_profiles:
                return known.mig_profiles, shown_path(directory / file_name)
    return (), ""
