"""A `DeviceBackend` (and `MigControl`) over an inventory held in memory: for tests, and for planning without a GPU.

It models what the applier will run into on real hardware: MIG slot occupancy under the real placement rules
(`mig_fit`), processes that keep a GPU or MIG device in use, MPS daemons by pipe directory (one per directory,
each serving the device it was started on, which it keeps in use), and NVML errors (`NoPermission`, `InUse`,
`InsufficientResources`, ...) injected into the next call of an operation.
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import replace
from pathlib import Path

from partitioner.devices.backend import BackendUnavailable, DeviceError, ErrorKind
from partitioner.devices.inventory import DeviceProcess, GpuDevice, Inventory, MigDevice, MpsStatus, load_inventory
from partitioner.devices.mig_fit import Slot, max_compute_slices, placement_conflict

Operation = str  # "read_gpu" | "set_mig_mode" | "create_mig_device" | "destroy_mig_device" | "start_mps" | ...


class FakeBackend:
    """Fake GPUs. `unavailable` makes `open` fail like a host without NVML, with that reason."""

    def __init__(self, inventory: Inventory, source: str | None = None, unavailable: str | None = None) -> None:
        self._gpus: dict[int, GpuDevice] = {d.index: d for d in inventory.devices}
        self._mps = inventory.mps
        self._source = source or inventory.source
        self._unavailable = unavailable
        self._faults: dict[Operation, list[ErrorKind]] = {}
        self._next_gi = {d.index: 1 + max((m.gpu_instance_id or 0 for m in d.mig_devices), default=0)
                         for d in inventory.devices}
        self.calls: list[tuple[Operation, tuple[object, ...]]] = []  # every state-changing call, in order
        self._daemon_devices: dict[str, str] = {}  # pipe directory -> the GPU or MIG device its daemon serves

    @classmethod
    def from_file(cls, path: str | Path) -> FakeBackend:
        """The inventory file's GPUs; `source` becomes `fake:<path>`."""
        return cls(load_inventory(path), source=f"fake:{path}")

    @property
    def source(self) -> str:
        return self._source

    def inject(self, operation: Operation, kind: ErrorKind, times: int = 1) -> None:
        """Make the next `times` calls of `operation` raise `DeviceError(kind)` before they change anything."""
        self._faults.setdefault(operation, []).extend([kind] * times)

    def _check(self, operation: Operation, what: str, *args: object) -> None:
        if operation in {"set_mig_mode", "create_mig_device", "destroy_mig_device", "start_mps", "stop_mps"}:
            self.calls.append((operation, args))
        queue = self._faults.get(operation)
        if queue:
            raise DeviceError(queue.pop(0), f"{what}: injected NVML error")

    # --- DeviceBackend ------------------------------------------------------------------------------------------

    def open(self) -> None:
        if self._unavailable is not None:
            raise BackendUnavailable(self._unavailable)

    def close(self) -> None:
        pass

    def gpu_count(self) -> int:
        return len(self._gpus)

    def read_gpu(self, index: int) -> GpuDevice:
        self._check("read_gpu", f"GPU {index}")
        return self._gpu(index)

    def read_mps(self) -> MpsStatus:
        return self._mps

    def _gpu(self, index: int) -> GpuDevice:
        if index not in self._gpus:
            raise DeviceError("invalid_argument", f"GPU {index}: no such GPU (have {sorted(self._gpus)})")
        return self._gpus[index]

    # --- MigControl ---------------------------------------------------------------------------------------------

    def set_mig_mode(self, index: int, enabled: bool) -> None:
        """Takes effect at once (real GPUs need a reset, which the applier asks for)."""
        self._check("set_mig_mode", f"GPU {index}: set MIG mode", index, enabled)
        gpu = self._gpu(index)
        if not gpu.mig_capable:
            raise DeviceError("not_supported", f"GPU {index} ({gpu.name}) cannot do MIG")
        if gpu.processes:
            raise DeviceError("in_use", f"GPU {index}: {len(gpu.processes)} process(es) still run on it")
        if not enabled and gpu.mig_devices:
            raise DeviceError("in_use", f"GPU {index}: {len(gpu.mig_devices)} MIG device(s) still exist")
        self._gpus[index] = replace(gpu, mig_mode=enabled, mig_mode_pending=enabled)

    def create_mig_device(self, index: int, profile: str, start: int) -> MigDevice:
        """A GPU instance of `profile` at `start` with its full compute instance, as `nvidia-smi mig -cgi P:S -C`."""
        self._check("create_mig_device", f"GPU {index}: create {profile} at {start}", index, profile, start)
        gpu = self._gpu(index)
        if not gpu.mig_mode:
            raise DeviceError("invalid_state", f"GPU {index}: MIG mode is off")
        found = gpu.profile(profile)
        if found is None:
            raise DeviceError("invalid_argument", f"GPU {index} ({gpu.name}) has no MIG profile {profile!r}")
        taken = [Slot.of(m) for m in gpu.mig_devices]
        conflict = placement_conflict(found, start, taken, max_compute_slices(gpu))
        if conflict is not None:
            raise DeviceError(conflict[0], f"GPU {index}: {conflict[1]}")
        gi_id = self._next_gi[index]
        self._next_gi[index] += 1
        device = MigDevice(uuid="MIG-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{gpu.uuid}/{gi_id}")),
                           profile=found.name, start=start, memory_slices=found.memory_slices,
                           slice_count=found.slice_count, memory_total_bytes=found.memory_bytes, gpu_instance_id=gi_id)
        self._gpus[index] = replace(gpu, mig_devices=(*gpu.mig_devices, device))
        return device

    def destroy_mig_device(self, index: int, uuid: str) -> None:
        self._check("destroy_mig_device", f"GPU {index}: destroy {uuid}", index, uuid)
        gpu = self._gpu(index)
        if not any(m.uuid == uuid for m in gpu.mig_devices):
            raise DeviceError("not_found", f"GPU {index}: no MIG device {uuid}")
        users = [p.pid for p in gpu.processes if p.device_uuid == uuid]
        if users:
            raise DeviceError("in_use", f"GPU {index}: MIG device {uuid} is used by pid(s) {users}")
        daemons = sorted(pipe for pipe, served in self._daemon_devices.items() if served == uuid)
        if daemons:
            raise DeviceError("in_use", f"GPU {index}: MIG device {uuid} is served by the MPS daemon(s) of {daemons}")
        self._gpus[index] = replace(gpu, mig_devices=tuple(m for m in gpu.mig_devices if m.uuid != uuid))

    # --- what the world does around the backend (tests) ---------------------------------------------------------

    def add_process(self, index: int, pid: int, used_memory_bytes: int, device_uuid: str | None = None,
                    reported: bool = True) -> None:
        """A process starts on the GPU (or on one of its MIG devices) and takes memory. `reported=False`: the
        driver does not say how much per process (it still shows in the GPU's used memory)."""
        gpu = self._gpu(index)
        process = DeviceProcess(pid=pid, used_memory_bytes=used_memory_bytes if reported else None,
                                device_uuid=device_uuid)
        self._gpus[index] = replace(gpu, processes=(*gpu.processes, process),
                                    memory_used_bytes=gpu.memory_used_bytes + used_memory_bytes,
                                    memory_free_bytes=gpu.memory_free_bytes - used_memory_bytes)

    def start_mps(self, pipe_directory: str, pid: int, device_uuid: str | None = None) -> None:
        """A control daemon starts in `pipe_directory`; on `device_uuid` (its CUDA_VISIBLE_DEVICES) when given, which
        must be a GPU with MIG mode off or an existing MIG device, as a real daemon finds no device otherwise."""
        self._check("start_mps", f"MPS daemon in {pipe_directory}", pipe_directory)
        if pipe_directory in self._mps.pipe_directories:
            raise DeviceError("in_use", f"an MPS control daemon already runs with pipe directory {pipe_directory}")
        if device_uuid is not None:
            self._check_mps_device(device_uuid)
            self._daemon_devices[pipe_directory] = device_uuid
        self._mps = MpsStatus(control_pids=(*self._mps.control_pids, pid),
                              pipe_directories=(*self._mps.pipe_directories, pipe_directory))

    def stop_mps(self, pipe_directory: str) -> None:
        self._check("stop_mps", f"MPS daemon in {pipe_directory}", pipe_directory)
        dirs = self._mps.pipe_directories
        if pipe_directory not in dirs:
            raise DeviceError("not_found", f"no MPS daemon with pipe directory {pipe_directory}")
        self._daemon_devices.pop(pipe_directory, None)
        i = dirs.index(pipe_directory)
        pids = self._mps.control_pids
        self._mps = MpsStatus(control_pids=pids[:i] + pids[i + 1:], pipe_directories=dirs[:i] + dirs[i + 1:])

    def _check_mps_device(self, uuid: str) -> None:
        for gpu in self._gpus.values():
            if gpu.uuid == uuid and gpu.mig_mode:
                raise DeviceError("invalid_state", f"GPU {gpu.index} is in MIG mode: an MPS daemon must be started "
                                                   f"on one of its MIG devices, not on the GPU {uuid}")
            if gpu.uuid == uuid or any(m.uuid == uuid for m in gpu.mig_devices):
                return
        raise DeviceError("not_found", f"no GPU or MIG device {uuid} for an MPS daemon")

    def mps_device(self, pipe_directory: str) -> str | None:
        """The device the daemon of `pipe_directory` serves (None: none running, or started without saying)."""
        return self._daemon_devices.get(pipe_directory)

    def snapshot(self) -> Inventory:
        """The current state as an inventory (what `read_inventory` would return, without the catalog fill)."""
        return Inventory(devices=tuple(self._gpus[i] for i in sorted(self._gpus)), source=self._source,
                         mps=self._mps)

