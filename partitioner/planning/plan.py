"""The planner's output: plain, serializable data that the applier executes and the pool launches replicas from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

DeviceMode = Literal["mig", "mps", "timeslice", "exclusive", "none"]
ActionKind = Literal["enable_mig", "create_mig_device", "start_mps_daemon"]


class InfeasiblePlan(Exception):
    """Some demand does not fit. Each problem says what does not fit, where, and by how much."""

    def __init__(self, problems: list[str] | tuple[str, ...]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(self.problems))


PENDING_MIG = "pending-mig:"  # how the placeholder of a MIG device still to be created begins


def pending_mig_ref(profile: str, start: int | None) -> str:
    """The placeholder of a MIG device still to be created, where its UUID will go (env, MPS daemon)."""
    return f"{PENDING_MIG}{profile}@{start}"


@dataclass(frozen=True)
class PlannedMigDevice:
    """A MIG device one replica runs on, or that several share (`sharing`): one that exists (`uuid`), or one to
    create at `start`. A shared one's `replica_id` is `placement.shared_key` of its instance; `clients` are the
    replicas in it, whose `ReplicaPlan.device_key` is its `device_key`."""

    profile: str
    profile_id: int
    start: int | None  # None only for an existing device whose placement NVML would not tell
    memory_slices: int
    memory_bytes: int
    replica_id: str
    uuid: str | None = None  # None: to be created
    instance: str | None = None  # the registry's `placement.mig_instance` it stands for
    sharing: str | None = None  # mps | timeslice: how `clients` share it; None: one mig replica alone
    clients: tuple[str, ...] = ()
    device_key: str | None = None  # names its clients' device, MPS pipe and log directories and arbiter
    mps_pipe_directory: str | None = None
    start_mps_daemon: bool = False

    @property
    def device_ref(self) -> str:
        """What CUDA_VISIBLE_DEVICES gets: the UUID, or a placeholder the applier swaps for the new device's UUID."""
        return self.uuid or pending_mig_ref(self.profile, self.start)


@dataclass(frozen=True)
class DevicePlan:
    """How one device (a GPU, or the CPU) is shared."""

    key: str  # "gpu0", ..., "cpu"
    name: str
    mode: DeviceMode
    managed: bool  # False: the config does not name this GPU; the plan leaves it alone
    index: int | None = None
    uuid: str | None = None
    capacity_bytes: int | None = None  # what our replicas may use together; None: not admitted (the CPU)
    planned_bytes: int = 0
    foreign_bytes: int = 0  # used by processes that are not ours
    enable_mig: bool = False
    mig_devices: tuple[PlannedMigDevice, ...] = ()
    mps_pipe_directory: str | None = None
    start_mps_daemon: bool = False
    replica_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReplicaPlan:
    """Where one replica runs and what it is launched with."""

    replica_id: str
    model: str
    replica: int
    device_key: str
    isolation: str  # what it gets: mig | mps | timeslice | exclusive
    requested_isolation: str
    env: dict[str, str] = field(default_factory=dict)
    gpu_index: int | None = None
    memory_bytes: int | None = None
    memory_fraction: float | None = None  # of the device it sees (GPU or MIG device): set_per_process_memory_fraction
    kv_cache_bytes: int | None = None
    sm_percent: int | None = None  # MPS active thread percentage, or the MIG device's share of the GPU's SMs
    weight: float = 1.0
    weight_share: float = 1.0  # its weight over the sum of weights on its device: its time-slice share when busy
    note: str = ""


@dataclass(frozen=True)
class PlanAction:
    """One device change the plan needs; an applied plan re-planned has none."""

    kind: ActionKind
    gpu_index: int
    profile: str | None = None
    start: int | None = None
    pipe_directory: str | None = None
    mig_device: str | None = None  # start_mps_daemon inside a MIG device: its UUID or pending placeholder

    def describe(self) -> str:
        if self.kind == "enable_mig":
            return f"enable MIG mode on GPU {self.gpu_index} (needs root and an idle GPU; takes effect after a reset)"
        if self.kind == "create_mig_device":
            return f"create MIG device {self.profile} at slot {self.start} on GPU {self.gpu_index}"
        inside = f"MIG device {self.mig_device} of " if self.mig_device else ""
        return f"start an MPS control daemon for {inside}GPU {self.gpu_index} with pipe directory {self.pipe_directory}"


@dataclass(frozen=True)
class Plan:
    """Devices (every GPU of the inventory, then the CPU when used) and replicas, in a deterministic order."""

    inventory_source: str
    devices: tuple[DevicePlan, ...]
    replicas: tuple[ReplicaPlan, ...]
    notes: tuple[str, ...] = ()

    def replica(self, replica_id: str) -> ReplicaPlan:
        for replica in self.replicas:
            if replica.replica_id == replica_id:
                return replica
        raise KeyError(f"no replica {replica_id!r} in the plan")

    def device(self, key: str) -> DevicePlan:
        for device in self.devices:
            if device.key == key:
                return device
        raise KeyError(f"no device {key!r} in the plan")

    def actions(self) -> tuple[PlanAction, ...]:
        """The device changes this plan needs, in the order to make them."""
        out: list[PlanAction] = []
        for d in self.devices:
            if d.index is None:
                continue
            if d.enable_mig:
                out.append(PlanAction("enable_mig", d.index))
            out += [PlanAction("create_mig_device", d.index, profile=m.profile, start=m.start)
                    for m in d.mig_devices if m.uuid is None]
            out += [PlanAction("start_mps_daemon", d.index, pipe_directory=m.mps_pipe_directory,
                               mig_device=m.device_ref) for m in d.mig_devices if m.start_mps_daemon]
            if d.start_mps_daemon:
                out.append(PlanAction("start_mps_daemon", d.index, pipe_directory=d.mps_pipe_directory))
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the actions spelled out and the tree (`tree()`)."""
        data = asdict(self)
        data["actions"] = [{**asdict(a), "description": a.describe()} for a in self.actions()]
        data["tree"] = self.tree()
        return data

    def tree(self) -> list[dict[str, Any]]:
        """Who shares what, nested: device -> MIG devices (on a MIG GPU) -> the replicas in each; on any other
        device its replicas directly. The flat `devices` and `replicas` hold the same facts; this is the shape an
        operator reads them in (`partition plan` prints it, `--json` includes it)."""
        on_mig = {r.replica_id for d in self.devices for m in d.mig_devices for r in self._in_mig_device(m)}
        return [{"device": d.key, "name": d.name, "mode": d.mode, "managed": d.managed, "uuid": d.uuid,
                 "mig_devices": [{"profile": m.profile, "start": m.start, "memory_bytes": m.memory_bytes,
                                  "device": m.device_ref, "to_create": m.uuid is None, "instance": m.instance,
                                  "sharing": m.sharing or "mig", "mps_pipe_directory": m.mps_pipe_directory,
                                  "replicas": [_client_node(r) for r in self._in_mig_device(m)]}
                                 for m in d.mig_devices],
                 "replicas": [_client_node(r) for r in self.replicas
                              if r.device_key == d.key and r.replica_id not in on_mig]}
                for d in self.devices]

    def _in_mig_device(self, m: PlannedMigDevice) -> list[ReplicaPlan]:
        """The replicas that run on MIG device `m`: its clients when shared, else the one it is for."""
        if m.sharing:
            return [r for r in self.replicas if r.device_key == m.device_key]
        return [r for r in self.replicas if r.replica_id == m.replica_id]


def _client_node(r: ReplicaPlan) -> dict[str, Any]:
    return {"replica_id": r.replica_id, "isolation": r.isolation, "memory_bytes": r.memory_bytes,
            "memory_fraction": r.memory_fraction, "sm_percent": r.sm_percent, "weight_share": r.weight_share}
