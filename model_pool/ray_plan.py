"""The partitioner's plan per node for Ray replicas: each node's devices are read on that node, the cluster planner
(`partitioner.planning.cluster`) puts each planned replica on a node and plans that node as it would a single host,
and the Ray launcher pins the replica's actor to that node with its plan entry (`RayLauncher(planner=...)`).

Planned: the `launcher: ray` models that write `placement:` or target a GPU (`device: cuda`); other Ray models are
placed by Ray alone, as before. Inventories are read once per node (the first plan that sees it), so the replicas
started since do not count as someone else's memory when a registry edit re-plans; a node that joins is read when
it first appears, and a node that leaves is planned without. A re-plan tries each running replica's node first.

What a Ray replica cannot get: an arbiter. The time-slice arbiter is a Unix socket served by the gateway's process
for its local replicas, so a plan that time-slices a device between Ray replicas of models that write `placement:`
(which locally take an arbiter's lease per step) is refused on that node; the planner tries the next node, and a
replica that no node takes that way is refused naming the field (`models[i].placement.isolation`). Nor does
anything create MIG devices or start MPS daemons on another node: a node whose plan needs either is refused too,
naming the changes, until they exist there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import structlog

from model_pool.ray_launcher import (
    NodePlacement,
    RayUnavailable,
    asked_resources,
    node_holds,
    resources_text,
)
from partitioner.devices.inventory import Inventory
from partitioner.planning.cluster import (
    ClusterNode,
    ClusterPlan,
    NodeEligibility,
    cluster_demands,
    place_replicas,
    planned_on_cluster,
    read_node_inventories,
    refuse_time_slicing,
    unapplied_changes,
)
from partitioner.planning.demand import ModelShape, ReplicaDemand
from partitioner.planning.placement import PlanOptions
from partitioner.planning.plan import InfeasiblePlan, ReplicaPlan
from partitioner.planning.shapes import with_estimates
from registry.errors import Problem
from registry.launch import ReplicaLaunch, ReplicaPlacement
from registry.schema import RayResources, Registry

log = structlog.get_logger(__name__)

PLAN_FIELD = "(partition plan, Ray cluster)"  # where the store shows a plan's problems
NO_ARBITER = ("Ray replicas get none (arbiters run in the gateway's process, for its local replicas): spread them "
              "over more nodes, or leave placement: unset")


class ClusterView(Protocol):
    """What the placer needs of the cluster (`ray_launcher.RayCluster`; a stand-in in tests)."""

    def nodes(self) -> list[dict[str, Any]]: ...

    def read_inventory(self, node_id: str) -> Inventory: ...


class RayPlacer:
    """The plan per node for `launcher: ray` models (see the module). `registry()` is the registry now; `shapes` the
    models' given shapes (others are estimated from their weights here, when some node has a GPU)."""

    def __init__(self, registry: Callable[[], Registry], cluster: ClusterView, options: PlanOptions | None = None,
                 shapes: Mapping[str, ModelShape] | None = None) -> None:
        self._registry = registry
        self.cluster = cluster
        self._options = options or PlanOptions()
        self._shapes = dict(shapes or {})
        self._inventories: dict[str, Inventory] = {}  # node id -> its devices, read once on that node
        self._planned: tuple[Registry, frozenset[str], ClusterPlan | InfeasiblePlan] | None = None
        self._running_on: dict[str, str] = {}  # replica id -> the node it was last launched on
        self._lock = threading.Lock()

    def node_placement(self, launch: ReplicaLaunch) -> NodePlacement | None:
        """The node and plan entry of a planned replica; None for one Ray places by itself. Raises RayUnavailable
        when the cluster, as it is now (a node gone), has no place for it: the pool counts a failed start and
        retries with its backoff (the others, placed, start)."""
        registry = self._registry()
        spec = registry.resolve(launch.model)
        if spec is None or not planned_on_cluster(spec):
            return None
        result = self._plan(registry)
        if isinstance(result, InfeasiblePlan):
            raise RayUnavailable(f"{launch.replica_id}: the cluster has no plan for it now: "
                                 + "; ".join(result.problems))
        if launch.replica_id in result.unplaced:
            raise RayUnavailable(f"{launch.replica_id}: the cluster has no place for it now: "
                                 f"{result.unplaced[launch.replica_id]}")
        try:
            node, entry = result.replica(launch.replica_id)
        except KeyError as err:
            raise RayUnavailable(f"{launch.replica_id}: not in the plan of the registry in force") from err
        with self._lock:
            self._running_on[launch.replica_id] = node.node_id
        return NodePlacement(node.node_id, node.address, replica_placement(entry))

    def problems(self, registry: Registry) -> list[Problem]:
        """What keeps `registry`'s planned Ray models from being placed: the registry store's check (after
        `ray_launcher.ray_problems`, which refuses an unreachable cluster or resources no node has)."""
        if not any(planned_on_cluster(m) for m in registry.models):
            return []
        try:
            result = self._plan(registry)
        except RayUnavailable as err:
            return [Problem("gateway.ray.address", str(err))]
        return [Problem(PLAN_FIELD, problem) for problem in result.problems]

    def _plan(self, registry: Registry) -> ClusterPlan | InfeasiblePlan:
        """The plan of `registry` on the alive nodes, cached until either changes."""
        alive = self.cluster.nodes()
        key = frozenset(str(n["NodeID"]) for n in alive)
        with self._lock:  # the store checks edits from admin threads while the pool launches replicas
            if self._planned is not None and self._planned[0] is registry and self._planned[1] == key:
                return self._planned[2]
            result = self._make_plan(registry, alive)
            self._planned = (registry, key, result)
            return result

    def _make_plan(self, registry: Registry, alive: list[dict[str, Any]]) -> ClusterPlan | InfeasiblePlan:
        addresses = [(str(n["NodeID"]), str(n.get("NodeManagerAddress", "?"))) for n in alive]
        nodes, unread = read_node_inventories(addresses, self.cluster.read_inventory, self._inventories)
        self._inventories.update({n.node_id: n.inventory for n in nodes})
        for label, why in unread.items():
            log.warning("ray_node_inventory_unread", node=label, reason=why)
        try:
            demands = cluster_demands(registry, self._shapes_for(registry, nodes))
        except InfeasiblePlan as exc:  # a model's own numbers contradict each other
            return exc
        planned = {d.replica_id for d in demands}  # replicas removed or scaled away are forgotten
        self._running_on = {rid: node for rid, node in self._running_on.items() if rid in planned}
        return place_replicas(nodes, demands, self._options, eligible=_eligibility(registry, alive),
                              refusals=(unapplied_changes, refuse_time_slicing(registry, NO_ARBITER)),
                              previous=dict(self._running_on), unread=unread)

    def _shapes_for(self, registry: Registry, nodes: list[ClusterNode]) -> Mapping[str, ModelShape]:
        """The given shapes, plus estimates from the weights' metadata for planned models that need a memory size
        and have none, when some node has a GPU (on the CPU none is needed)."""
        if all(n.inventory.is_cpu for n in nodes):
            return self._shapes
        planned = registry.model_copy(update={"models": [m for m in registry.models if planned_on_cluster(m)]})
        shapes, unknown = with_estimates(planned, self._shapes)
        for model, reason in unknown.items():
            log.warning("model_shape_unknown", model=model, reason=reason)
        return shapes


def replica_placement(entry: ReplicaPlan) -> ReplicaPlacement:
    """A Ray replica's plan entry as its launch carries it: the local placer's, without an arbiter."""
    return ReplicaPlacement(env=dict(entry.env), kv_cache_bytes=entry.kv_cache_bytes,
                            memory_fraction=None if entry.device_key == "cpu" else entry.memory_fraction)


def _eligibility(registry: Registry, alive: list[dict[str, Any]]) -> NodeEligibility:
    """A replica may go only to a node whose Ray resources hold its model's `ray:` ask (a node label among them),
    as Ray would require of its actor anyway."""
    asked = {m.name: asked_resources(m.ray or RayResources()) for m in registry.models if planned_on_cluster(m)}
    by_id = {str(n["NodeID"]): n for n in alive}

    def eligible(demand: ReplicaDemand, node: ClusterNode) -> str | None:
        resources = by_id[node.node_id]
        if node_holds(resources, asked[demand.model]):
            return None
        return (f"its Ray resources ({resources_text(resources.get('Resources', {}))}) do not hold "
                f"{demand.model!r}'s ray: ask ({resources_text(asked[demand.model])})")

    return eligible
