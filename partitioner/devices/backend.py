"""The narrow device interface the partitioner reads (and, for the applier, changes) GPUs through.

Two implementations: `nvml_backend.NvmlBackend` (the only code that imports `pynvml`) and
`fake_backend.FakeBackend` (real MIG profile tables, slot occupancy, injectable NVML errors) for tests and for
planning on machines without a GPU. Errors are backend-neutral `DeviceError`s whose `kind` names the NVML
return code they stand for, so callers (the applier's fallbacks) never see `pynvml` types.
"""

from __future__ import annotations

from typing import Literal, Protocol

from partitioner.devices.inventory import GpuDevice, MigDevice, MpsStatus

ErrorKind = Literal[
    "no_permission",  # NVML_ERROR_NO_PERMISSION: MIG changes need root
    "in_use",  # NVML_ERROR_IN_USE: processes still run on the GPU or MIG device
    "insufficient_resources",  # NVML_ERROR_INSUFFICIENT_RESOURCES: no free slot or instance left for the profile
    "not_supported",  # NVML_ERROR_NOT_SUPPORTED
    "invalid_argument",  # NVML_ERROR_INVALID_ARGUMENT: e.g. a placement the profile does not allow
    "invalid_state",  # e.g. creating a MIG instance while MIG mode is off
    "not_found",  # NVML_ERROR_NOT_FOUND
    "unknown",
]


class BackendUnavailable(Exception):
    """The backend cannot run on this host (no NVML library, no driver). `str()` says why, for `partition status`."""


class DeviceError(Exception):
    """An operation on a device failed. `kind` is what the applier branches on; the message names the device."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        self.kind: ErrorKind = kind
        super().__init__(f"{message} [{kind}]")


class DeviceBackend(Protocol):
    """Read-only access to a host's GPUs. `open` before reading, `close` after (NVML init/shutdown)."""

    @property
    def source(self) -> str:
        """Where the data comes from: "nvml" or "fake:<file>"."""
        ...

    def open(self) -> None:
        """Raise `BackendUnavailable` with the reason when the backend cannot run here."""
        ...

    def close(self) -> None: ...

    def gpu_count(self) -> int: ...

    def read_gpu(self, index: int) -> GpuDevice:
        """Everything about one GPU: memory, MIG mode and devices, processes. Raises `DeviceError`."""
        ...

    def read_mps(self) -> MpsStatus: ...


class MigControl(Protocol):
    """The state-changing MIG operations the applier needs (privileged on real hardware).

    There is deliberately no way to change MIG mode here: that needs an idle GPU and a reset, and is the
    operator's step (the fake backend's `set_mig_mode` stands in for the operator in tests).
    """

    def create_mig_device(self, index: int, profile: str, start: int) -> MigDevice: ...

    def destroy_mig_device(self, index: int, uuid: str) -> None: ...
