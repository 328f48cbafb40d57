"""The pool's side of the plan: each replica's placement, and the arbiter a time-shared device needs. Decided here,
started elsewhere.

`ReplicaPlacer.place(spec, index)` plans the current registry onto the host's inventory (re-planning when the
registry changes) and gives a replica its plan entry as a `registry.launch.ReplicaPlacement`:
`CUDA_VISIBLE_DEVICES` and the MPS variables (the environment CUDA reads), a KV-cache byte budget, a memory
fraction, and, when it time-shares its device, the socket of that device's arbiter and its weight; with it, as
plain data, the arbiter that must be running before the replica starts (`ArbiterStart`). It travels to the worker
inside the replica's launch. Nothing here opens a socket or starts a thread: `applying.placements.PlacementApplier`
(the pool's `placement_for`) starts the arbiter services (`timeslice.service.ArbiterService`) in the pool's
process, one per shared device, on first use.

A device gets an arbiter only when at least two replicas on it are time-sliced and their models set
`placement:` in the registry; a replica alone on its device, or one whose model says nothing about placement,
steps without a gate (no per-step cost).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from partitioner.devices.inventory import Inventory
from partitioner.planning.demand import ModelShape, planned_locally, replica_demands
from partitioner.planning.footprint import device_budget, replica_footprint
from partitioner.planning.placement import PlanOptions
from partitioner.planning.plan import InfeasiblePlan, Plan, ReplicaPlan
from partitioner.planning.planner import plan
from partitioner.planning.shapes import family_problems, plan_shapes
from registry.errors import Problem
from registry.fields import GIB, gib
from registry.launch import Footprint, ReplicaPlacement
from registry.schema import ModelSpec, Registry

log = structlog.get_logger(__name__)

RUN_DIR_ENV = "MULTISERVE_RUN_DIR"
DEFAULT_RUN_DIR = ".multiserve/run"
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux


def arbiter_dir(env: Mapping[str, str]) -> Path:
    """Where the arbiters' sockets live (`partition status` looks there too)."""
    return Path(env.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR).resolve() / "arbiter"


@dataclass(frozen=True)
class ArbiterStart:
    """An arbiter to have running before a replica launches: the one of time-shared `device_key`, at `socket_path`
    (the socket its replicas' placements name)."""

    device_key: str
    socket_path: Path


@dataclass(frozen=True)
class PlacedReplica:
    """A replica's placement, and the arbiter it takes leases from (None: it steps without one)."""

    placement: ReplicaPlacement
    arbiter: ArbiterStart | None = None


class ReplicaPlacer:
    """Each replica's placement (`place`), and what keeps a registry from being placed (`problems`). `registry()` is
    the registry now; `read_inventory()` is called once, on first use. `shapes` are the models' given shapes; on a
    host with GPUs, a model with neither a shape nor `placement.memory_gib` gets one estimated from its weights'
    metadata (`shapes.plan_shapes`). `socket_dir` is where the arbiters' sockets are to be."""

    def __init__(self, registry: Callable[[], Registry], read_inventory: Callable[[], Inventory], socket_dir: Path,
                 options: PlanOptions | None = None, shapes: Mapping[str, ModelShape] | None = None,
                 require_applied: bool = False) -> None:
        self._registry = registry
        self.require_applied = require_applied  # a plan that needs device changes is a problem (`problems`)
        self._read_inventory = read_inventory
        self._inventory: Inventory | None = None
        self.socket_dir = socket_dir
        self._options = options or PlanOptions()
        self._shapes = dict(shapes or {})
        self._planned: tuple[Registry, Plan | InfeasiblePlan] | None = None
        self._plan_lock = threading.Lock()

    def place(self, spec: ModelSpec, index: int) -> PlacedReplica:
        """Replica `index` of `spec`: its plan entry, and the arbiter to start first when it time-shares its device.
        No plan (infeasible), or a replica not in it (a url replica, a model the plan has not seen): an empty
        placement, as without a partitioner. Raises ValueError when the arbiter's socket path would be too long."""
        registry = self._registry()
        current = self.plan_for(registry)
        if current is None:
            return PlacedReplica(ReplicaPlacement())
        try:
            replica = current.replica(f"{spec.name}/{index}")
        except KeyError:
            return PlacedReplica(ReplicaPlacement())
        arbiter = self.arbiter_for(replica.device_key) if needs_arbiter(current, replica, registry) else None
        return PlacedReplica(ReplicaPlacement(
            env=dict(replica.env), kv_cache_bytes=replica.kv_cache_bytes,
            memory_fraction=None if replica.device_key == "cpu" else replica.memory_fraction,
            arbiter_socket=str(arbiter.socket_path) if arbiter else None,
            arbiter_client=replica.replica_id if arbiter else None,
            arbiter_weight=replica.weight if arbiter else 1.0), arbiter)

    def footprint(self, spec: ModelSpec, index: int) -> Footprint:
        """What replica `index` of `spec` holds of which device's memory budget (planning/footprint.py)."""
        registry = self._registry()
        return replica_footprint(spec, index, self.plan_for(registry), registry)

    def budget(self, device: str) -> int | None:
        """A device's memory budget when the registry sets none: the inventory's (a GPU's total, the host's RAM)."""
        return device_budget(device, self._inventory_now())

    def _inventory_now(self) -> Inventory:
        """The host's inventory, read on first use."""
        with self._plan_lock:
            if self._inventory is None:
                self._inventory = self._read_inventory()
            return self._inventory

    def arbiter_for(self, device_key: str) -> ArbiterStart:
        """The arbiter of `device_key`: its socket in `socket_dir`. Raises ValueError when that path is longer than a
        Unix socket's address holds."""
        path = self.socket_dir / f"{device_key}.sock"
        if len(str(path)) > _MAX_SOCKET_PATH:
            raise ValueError(f"arbiter socket path {path} is longer than {_MAX_SOCKET_PATH} characters: "
                             f"set {RUN_DIR_ENV} to a shorter directory")
        return ArbiterStart(device_key, path)

    def plan_for(self, registry: Registry) -> Plan | None:
        """The plan of `registry` (cached until the registry changes); None, logged, when it is infeasible: the
        replicas then launch as they would without a partitioner. (`multiserve serve` never gets there: its
        registry store refuses such a registry through `problems`.)"""
        result = self._plan(registry)
        if isinstance(result, InfeasiblePlan):
            log.error("partition_plan_infeasible", problems=list(result.problems))
            return None
        return result

    def problems(self, registry: Registry) -> list[Problem]:
        """What keeps `registry` from being placed on this host: the registry store's `check`. With
        `require_applied`, a plan whose MIG devices or MPS daemons do not exist yet is refused too, naming them and
        the command that makes them: a replica never starts half-isolated (on a placeholder MIG device, or with
        MPS variables no daemon answers). First, models of a family the runtime does not run (`family_problems`)."""
        if families := family_problems(registry):
            return families
        result = self._plan(registry)
        if isinstance(result, InfeasiblePlan):
            return [Problem("(partition plan)", problem) for problem in result.problems]
        if budgets := budget_problems(registry, result):
            return budgets
        actions = result.actions() if self.require_applied else ()
        if actions:
            changes = "; ".join(a.describe() for a in actions)
            return [Problem("(partition plan)", f"the devices need {len(actions)} change(s) before its replicas can "
                                                f"start isolated: {changes}. Run `multiserve partition apply --config "
                                                f"<this registry>` (as root for MIG devices), or serve with "
                                                f"--apply-partition yes")]
        return []

    def _plan(self, registry: Registry) -> Plan | InfeasiblePlan:
        inventory = self._inventory_now()
        with self._plan_lock:  # the store checks edits from admin threads while the pool launches replicas
            if self._planned is not None and self._planned[0] is registry:
                return self._planned[1]
            result: Plan | InfeasiblePlan
            try:
                shapes = self._shapes_for(registry, inventory)
                result = plan(inventory, replica_demands(registry, shapes), self._options)
            except InfeasiblePlan as exc:
                result = exc
            self._planned = (registry, result)
            return result

    def _shapes_for(self, registry: Registry, inventory: Inventory) -> Mapping[str, ModelShape]:
        """The given shapes, plus estimates where a GPU plan needs a memory size that nothing gives; a model left
        without one is logged here, and the planner then says what to set."""
        shapes, unknown = plan_shapes(registry, self._shapes, inventory)
        for model, reason in unknown.items():
            log.warning("model_shape_unknown", model=model, reason=reason)
        return shapes


def budget_problems(registry: Registry, current: Plan | None) -> list[Problem]:
    """Where the registry sets `gateway.memory_budget_gib` for a device: the replicas always resident there (fixed
    counts, `min`, pinned models) must fit it together, and each model started on demand must fit it alone (else it
    could never start). Devices it leaves unset are not checked: their budget is all of their memory."""
    budgets = registry.gateway.memory_budget_gib
    if not budgets:
        return []
    resident: dict[str, list[tuple[str, int]]] = {}
    problems = []
    for i, model in enumerate(registry.models):
        if not planned_locally(model):
            continue
        for index in range(model.max_replicas):
            footprint = replica_footprint(model, index, current, registry)
            budget = budgets.get(footprint.device)
            if budget is None or footprint.bytes is None:
                continue
            if index < model.resident_replicas:
                resident.setdefault(footprint.device, []).append((f"{model.name}/{index}", footprint.bytes))
            elif footprint.bytes > budget * GIB:
                problems.append(Problem(f"models[{i}].replicas", (
                    f"a replica of {model.name} holds {gib(footprint.bytes)}, more than "
                    f"gateway.memory_budget_gib.{footprint.device} = {budget:g} GiB: it could never start")))
    for device, held in sorted(resident.items()):
        total = sum(size for _, size in held)
        if total > budgets[device] * GIB:
            listed = ", ".join(f"{name} {gib(size)}" for name, size in held)
            problems.append(Problem(f"gateway.memory_budget_gib.{device}", (
                f"{budgets[device]:g} GiB cannot hold the replicas always resident there ({gib(total)}: "
                f"{listed}); raise it, or start models on demand (replicas: {{min: 0, max: N}})")))
    return problems


def needs_arbiter(current: Plan, replica: ReplicaPlan, registry: Registry) -> bool:
    """Time-sliced with at least one other such replica on its device, both of models that set `placement:`."""
    if replica.isolation != "timeslice":
        return False
    explicit = {m.name for m in registry.models if "placement" in m.model_fields_set}
    sharing = [r for r in current.replicas
               if r.device_key == replica.device_key and r.isolation == "timeslice" and r.model in explicit]
    return replica.model in explicit and len(sharing) >= 2
