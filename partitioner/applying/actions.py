"""Decide what the applier must do: the actual devices (an `Inventory`) against a `Plan`, as plain-data actions.

Pure: nothing here touches a device. `decide` returns the actions in the order to run them — first what frees
resources (our MPS daemons that the plan no longer uses, then our stale MIG devices, which a daemon serving one
would keep in use), then what creates them (MIG devices, then MPS daemons and their default limits: one per GPU
in `mps` mode, and one per MIG device that a nested plan shares by MPS). An applied state re-decided gives no
actions.

A daemon for a MIG device still to be created names it by its placeholder (`plan.pending_mig_ref`); the applier
swaps in the UUID of the device it just created.

MIG *mode* is never changed: a plan that needs it on raises `MigUnavailable` saying it is the operator's step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from partitioner.applying.applied_state import AppliedState
from partitioner.devices.inventory import GpuDevice, Inventory
from partitioner.devices.mps_probe import MPS_CONTROL
from partitioner.planning.plan import DevicePlan, Plan, PlannedMigDevice
from registry.fields import MIB

ActionKind = Literal["destroy_mig_device", "stop_mps_daemon", "create_mig_device", "start_mps_daemon",
                     "set_mps_default"]
DEFAULT_MPS_LOG_ROOT = "/tmp/multiserve-mps-log"


class ApplyError(Exception):
    """An action failed, or cannot be taken. The message names the GPU, the action and what to do about it."""


class MigUnavailable(ApplyError):
    """MIG cannot be applied here (MIG mode off, or no permission): the configured fallback may take over."""


@dataclass(frozen=True)
class Action:
    """One change to make. MPS actions carry the exact command they run (`command()`)."""

    kind: ActionKind
    gpu_index: int
    profile: str | None = None  # create_mig_device
    start: int | None = None  # create_mig_device: the placement's start slot
    uuid: str | None = None  # destroy_mig_device: the MIG device; MPS actions: the GPU or MIG device it serves
    replica_id: str | None = None  # create_mig_device: for whom (a shared instance: `placement.shared_key`)
    clients: tuple[str, ...] = ()  # create_mig_device of a shared instance: the replicas in it
    pipe_directory: str | None = None
    log_directory: str | None = None
    setting: str | None = None  # set_mps_default: the control command, e.g. "set_default_active_thread_percentage 70"

    def command(self) -> tuple[list[str], dict[str, str], str | None] | None:
        """(argv, env, stdin) of an MPS action; None for MIG actions (those go through NVML)."""
        if self.kind == "start_mps_daemon":
            assert self.uuid and self.pipe_directory and self.log_directory
            return ([MPS_CONTROL, "-d"], {"CUDA_VISIBLE_DEVICES": self.uuid,
                                          "CUDA_MPS_PIPE_DIRECTORY": self.pipe_directory,
                                          "CUDA_MPS_LOG_DIRECTORY": self.log_directory}, None)
        if self.kind in ("set_mps_default", "stop_mps_daemon"):
            assert self.pipe_directory
            line = self.setting if self.kind == "set_mps_default" else "quit"
            return [MPS_CONTROL], {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_directory}, f"{line}\n"
        return None

    def describe(self) -> str:
        if self.kind == "destroy_mig_device":
            return f"GPU {self.gpu_index}: destroy MIG device {self.uuid} (created by an earlier apply, now unused)"
        if self.kind == "create_mig_device":
            whom = f"{self.replica_id} ({', '.join(self.clients)})" if self.clients else self.replica_id
            return (f"GPU {self.gpu_index}: create MIG device {self.profile} at slot {self.start} "
                    f"(GPU instance + full compute instance) for {whom}")
        command = self.command()
        assert command is not None
        argv, env, stdin = command
        shell = " ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(argv)
        return f"GPU {self.gpu_index}: " + (f"echo {stdin.strip()} | {shell}" if stdin else shell)


def decide(plan: Plan, inventory: Inventory, state: AppliedState,
           mps_log_root: str = DEFAULT_MPS_LOG_ROOT) -> list[Action]:
    """The actions that make `inventory` (the devices now) match `plan`. Raises `MigUnavailable` when the plan
    needs MIG mode turned on. GPUs the plan does not manage are never touched."""
    destroys: list[Action] = []
    makes: list[Action] = []
    for device in plan.devices:
        if device.index is None or not device.managed:
            continue
        gpu = inventory.gpu(device.index)
        if device.mode == "mig" and not gpu.mig_mode:
            raise MigUnavailable(_mig_mode_off(gpu))
        destroys += _stale_mig_devices(device, gpu, state)
        makes += [Action("create_mig_device", gpu.index, profile=m.profile, start=m.start, replica_id=m.replica_id,
                         clients=m.clients) for m in device.mig_devices if m.uuid is None]
        if device.mode == "mps":
            assert device.mps_pipe_directory is not None and device.uuid is not None
            makes += _mps_actions(MpsDaemon(device.key, gpu.index, device.uuid, device.mps_pipe_directory),
                                  plan, inventory, state, mps_log_root)
        makes += [a for m in device.mig_devices if m.sharing == "mps"
                  for a in _mps_actions(_mig_daemon(m, gpu.index), plan, inventory, state, mps_log_root)]
    return _stale_mps_daemons(plan, inventory, state) + destroys + makes


@dataclass(frozen=True)
class MpsDaemon:
    """One MPS control daemon the plan needs: the device it serves (a GPU, or a MIG device of a nested plan) and the
    key of that device in the plan, which names its log directory and its clients' `ReplicaPlan.device_key`."""

    device_key: str
    gpu_index: int
    device_uuid: str  # or a pending MIG device's placeholder
    pipe_directory: str


def _mig_daemon(m: PlannedMigDevice, gpu_index: int) -> MpsDaemon:
    assert m.device_key is not None and m.mps_pipe_directory is not None
    return MpsDaemon(m.device_key, gpu_index, m.device_ref, m.mps_pipe_directory)


def _stale_mps_daemons(plan: Plan, inventory: Inventory, state: AppliedState) -> list[Action]:
    """Our running daemons whose pipe directory the plan no longer uses, on GPUs it manages."""
    in_use = {d.mps_pipe_directory for d in plan.devices if d.mode == "mps"}
    in_use |= {m.mps_pipe_directory for d in plan.devices for m in d.mig_devices if m.sharing == "mps"}
    managed = {d.index for d in plan.devices if d.managed and d.index is not None}
    running = set(inventory.mps.pipe_directories)
    return [Action("stop_mps_daemon", daemon.gpu_index, uuid=daemon.device_uuid, pipe_directory=pipe)
            for pipe, daemon in sorted(state.mps_daemons.items())
            if daemon.gpu_index in managed and pipe not in in_use and pipe in running]


def _mig_mode_off(gpu: GpuDevice) -> str:
    return (f"GPU {gpu.index} ({gpu.name}): the plan puts MIG devices on it but its MIG mode is off. Enabling MIG "
            f"mode is an operator step that multiserve never takes (it needs root, an idle GPU and a GPU reset): "
            f"`sudo nvidia-smi -i {gpu.index} -mig 1`, then reset the GPU (or reboot); or configure a fallback "
            f"(--mig-fallback mps|timeslice)")


def _stale_mig_devices(device: DevicePlan, gpu: GpuDevice, state: AppliedState) -> list[Action]:
    """MIG devices an earlier apply created that this plan does not use and that no process runs on."""
    used = {m.uuid for m in device.mig_devices if m.uuid is not None}
    busy = {p.device_uuid for p in gpu.processes}
    return [Action("destroy_mig_device", gpu.index, uuid=m.uuid) for m in gpu.mig_devices
            if state.mig_devices.get(m.uuid) == gpu.index and m.uuid not in used and m.uuid not in busy]


def _mps_actions(daemon: MpsDaemon, plan: Plan, inventory: Inventory, state: AppliedState,
                 mps_log_root: str) -> list[Action]:
    """Start the device's own daemon when it is not running; set the defaults it does not have yet."""
    pipe, uuid = daemon.pipe_directory, daemon.device_uuid
    actions = []
    known = state.mps_daemons.get(pipe)
    applied = known.settings if known is not None else []
    if pipe not in inventory.mps.pipe_directories:
        actions.append(Action("start_mps_daemon", daemon.gpu_index, uuid=uuid, pipe_directory=pipe,
                              log_directory=str(Path(mps_log_root) / daemon.device_key)))
        applied = []  # a fresh daemon has the built-in defaults
    for setting in mps_defaults(plan, daemon.device_key):
        if setting not in applied:
            actions.append(Action("set_mps_default", daemon.gpu_index, uuid=uuid, pipe_directory=pipe,
                                  setting=setting))
    return actions


def mps_defaults(plan: Plan, device_key: str) -> list[str]:
    """The daemon's defaults: the largest of our replicas' thread percentages and pinned-memory limits.

    A client's own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE / CUDA_MPS_PINNED_DEVICE_MEM_LIMIT can only lower the
    daemon's value, so the default must admit our largest share; every replica then narrows it to its own
    (the planner puts those in its env). A stray client on our daemon gets no more than our largest share.
    """
    replicas = [r for r in plan.replicas if r.device_key == device_key]
    shares = [r.sm_percent for r in replicas if r.sm_percent is not None]
    memory = [r.memory_bytes for r in replicas if r.memory_bytes]
    out = []
    if shares:
        out.append(f"set_default_active_thread_percentage {max(shares)}")
    if memory:  # device 0: the daemon sees only its GPU or MIG device (CUDA_VISIBLE_DEVICES is that UUID)
        out.append(f"set_default_device_pinned_mem_limit 0 {max(memory) // MIB}M")
    return out


def created_devices(plan: Plan, created: Mapping[str, str]) -> dict[str, str]:
    """replica id -> CUDA_VISIBLE_DEVICES after apply: placeholders of new MIG devices swapped for their UUIDs."""
    return {r.replica_id: created.get(r.replica_id, r.env.get("CUDA_VISIBLE_DEVICES", "")) for r in plan.replicas}
