"""What the planner works with: the operator's options, a demand placed with its isolation, and one GPU's state
while a plan is made (partitioner/planning/planner.py decides, plan_build.py turns the result into a `Plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from partitioner.devices.inventory import GpuDevice, MigDevice, MigProfile
from partitioner.devices.mps_probe import MULTISERVE_PIPE_ROOT
from partitioner.planning.demand import ReplicaDemand
from partitioner.planning.plan import DeviceMode


@dataclass(frozen=True)
class PlanOptions:
    """What the operator decides beyond the registry."""

    gpus: tuple[int, ...] | None = None  # GPU indices the config lets us use; None: every GPU of the inventory
    own_pids: frozenset[int] = frozenset()  # our replicas' processes: their memory is ours to re-plan, not foreign
    max_memory_fraction: float = 0.95  # of a GPU's (or MIG device's) memory, for our replicas together
    mig_fallback: Literal["mps", "timeslice"] | None = None  # for mig demands when no named GPU can do MIG
    mps_pipe_root: str = MULTISERVE_PIPE_ROOT  # one pipe directory per GPU below it
    max_mps_clients: int = 48  # MPS's per-device client limit

    def __post_init__(self) -> None:
        if not 0 < self.max_memory_fraction <= 1:
            raise ValueError(f"max_memory_fraction must be in (0, 1], got {self.max_memory_fraction}")


@dataclass(frozen=True)
class Placed:
    """A demand with the isolation it gets and where it goes.

    A shared MIG instance is placed like one mig replica (so it is sized, reused, slotted and re-dealt by the
    same rules): its `demand` is the members' summed memory under `shared_key(instance)`, and `members` are the
    replicas that share it, each with its own isolation (all mps, or all timeslice)."""

    demand: ReplicaDemand
    isolation: str  # what it gets: mig | mps | timeslice | exclusive, or "cpu" (time-sliced on the CPU)
    note: str = ""
    profile: MigProfile | None = None  # a MIG device to create
    reused: MigDevice | None = None  # an existing MIG device
    instance: str | None = None  # the registry's `placement.mig_instance` this placement stands for
    members: tuple[Placed, ...] = ()

    @property
    def sharing(self) -> str | None:
        """How the members share the instance (mps | timeslice); None for anything but a shared instance."""
        return self.members[0].isolation if self.members else None

    def label(self) -> str:
        """Who it is for, in messages: the replica, or the shared instance and its replicas."""
        if self.instance is None:
            return self.demand.replica_id
        return f"MIG instance {self.instance!r} ({self.sharing}: {', '.join(self.replica_ids())})"

    def replica_ids(self) -> list[str]:
        """The replicas this placement seats: its members, or itself."""
        return [m.demand.replica_id for m in self.members] if self.members else [self.demand.replica_id]


def shared_key(instance: str) -> str:
    """The key a shared MIG instance goes by where a replica id would (its plan entry, the action creating it)."""
    return f"mig-instance:{instance}"


@dataclass
class GpuState:
    """One GPU while planning (the only mutable state, local to one `plan` call)."""

    dev: GpuDevice
    managed: bool
    foreign_bytes: int
    capacity_bytes: int
    mode: DeviceMode = "none"
    placed: list[Placed] = field(default_factory=list)

    @property
    def planned_bytes(self) -> int:
        return sum(p.demand.memory_bytes or 0 for p in self.placed)

    def label(self) -> str:
        return f"GPU {self.dev.index} ({self.dev.name})"
