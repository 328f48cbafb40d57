"""A stand-in for the `pynvml` module, built from `GpuDevice`s: the same call shapes and error classes, so the NVML
backend's reading code runs here without a GPU. Only read calls exist; anything else is an AttributeError.

Where pynvml hands a caller's argument straight to a C pointer parameter (the placement to create, the arrays and
counts to fill), this fake is as strict as C: see `_points_to` and `_array_of`."""

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


_BYREF = type(ctypes.byref(ctypes.c_uint()))


def _pointed_at(function: str, parameter: str, argument: Any, ctype: type[Any]) -> Any:
    """What a C pointer parameter sees. pynvml sets no argtypes and forwards these arguments to C unchanged, so
    ctypes pushes a Structure or a c_uint by value: C reads its bytes as an address and crashes, or writes
    somewhere else. Here that is a TypeError. byref, pointer and an array (C sees its first element) are pointers."""
    if isinstance(argument, _BYREF):
        return argument._obj  # type: ignore[attr-defined]  # what byref points at
    if isinstance(argument, ctypes._Pointer):
        return argument.contents
    if isinstance(argument, ctypes.Array):
        return argument
    how = "passed by value" if isinstance(argument, ctypes._SimpleCData | ctypes.Structure | int) else "not a pointer"
    raise TypeError(f"{function}: {parameter} is a {type(argument).__name__} {how}, but C takes a "
                    f"{ctype.__name__} * (pass ctypes.byref or ctypes.pointer)")


def _points_to(function: str, parameter: str, argument: Any, ctype: type[Any]) -> Any:
    """The one `ctype` object a `ctype *` parameter points at; a one-element array will do, as it would in C."""
    target = _pointed_at(function, parameter, argument, ctype)
    if isinstance(target, ctypes.Array) and len(target) and issubclass(target._type_, ctype):
        return ctype.from_buffer(target)  # its first element, sharing the caller's memory
    if not isinstance(target, ctype):
        raise TypeError(f"{function}: {parameter} points at a {type(target).__name__}, not a {ctype.__name__}")
    return target


def _array_of(function: str, parameter: str, argument: Any, ctype: type[Any]) -> Any:
    """The ctypes array of `ctype` that a `ctype *` output parameter fills. A Python list is not one (ctypes
    cannot pass it), nor is a single struct by value."""
    target = _pointed_at(function, parameter, argument, ctype)
    if not (isinstance(target, ctypes.Array) and issubclass(target._type_, ctype)):
        raise TypeError(f"{function}: {parameter} must be a ctypes array of {ctype.__name__}, "
                        f"not {type(target).__name__}")
    return target


def _fill(function: str, array: Any, count_ref: Any, values: list[Any]) -> None:
    """Writes `values` into a caller's array and their number through its `unsigned int *count`. NVML writes as many
    as exist: an array too small would be overrun in C, so it is an error here."""
    count = _points_to(function, "count", count_ref, ctypes.c_uint)
    if len(values) > len(array):
        raise AssertionError(f"{function}: {len(values)} entries overrun the caller's array of {len(array)}")
    for i, value in enumerate(values):
        array[i] = value
    count.value = len(values)


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
        name = "nvmlDeviceGetGpuInstancePossiblePlacements"
        placements = _array_of(name, "placements", array, c_nvmlGpuInstancePlacement_t)
        profile = next(p for p in self._gpu(handle).mig_profiles if p.profile_id == profile_id)
        _fill(name, placements, count_ref,
              [c_nvmlGpuInstancePlacement_t(start, profile.memory_slices) for start in profile.placements])
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
        """C takes `const nvmlGpuInstancePlacement_t *placement`; NVML refuses a size that is not the profile's."""
        where = _points_to("nvmlDeviceCreateGpuInstanceWithPlacement", "placement", placement,
                           c_nvmlGpuInstancePlacement_t)
        gpu = self._gpu(handle)
        profile = next(p for p in gpu.mig_profiles if p.profile_id == profile_id)
        if where.size != profile.memory_slices:
            raise NVMLError_InvalidArgument(f"placement size {where.size}, profile {profile.name} "
                                            f"takes {profile.memory_slices}")
        made = self._do("create_gpu_instance", self.backend.create_mig_device, handle[1], profile.name,
                        int(where.start))
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
        name = "nvmlGpuInstanceGetComputeInstances"
        instances = _array_of(name, "computeInstances", array, c_nvmlComputeInstance_t)
        _fill(name, instances, count_ref, [c_nvmlComputeInstance_t(gi[2] + 1)])
        return 0

    def nvmlComputeInstanceDestroy(self, compute: Any) -> int:
        self.calls.append(("destroy_compute_instance", ()))
        return 0

    def nvmlGpuInstanceDestroy(self, gi: tuple) -> int:
        uuid = self._gpu(gi).mig_devices[gi[2]].uuid
        self._do("destroy_gpu_instance", self.backend.destroy_mig_device, gi[1], uuid)
        return 0
