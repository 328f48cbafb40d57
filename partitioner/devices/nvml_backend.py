"""`DeviceBackend` over NVML. The only module of multiserve that imports `pynvml` (package nvidia-ml-py).

Reading needs no privileges. The only changes it can make are the applier's MIG devices (`create_mig_device`,
`destroy_mig_device`: root on real hardware); nothing here changes MIG mode, clocks or any other device setting.
A host without the NVML library or driver is not an error: `open` raises `BackendUnavailable` with the reason,
and `inventory.read_inventory` turns that into a CPU inventory.

Most pynvml wrappers build their C arguments themselves; three forward ours to C unchanged and with no argtypes
(the placement to create, the placement and compute-instance arrays to fill, their counts). Those must be ctypes
pointers (`ctypes.byref`, or an array, which C sees as a pointer to its first element): a Structure or a c_uint
would be pushed by value and its bytes read as an address.
"""

from __future__ import annotations

import ctypes
import importlib
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from partitioner.devices.backend import BackendUnavailable, DeviceError, ErrorKind
from partitioner.devices.inventory import DeviceProcess, GpuDevice, MigDevice, MigProfile, MpsStatus
from partitioner.devices.mps_probe import DEFAULT_PIPE_DIRECTORY, probe_mps
from registry.fields import MIB

# NVML error class name -> our kind. Names, not codes, so a fake module in tests needs only the classes it raises.
_KINDS: dict[str, ErrorKind] = {
    "NVMLError_NoPermission": "no_permission",
    "NVMLError_InUse": "in_use",
    "NVMLError_InsufficientResources": "insufficient_resources",
    "NVMLError_NotSupported": "not_supported",
    "NVMLError_InvalidArgument": "invalid_argument",
    "NVMLError_NotFound": "not_found",
}
_INIT_REASONS = {
    "NVMLError_LibraryNotFound": "the NVML library (libnvidia-ml.so.1) was not found: no NVIDIA driver here",
    "NVMLError_DriverNotLoaded": "the NVIDIA driver is not loaded",
    "NVMLError_NoPermission": "no permission to open NVML",
}
# "MIG 1g.18gb", "MIG 1g.18gb+me"; newer drivers also list variants such as "1g.18gb-me" and "1g.18gb+me.all",
# kept whole so that a variant is never read as its base profile (two profiles of one name)
_PROFILE_NAME = re.compile(r"(\d+g\.\d+gb(?:[+-][a-z][a-z.]*)?)")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# How NVML refuses a GPU-instance profile id this GPU does not have (NVML error class names)
NO_SUCH_PROFILE = ("NVMLError_NotSupported", "NVMLError_InvalidArgument", "NVMLError_NotFound")


def profile_name(raw: str | bytes) -> str:
    """A GPU-instance profile's name as the shipped tables write it ("MIG 1g.18gb+me" -> "1g.18gb+me")."""
    text = _text(raw)
    match = _PROFILE_NAME.search(text)
    return match.group(1) if match else text


class NvmlBackend:
    """Reads GPUs through NVML. `nvml` replaces the `pynvml` module (tests); `mps_probe` the MPS scan."""

    source = "nvml"

    def __init__(self, nvml: ModuleType | None = None,
                 mps_probe: Callable[[], MpsStatus] | None = None) -> None:
        self._module = nvml
        self._mps_probe = mps_probe or (lambda: probe_mps([DEFAULT_PIPE_DIRECTORY]))
        self._nvml: Any = None

    def open(self) -> None:
        try:
            nvml = self._module or importlib.import_module("pynvml")
        except ImportError as exc:
            raise BackendUnavailable(f"pynvml is not installed ({exc})") from None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            reason = _INIT_REASONS.get(type(exc).__name__, f"NVML did not start: {exc}")
            raise BackendUnavailable(reason) from None
        except OSError as exc:  # a broken library that loads but cannot be called
            raise BackendUnavailable(f"NVML did not start: {exc}") from None
        self._nvml = nvml

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """NVML errors -> `DeviceError` naming what was being read."""
        try:
            yield
        except self._nvml.NVMLError as exc:
            raise DeviceError(_KINDS.get(type(exc).__name__, "unknown"), f"{what}: {exc}") from None

    def _lib(self) -> Any:
        if self._nvml is None:
            raise RuntimeError("NvmlBackend used before open()")
        return self._nvml

    def gpu_count(self) -> int:
        nvml = self._lib()
        with self._errors("counting GPUs"):
            return int(nvml.nvmlDeviceGetCount())

    def read_gpu(self, index: int) -> GpuDevice:
        nvml = self._lib()
        with self._errors(f"GPU {index}"):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            mig_mode, pending = self._mig_mode(handle)
            profiles = self._profiles(handle) if mig_mode else ()
            mig_devices, processes = (self._mig_devices(handle, profiles) if mig_mode
                                      else ((), self._processes(handle, None)))
            return GpuDevice(
                index=index, uuid=_text(nvml.nvmlDeviceGetUUID(handle)), name=_text(nvml.nvmlDeviceGetName(handle)),
                memory_total_bytes=int(memory.total), memory_free_bytes=int(memory.free),
                memory_used_bytes=int(memory.used), mig_mode=mig_mode, mig_mode_pending=pending,
                mig_profiles=profiles, mig_devices=mig_devices,
                processes=processes)

    def read_mps(self) -> MpsStatus:
        return self._mps_probe()

    # --- MigControl (privileged) --------------------------------------------------------------------------------

    def create_mig_device(self, index: int, profile: str, start: int) -> MigDevice:
        """A GPU instance of `profile` at `start` and its full compute instance, as `nvidia-smi mig -cgi P:S -C`."""
        nvml = self._lib()
        with self._errors(f"GPU {index}: create MIG device {profile} at slot {start}"):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            profiles = self._profiles(handle)
            known = next((p for p in profiles if p.name == profile), None)
            if known is None:
                raise DeviceError("invalid_argument", f"GPU {index} has no MIG profile {profile!r} "
                                                      f"(has {[p.name for p in profiles]})")
            placement = nvml.c_nvmlGpuInstancePlacement_t(start, known.memory_slices)
            # pynvml forwards `placement` to C unchanged, with no argtypes: C takes a pointer, and a Structure
            # passed as is would go by value, its bytes read as an address.
            gpu_instance = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                handle, known.profile_id, ctypes.byref(placement))
            try:
                ci_profile = getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{known.slice_count}_SLICE")
                info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gpu_instance, ci_profile, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
                nvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, info.id)
            except nvml.NVMLError:
                nvml.nvmlGpuInstanceDestroy(gpu_instance)  # a GPU instance without compute is of no use to anyone
                raise
            gi_id = int(nvml.nvmlGpuInstanceGetInfo(gpu_instance).id)
            devices, _ = self._mig_devices(handle, profiles)
        found = next((m for m in devices if m.gpu_instance_id == gi_id), None)
        if found is None:
            raise DeviceError("not_found", f"GPU {index}: created GPU instance {gi_id}, but no MIG device shows it")
        return found

    def destroy_mig_device(self, index: int, uuid: str) -> None:
        """Its compute instances, then its GPU instance. NVML says InUse while processes run on it."""
        nvml = self._lib()
        with self._errors(f"GPU {index}: destroy MIG device {uuid}"):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gi_id = nvml.nvmlDeviceGetGpuInstanceId(nvml.nvmlDeviceGetHandleByUUID(uuid))
            gpu_instance = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            for compute in self._compute_instances(gpu_instance):
                nvml.nvmlComputeInstanceDestroy(compute)
            nvml.nvmlGpuInstanceDestroy(gpu_instance)

    def _compute_instances(self, gpu_instance: Any) -> list[Any]:
        nvml = self._nvml
        found = []
        for ci_profile in range(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gpu_instance, ci_profile, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument, nvml.NVMLError_NotFound):
                continue  # no such compute profile on this GPU instance
            array = (nvml.c_nvmlComputeInstance_t * max(1, int(info.instanceCount)))()
            count = ctypes.c_uint(len(array))
            nvml.nvmlGpuInstanceGetComputeInstances(gpu_instance, info.id, array, ctypes.byref(count))
            found += [array[i] for i in range(count.value)]
        return found

    def _mig_mode(self, handle: Any) -> tuple[bool | None, bool | None]:
        nvml = self._nvml
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError_NotSupported:
            return None, None
        enabled = nvml.NVML_DEVICE_MIG_ENABLE
        return current == enabled, pending == enabled

    def _profiles(self, handle: Any) -> tuple[MigProfile, ...]:
        """Every GPU-instance profile NVML offers (only while MIG mode is on), with its possible placements. None
        when NVML refuses to describe them (NoPermission, as in some containers): `read_inventory` then fills in the
        shipped table, as for a GPU with MIG off."""
        nvml = self._nvml
        profiles: list[MigProfile] = []
        for enum_id in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum_id)
            except tuple(getattr(nvml, name) for name in NO_SUCH_PROFILE):
                continue  # this GPU has no such profile
            except nvml.NVMLError_NoPermission:
                return ()
            if info.instanceCount == 0:
                continue
            starts, size = self._placements(handle, info.id, info.instanceCount)
            profiles.append(MigProfile(
                name=profile_name(info.name), profile_id=int(info.id),
                slice_count=int(info.sliceCount), memory_slices=size, memory_bytes=int(info.memorySizeMB) * MIB,
                sm_count=int(info.multiprocessorCount), max_instances=int(info.instanceCount), placements=starts))
        return tuple(profiles)

    def _placements(self, handle: Any, profile_id: int, capacity: int) -> tuple[tuple[int, ...], int]:
        nvml = self._nvml
        # The placement list holds at most one entry per slot; 8 slots on every MIG GPU so far, 16 leaves room.
        array = (nvml.c_nvmlGpuInstancePlacement_t * max(16, capacity))()
        count = ctypes.c_uint(len(array))
        try:
            nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
        except nvml.NVMLError_FunctionNotFound:  # a driver too old for the _v2 call: no placements known
            return (), 0
        entries = [array[i] for i in range(count.value)]
        return tuple(sorted(int(e.start) for e in entries)), (int(entries[0].size) if entries else 0)

    def _mig_devices(self, handle: Any, profiles: tuple[MigProfile, ...],
                     ) -> tuple[tuple[MigDevice, ...], tuple[DeviceProcess, ...]]:
        nvml = self._nvml
        devices: list[MigDevice] = []
        processes: list[DeviceProcess] = []
        for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except nvml.NVMLError_NotFound:
                continue  # no MIG device at this index
            uuid = _text(nvml.nvmlDeviceGetUUID(mig))
            match = _PROFILE_NAME.search(_text(nvml.nvmlDeviceGetName(mig)))
            attributes = nvml.nvmlDeviceGetAttributes(mig)
            gi_id = int(nvml.nvmlDeviceGetGpuInstanceId(mig))
            profile = match.group(1) if match else "unknown"
            start, size = self._gpu_instance_placement(handle, gi_id)
            if size is None:  # not allowed to ask: the profile's placement size is the same number
                size = next((p.memory_slices for p in profiles if p.name == profile), 0)
            devices.append(MigDevice(
                uuid=uuid, profile=profile, start=start,
                memory_slices=size, slice_count=int(attributes.gpuInstanceSliceCount),
                memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(mig).total), gpu_instance_id=gi_id))
            processes += self._processes(mig, uuid)
        return tuple(devices), tuple(processes)

    def _gpu_instance_placement(self, handle: Any, gi_id: int) -> tuple[int | None, int | None]:
        nvml = self._nvml
        try:
            info = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id))
        except nvml.NVMLError_NoPermission:  # listing GPU instances is privileged
            return None, None
        return int(info.placement.start), int(info.placement.size)

    def _processes(self, handle: Any, device_uuid: str | None) -> tuple[DeviceProcess, ...]:
        nvml = self._nvml
        try:
            found = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except nvml.NVMLError_NotSupported:
            return ()
        return tuple(DeviceProcess(pid=int(p.pid), device_uuid=device_uuid,
                                   used_memory_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory))
                     for p in found)
