"""What devices a host has: plain, immutable data the planner reads, and its JSON form (partitioner/devices/read.py
reads it through a `DeviceBackend`).

Memory is in bytes everywhere (`*_bytes`). MIG placements use NVML's coordinates: a start slot and a size on the
GPU's memory-slice axis (8 slots on A100/H100/H200), exactly as `nvidia-smi mig -lgipp` prints `{starts}:size`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile a GPU offers: a row of `nvidia-smi mig -lgip` with its placements (`-lgipp`)."""

    name: str  # "3g.40gb", as in the MIG device's name; "+me" profiles keep their suffix
    profile_id: int  # NVML's GPU-instance profile id, the ID column of `-lgip` (9 for 3g.*): what creation takes
    slice_count: int  # compute slices, the "3g"
    memory_slices: int  # slots it covers on the memory axis: the `:size` of `-lgipp`
    memory_bytes: int
    sm_count: int
    max_instances: int
    placements: tuple[int, ...]  # valid start slots


@dataclass(frozen=True)
class MigDevice:
    """A MIG device that exists now (a GPU instance with its compute instance)."""

    uuid: str  # "MIG-..." : what CUDA_VISIBLE_DEVICES takes
    profile: str
    start: int | None  # None when NVML would not say (listing GPU instances needs root)
    memory_slices: int
    slice_count: int
    memory_total_bytes: int
    gpu_instance_id: int | None = None


@dataclass(frozen=True)
class DeviceProcess:
    """A compute process on a GPU or on one of its MIG devices."""

    pid: int
    used_memory_bytes: int | None  # None: the driver does not report it (e.g. inside a container without the pid)
    device_uuid: str | None = None  # the MIG device it runs on; None: the whole GPU


@dataclass(frozen=True)
class GpuDevice:
    """One physical GPU as NVML reports it."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    memory_used_bytes: int
    mig_mode: bool | None = None  # current MIG mode; None: the GPU cannot do MIG
    mig_mode_pending: bool | None = None  # takes effect at the next GPU reset
    mig_profiles: tuple[MigProfile, ...] = ()
    mig_devices: tuple[MigDevice, ...] = ()
    processes: tuple[DeviceProcess, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return self.mig_mode is not None

    def profile(self, name: str) -> MigProfile | None:
        return next((p for p in self.mig_profiles if p.name == name), None)


@dataclass(frozen=True)
class MpsStatus:
    """MPS control daemons seen on the host (no privileged calls: a process scan and pipe directories)."""

    control_pids: tuple[int, ...] = ()
    pipe_directories: tuple[str, ...] = ()  # pipe directories whose `control` pipe exists

    @property
    def running(self) -> bool:
        return bool(self.control_pids or self.pipe_directories)


@dataclass(frozen=True)
class Inventory:
    """Every GPU of the host, or none: then everything runs on the CPU."""

    devices: tuple[GpuDevice, ...]
    source: str  # "nvml" | "fake:<file>" | "cpu"
    note: str = ""
    mps: MpsStatus = field(default_factory=MpsStatus)

    @property
    def is_cpu(self) -> bool:
        return not self.devices

    def gpu(self, index: int) -> GpuDevice:
        for device in self.devices:
            if device.index == index:
                return device
        raise KeyError(f"no GPU with index {index} in the inventory ({self.source})")


# --- JSON -------------------------------------------------------------------------------------------------------


class InventoryFileError(ValueError):
    """An inventory file that does not parse; the message names the file and the field."""


def inventory_to_dict(inventory: Inventory) -> dict[str, Any]:
    """JSON-ready: the dataclass fields, tuples as lists."""
    return asdict(inventory)


def save_inventory(inventory: Inventory, path: str | Path) -> None:
    Path(path).write_text(json.dumps(inventory_to_dict(inventory), indent=2) + "\n")


def load_inventory(path: str | Path) -> Inventory:
    """Read an inventory file written by `save_inventory` (or by hand). Raises `InventoryFileError`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InventoryFileError(f"{path}: {exc}") from None
    try:
        return inventory_from_dict(data)
    except InventoryFileError as exc:
        raise InventoryFileError(f"{path}: {exc}") from None


def inventory_from_dict(data: Any) -> Inventory:
    """The inverse of `inventory_to_dict`; every error names the field (`devices[0].mig_profiles[2].name`)."""
    d = _Fields(data, "")
    return Inventory(
        devices=tuple(_gpu(g, f"devices[{i}]") for i, g in enumerate(d.get("devices", list))),
        source=d.get("source", str), note=d.get("note", str, ""),
        mps=_mps(d.get("mps", dict, {}), "mps"))


def _gpu(data: Any, where: str) -> GpuDevice:
    d = _Fields(data, where)
    return GpuDevice(
        index=d.get("index", int), uuid=d.get("uuid", str), name=d.get("name", str),
        memory_total_bytes=d.get("memory_total_bytes", int), memory_free_bytes=d.get("memory_free_bytes", int),
        memory_used_bytes=d.get("memory_used_bytes", int),
        mig_mode=d.get("mig_mode", bool, None), mig_mode_pending=d.get("mig_mode_pending", bool, None),
        mig_profiles=tuple(_profile(p, f"{where}.mig_profiles[{i}]")
                           for i, p in enumerate(d.get("mig_profiles", list, []))),
        mig_devices=tuple(_mig_device(m, f"{where}.mig_devices[{i}]")
                          for i, m in enumerate(d.get("mig_devices", list, []))),
        processes=tuple(_process(p, f"{where}.processes[{i}]") for i, p in enumerate(d.get("processes", list, []))))


def _profile(data: Any, where: str) -> MigProfile:
    d = _Fields(data, where)
    return MigProfile(
        name=d.get("name", str), profile_id=d.get("profile_id", int), slice_count=d.get("slice_count", int),
        memory_slices=d.get("memory_slices", int), memory_bytes=d.get("memory_bytes", int),
        sm_count=d.get("sm_count", int), max_instances=d.get("max_instances", int),
        placements=tuple(d.get("placements", list)))


def _mig_device(data: Any, where: str) -> MigDevice:
    d = _Fields(data, where)
    return MigDevice(
        uuid=d.get("uuid", str), profile=d.get("profile", str), start=d.get("start", int, None),
        memory_slices=d.get("memory_slices", int), slice_count=d.get("slice_count", int),
        memory_total_bytes=d.get("memory_total_bytes", int), gpu_instance_id=d.get("gpu_instance_id", int, None))


def _process(data: Any, where: str) -> DeviceProcess:
    d = _Fields(data, where)
    return DeviceProcess(pid=d.get("pid", int), used_memory_bytes=d.get("used_memory_bytes", int, None),
                         device_uuid=d.get("device_uuid", str, None))


def _mps(data: Any, where: str) -> MpsStatus:
    d = _Fields(data, where)
    return MpsStatus(control_pids=tuple(d.get("control_pids", list, [])),
                     pipe_directories=tuple(d.get("pipe_directories", list, [])))


_REQUIRED = object()


class _Fields:
    """Typed access to one JSON object, with errors that name the field."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise InventoryFileError(f"{where or '(top level)'}: expected an object, got {type(data).__name__}")
        self.data, self.where = data, where

    def get(self, key: str, kind: type, default: Any = _REQUIRED) -> Any:
        name = f"{self.where}.{key}" if self.where else key
        if key not in self.data or self.data[key] is None:
            if default is _REQUIRED:
                raise InventoryFileError(f"{name}: required")
            return default
        value = self.data[key]
        # bool is an int in Python; an inventory never means True by 1
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InventoryFileError(f"{name}: expected {kind.__name__}, got {value!r}")
        return value
