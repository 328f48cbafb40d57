"""A stand-in for the `pynvml` module, built from `GpuDevice`s: the same call shapes and error classes, so the NVML
backend's reading code runs here without a GPU. Only read calls exist; anything else is an AttributeError."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

from partitioner.devices.inventory import GpuDevice
from registry.fields import MIB

NVML_DEVICE_MIG_ENABLE = 1
NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_NotFound(NVMLError):
    pass


class NVMLError_NoPermission(NVMLError):
    pass


class NVMLError_InvalidArgument(NVMLError):
    pass


class NVMLError_FunctionNotFound(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


class c_nvmlGpuInstancePlacement_t(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


class FakeNvml:
    """`FakeNvml(gpus)` behaves like `pynvml` on a host with those GPUs. `privileged=False`: listing GPU instances
    raises NoPermission, as for a normal user. `init_error`: nvmlInit raises it."""

    def __init__(self, gpus: list[GpuDevice], privileged: bool = True, init_error: NVMLError | None = None,
                 failing: dict[str, NVMLError] | None = None) -> None:
        self.gpus, self.privileged, self.init_error, self.failing = gpus, privileged, init_error, failing or {}
        self.shutdowns = 0
        for name, value in globals().items():
            if name.startswith(("NVML", "c_nvml")):
                setattr(self, name, value)

    def __getattribute__(self, name: str) -> Any:
        failing = object.__getattribute__(self, "failing")
        if name in failing:
            def fail(*_: Any) -> Any:
                raise failing[name]
            return fail
        return object.__getattribute__(self, name)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> tuple[str, int]:
        return ("gpu", index)

    def _gpu(self, handle: tuple) -> GpuDevice:
        return self.gpus[handle[1]]

    def nvmlDeviceGetUUID(self, handle: tuple) -> bytes:
        gpu = self._gpu(handle)
        return (gpu.mig_devices[handle[2]].uuid if handle[0] == "mig" else gpu.uuid).encode()

    def nvmlDeviceGetName(self, handle: tuple) -> str:
        gpu = self._gpu(handle)
        return f"{gpu.name} MIG {gpu.mig_devices[handle[2]].profile}" if handle[0] == "mig" else gpu.name

    def nvmlDeviceGetMemoryInfo(self, handle: tuple) -> SimpleNamespace:
        gpu = self._gpu(handle)
        if handle[0] == "mig":
            total = gpu.mig_devices[handle[2]].memory_total_bytes
            return SimpleNamespace(total=total, free=total, used=0)
        return SimpleNamespace(total=gpu.memory_total_bytes, free=gpu.memory_free_bytes, used=gpu.memory_used_bytes)

    def nvmlDeviceGetMigMode(self, handle: tuple) -> list[int]:
        gpu = self._gpu(handle)
        if gpu.mig_mode is None:
            raise NVMLError_NotSupported()
        return [int(gpu.mig_mode), int(bool(gpu.mig_mode_pending))]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: tuple, enum_id: int) -> SimpleNamespace:
        profiles = self._gpu(handle).mig_profiles
        if enum_id >= len(profiles):
            raise NVMLError_NotSupported()
        p = profiles[enum_id]
        return SimpleNamespace(id=p.profile_id, sliceCount=p.slice_count, instanceCount=p.max_instances,
                               multiprocessorCount=p.sm_count, memorySizeMB=p.memory_bytes // MIB,
                               name=f"MIG {p.name}".encode())

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: tuple, profile_id: int, array: Any,
                                                   count_ref: Any) -> int:
        profile = next(p for p in self._gpu(handle).mig_profiles if p.profile_id == profile_id)
        for i, start in enumerate(profile.placements):
            array[i].start, array[i].size = start, profile.memory_slices
        count_ref._obj.value = len(profile.placements)
        return 0

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: tuple) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: tuple, i: int) -> tuple[str, int, int]:
        if i >= len(self._gpu(handle).mig_devices):
            raise NVMLError_NotFound()
        return ("mig", handle[1], i)

    def nvmlDeviceGetAttributes(self, handle: tuple) -> SimpleNamespace:
        return SimpleNamespace(gpuInstanceSliceCount=self._gpu(handle).mig_devices[handle[2]].slice_count)

    def nvmlDeviceGetGpuInstanceId(self, handle: tuple) -> int:
        return self._gpu(handle).mig_devices[handle[2]].gpu_instance_id or 0

    def nvmlDeviceGetGpuInstanceById(self, handle: tuple, gi_id: int) -> tuple[str, int, int]:
        if not self.privileged:
            raise NVMLError_NoPermission()
        devices = self._gpu(handle).mig_devices
        return ("gi", handle[1], next(i for i, m in enumerate(devices) if m.gpu_instance_id == gi_id))

    def nvmlGpuInstanceGetInfo(self, gi: tuple) -> SimpleNamespace:
        m = self._gpu(gi).mig_devices[gi[2]]
        return SimpleNamespace(placement=SimpleNamespace(start=m.start, size=m.memory_slices))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: tuple) -> list[SimpleNamespace]:
        gpu = self._gpu(handle)
        if handle[0] == "gpu" and gpu.mig_mode:
            raise NVMLError_NotSupported()
        where = gpu.mig_devices[handle[2]].uuid if handle[0] == "mig" else None
        return [SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_memory_bytes)
                for p in gpu.processes if p.device_uuid == where]


class NVMLError_InUse(NVMLError):
    pass


class NVMLError_InsufficientResources(NVMLError):
    pass


_ERRORS = {"no_permission": NVMLError_NoPermission, "in_use": NVMLError_InUse,
           "insufficient_resources": NVMLError_InsufficientResources, "invalid_argument": NVMLError_InvalidArgument,
           "not_found": NVMLError_NotFound}
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 9
# compute-instance profile ids by slice count, as in nvml.h
_CI_PROFILES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}
for _slices, _ci in _CI_PROFILES.items():
    globals()[f"NVML_COMPUTE_INSTANCE_PROFILE_{_slices}_SLICE"] = _ci


class c_nvmlComputeInstance_t(ctypes.c_void_p):
    pass


class FakeNvmlMig(FakeNvml):
    """`FakeNvml` that can also create and destroy MIG devices, with NVML's call sequence (GPU instance with
    placement, then its compute instance; destroy compute instances, then the GPU instance). The rules and
    injected errors are the fake backend's; `calls` records the state-changing NVML calls in order."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.calls: list[tuple[str, tuple]] = []
        super().__init__(list(backend.snapshot().devices))
        for name, value in globals().items():
            if name.startswith(("NVML", "c_nvml")):
                setattr(self, name, value)

    def _do(self, name: str, operation: Any, *args: Any) -> Any:
        from partitioner.devices.backend import DeviceError

        self.calls.append((name, args))
        try:
            result = operation(*args)
        except DeviceError as exc:
            raise _ERRORS.get(exc.kind, NVMLError)(str(exc)) from None
        self.gpus = list(self.backend.snapshot().devices)
        return result

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: tuple, profile_id: int, placement: Any) -> tuple:
        gpu = self._gpu(handle)
        name = next(p.name for p in gpu.mig_profiles if p.profile_id == profile_id)
        made = self._do("create_gpu_instance", self.backend.create_mig_device, handle[1], name, placement.start)
        position = next(i for i, m in enumerate(self.gpus[handle[1]].mig_devices) if m.uuid == made.uuid)
        return ("gi", handle[1], position)

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: tuple, ci_profile: int, engine: int) -> Any:
        m = self._gpu(gi).mig_devices[gi[2]]
        if _CI_PROFILES.get(m.slice_count) != ci_profile:
            raise NVMLError_NotSupported()  # only the full compute profile, in this fake
        return SimpleNamespace(id=ci_profile, instanceCount=1)

    def nvmlGpuInstanceCreateComputeInstance(self, gi: tuple, ci_profile_id: int) -> c_nvmlComputeInstance_t:
        self.calls.append(("create_compute_instance", (gi[1], ci_profile_id)))
        return c_nvmlComputeInstance_t(1)

    def nvmlGpuInstanceGetInfo(self, gi: tuple) -> SimpleNamespace:
        m = self._gpu(gi).mig_devices[gi[2]]
        return SimpleNamespace(id=m.gpu_instance_id, placement=SimpleNamespace(start=m.start, size=m.memory_slices))

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes | str) -> tuple:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self.gpus:
            for i, m in enumerate(gpu.mig_devices):
                if m.uuid == text:
                    return ("mig", gpu.index, i)
        raise NVMLError_NotFound()

    def nvmlGpuInstanceGetComputeInstances(self, gi: tuple, profile_id: int, array: Any, count_ref: Any) -> int:
        array[0] = c_nvmlComputeInstance_t(gi[2] + 1)
        count_ref._obj.value = 1
        return 0

    def nvmlComputeInstanceDestroy(self, compute: Any) -> int:
        self.calls.append(("destroy_compute_instance", ()))
        return 0

    def nvmlGpuInstanceDestroy(self, gi: tuple) -> int:
        uuid = self._gpu(gi).mig_devices[gi[2]].uuid
        self._do("destroy_gpu_instance", self.backend.destroy_mig_device, gi[1], uuid)
        return 0
