"""Reading a host's devices: through a `DeviceBackend` (NVML, or a fake over an inventory file), with the MIG
tables shipped in configs/inventories/ filling in what NVML does not list; no NVML means a CPU inventory."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from partitioner.devices.backend import BackendUnavailable, DeviceBackend
from partitioner.devices.catalog import known_mig_profiles
from partitioner.devices.inventory import GpuDevice, Inventory, MigProfile

ProfileLookup = Callable[[GpuDevice], tuple[tuple[MigProfile, ...], str]]


def read_inventory(backend: DeviceBackend, known_profiles: ProfileLookup | None = None) -> Inventory:
    """Read every GPU through `backend`. Without NVML (no driver, no library) the result is a CPU inventory.

    NVML lists MIG profiles only while MIG mode is on; `known_profiles` (default: the tables shipped in
    `configs/inventories/`) fills them in for a MIG-capable GPU that reports none, so MIG can still be planned.
    """
    try:
        backend.open()
    except BackendUnavailable as exc:
        return Inventory(devices=(), source="cpu", note=f"no NVML: {exc}; everything plans onto the CPU")
    try:
        devices = [backend.read_gpu(i) for i in range(backend.gpu_count())]
        mps = backend.read_mps()
    finally:
        backend.close()
    lookup = known_profiles or known_mig_profiles
    notes = [] if devices else ["NVML found no GPU; everything plans onto the CPU"]
    for i, device in enumerate(devices):
        if device.mig_capable and not device.mig_profiles:
            profiles, where = lookup(device)
            if profiles:
                devices[i] = replace(device, mig_profiles=profiles)
                notes.append(f"GPU {device.index}: MIG profiles from {where} (NVML lists them only with MIG on)")
    return Inventory(devices=tuple(devices), source=backend.source, note="; ".join(notes), mps=mps)


def load_host_inventory(inventory_file: str | None, env: Mapping[str, str]) -> Inventory:
    """The inventory file's GPUs (a fake backend), else this host's through NVML (a CPU inventory without it)."""
    backend: DeviceBackend
    if inventory_file is not None:
        from partitioner.devices.fake_backend import FakeBackend

        backend = FakeBackend.from_file(inventory_file)
    else:
        from partitioner.devices.mps_probe import candidate_pipe_directories, probe_mps
        from partitioner.devices.nvml_backend import NvmlBackend

        backend = NvmlBackend(mps_probe=lambda: probe_mps(candidate_pipe_directories(env)))
    return read_inventory(backend)
