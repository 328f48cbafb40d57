"""The partitioner's plan across the nodes of a cluster: which node each replica goes to, and on that node the same
plan a single host gets (`planner.plan` against that node's own inventory).

Pure, like the planner: the nodes' inventories come in (read on each node by whoever runs the cluster, e.g.
`model_pool.ray_plan`), and nothing here talks to a cluster. `read_node_inventories` gathers them through a
callable that reads one node, so the gathering is tested without a cluster too.

Policy (documented in docs/multi-node.md): first fit, largest first. Replicas are taken by memory, largest first
(the replicas of one shared MIG instance together, as one; on a re-plan, those running on a node still alive
before the others); each goes to the first node whose plan, re-made with it added to that node's replicas, is
feasible and acceptable (`NodeRefusal`s, such as "needs no device changes").
Nodes are tried in a fixed order: the node a replica runs on now first (a re-plan moves nothing that still fits),
then, for a replica that wants the CPU (`device: cpu`), CPU-only nodes before GPU nodes, for any other GPU nodes
first; ties by address, then node id. `device: auto` means a GPU, as on one host: it goes to a CPU-only node only
when no node has a GPU. The same input always gives the same plan. When no node takes a replica, the plan is
infeasible, naming every node and why it refused (the planner's message for that node, with by how much it falls
short).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from partitioner.devices.inventory import Inventory
from partitioner.planning.demand import DEFAULT_OVERHEAD_BYTES, ModelShape, ReplicaDemand, replica_demands
from partitioner.planning.placement import PlanOptions
from partitioner.planning.placer import needs_arbiter
from partitioner.planning.plan import InfeasiblePlan, Plan, ReplicaPlan
from partitioner.planning.planner import plan
from registry.fields import gib
from registry.schema import ModelSpec, Registry


@dataclass(frozen=True)
class ClusterNode:
    """One node of the cluster and what its devices are (read on that node)."""

    node_id: str
    address: str  # its IP or host name, for messages
    inventory: Inventory

    def label(self) -> str:
        return node_label(self.node_id, self.address)


def node_label(node_id: str, address: str) -> str:
    """A node in messages: its address, and the head of its id (several nodes may run on one host)."""
    return f"node {address} ({node_id[:12]})"


NodeRefusal = Callable[[ClusterNode, Plan], str | None]  # why a feasible plan of the node is still not acceptable
NodeEligibility = Callable[[ReplicaDemand, ClusterNode], str | None]  # why a replica may not go to the node at all


@dataclass(frozen=True)
class ClusterPlan:
    """Where each replica runs: its node (`assignment`) and that node's plan (`plans`, the nodes with replicas);
    `unplaced`: the replicas no node takes, each with the problem that says why (empty in a feasible plan)."""

    nodes: tuple[ClusterNode, ...]
    plans: Mapping[str, Plan] = field(default_factory=dict)  # node id -> its plan
    assignment: Mapping[str, str] = field(default_factory=dict)  # replica id -> node id
    unplaced: Mapping[str, str] = field(default_factory=dict)  # replica id -> why no node takes it

    @property
    def problems(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.unplaced.values()))  # the replicas of one shared instance share theirs

    def replica(self, replica_id: str) -> tuple[ClusterNode, ReplicaPlan]:
        """The node of `replica_id` and its plan entry there; KeyError when the plan does not place it."""
        node_id = self.assignment[replica_id]
        node = next(n for n in self.nodes if n.node_id == node_id)
        return node, self.plans[node_id].replica(replica_id)


def planned_on_cluster(model: ModelSpec) -> bool:
    """Whether the cluster plan places `model`'s replicas: a `launcher: ray` model that writes `placement:` or
    targets a GPU (`device: cuda`). Other Ray models go wherever the cluster's scheduler puts them."""
    return (model.launcher == "ray" and model.enabled and model.max_replicas > 0
            and ("placement" in model.model_fields_set or model.device == "cuda"))


def cluster_demands(registry: Registry, shapes: Mapping[str, ModelShape] | None = None,
                    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES) -> list[ReplicaDemand]:
    """One demand per replica of each model `planned_on_cluster`, sized as a local replica is. Raises
    `InfeasiblePlan` when a model's own numbers contradict each other."""
    return replica_demands(registry, shapes, overhead_bytes, planned=planned_on_cluster)


def read_node_inventories(nodes: Sequence[tuple[str, str]], read_one: Callable[[str], Inventory],
                          known: Mapping[str, Inventory] | None = None,
                          ) -> tuple[list[ClusterNode], dict[str, str]]:
    """The inventory of each `(node id, address)`: from `known` when read before, else `read_one(node_id)` (which
    runs on that node). A node whose inventory cannot be read is left out of the plan; the second result says why,
    by node label, for messages."""
    known = known or {}
    found, unread = [], {}
    for node_id, address in nodes:
        inventory = known.get(node_id)
        if inventory is None:
            try:
                inventory = read_one(node_id)
            except Exception as exc:  # a node that died, or whose reader failed: plan on the others
                unread[node_label(node_id, address)] = f"its inventory could not be read: {exc}"
                continue
        found.append(ClusterNode(node_id, address, inventory))
    return found, unread


def plan_cluster(nodes: Sequence[ClusterNode], demands: Sequence[ReplicaDemand], options: PlanOptions | None = None,
                 *, eligible: NodeEligibility | None = None, refusals: Sequence[NodeRefusal] = (),
                 previous: Mapping[str, str] | None = None, unread: Mapping[str, str] | None = None,
                 ) -> ClusterPlan:
    """Place every demand on a node, and plan each node (see the module for the policy). Raises `InfeasiblePlan`
    with one problem per replica (or shared MIG instance) that no node takes, naming each node and its reason."""
    result = place_replicas(nodes, demands, options, eligible=eligible, refusals=refusals, previous=previous,
                            unread=unread)
    if result.problems:
        raise InfeasiblePlan(result.problems)
    return result


def place_replicas(nodes: Sequence[ClusterNode], demands: Sequence[ReplicaDemand],
                   options: PlanOptions | None = None, *, eligible: NodeEligibility | None = None,
                   refusals: Sequence[NodeRefusal] = (), previous: Mapping[str, str] | None = None,
                   unread: Mapping[str, str] | None = None) -> ClusterPlan:
    """`plan_cluster`, keeping what fits: the replicas no node takes are in `unplaced` rather than raised, so that
    when a node is lost the others still start. `previous` (replica id -> the node it runs on) puts the replicas
    of nodes still alive first, each on its node when that still takes it; `unread` (node label -> why) names the
    nodes that could not be considered."""
    ids = [d.replica_id for d in demands]
    if len(set(ids)) != len(ids):
        raise ValueError(f"replica ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
    options = options or PlanOptions()
    previous = {r: n for r, n in (previous or {}).items() if any(node.node_id == n for node in nodes)}
    any_gpu = any(not n.inventory.is_cpu for n in nodes)
    assigned: dict[str, list[ReplicaDemand]] = {n.node_id: [] for n in nodes}
    plans: dict[str, Plan] = {}
    unplaced: dict[str, str] = {}
    for unit in _units(demands, previous):
        reasons = []
        for node in _node_order(unit, nodes, previous):
            reason = _device_refusal(unit, node, any_gpu) or _first_refusal(unit, node, eligible)
            if reason is None:
                result = _node_plan(node, [*assigned[node.node_id], *unit], options, refusals)
                if isinstance(result, Plan):
                    assigned[node.node_id] += unit
                    plans[node.node_id] = result
                    break
                reason = result
            reasons.append(f"{node.label()}: {reason}")
        else:
            reasons += [f"{label}: {why}" for label, why in (unread or {}).items()]
            problem = (f"{_unit_label(unit)} fits no node of the cluster: "
                       + ("; ".join(reasons) or "the cluster has no node"))
            unplaced |= {d.replica_id: problem for d in unit}
    assignment = {d.replica_id: node_id for node_id, placed in assigned.items() for d in placed}
    return ClusterPlan(nodes=tuple(nodes), plans=plans, assignment=assignment, unplaced=unplaced)


def unapplied_changes(node: ClusterNode, node_plan: Plan) -> str | None:
    """A refusal: the node's plan needs MIG devices created or MPS daemons started first. Nothing makes them on
    another node (`multiserve partition apply` plans its own host's local models), so a replica never starts there
    half-isolated."""
    actions = node_plan.actions()
    if not actions:
        return None
    changes = "; ".join(a.describe() for a in actions)
    return (f"its devices need {len(actions)} change(s) before the replicas can start isolated there: {changes} "
            f"(make them on that node first)")


def refuse_time_slicing(registry: Registry, why: str) -> NodeRefusal:
    """A refusal: the node's plan time-slices a device between replicas that would take an arbiter's lease there
    (`placer.needs_arbiter`, as a local plan decides it), and the node has no arbiter; `why` says what to do
    instead. The message names each such model's `placement.isolation` field."""
    fields = {m.name: f"models[{i}].placement.isolation" for i, m in enumerate(registry.models)}

    def refuse(node: ClusterNode, node_plan: Plan) -> str | None:
        gated = [r for r in node_plan.replicas if needs_arbiter(node_plan, r, registry)]
        if not gated:
            return None
        device = min(r.device_key for r in gated)
        replicas = [r for r in gated if r.device_key == device]
        names = ", ".join(sorted({fields[r.model] for r in replicas}))
        return (f"it would time-slice {device} between {', '.join(r.replica_id for r in replicas)} ({names}: "
                f"'timeslice'), which needs an arbiter on that node: {why}")

    return refuse


def _units(demands: Sequence[ReplicaDemand], previous: Mapping[str, str]) -> list[list[ReplicaDemand]]:
    """What is placed as one: a replica, or every replica naming the same MIG instance (they share one device, so
    one node). Those running on an alive node first (they keep their place), then largest first, then by id, so
    the same demands always come in the same order."""
    groups: dict[str, list[ReplicaDemand]] = {}
    units = []
    for d in demands:
        if d.mig_instance is not None and d.device != "cpu":
            groups.setdefault(d.mig_instance, []).append(d)
        else:
            units.append([d])
    units += [sorted(members, key=lambda d: d.replica_id) for _, members in sorted(groups.items())]
    return sorted(units, key=lambda u: (not any(d.replica_id in previous for d in u),
                                        -sum(d.memory_bytes or 0 for d in u), u[0].model, u[0].replica))


def _node_order(unit: list[ReplicaDemand], nodes: Sequence[ClusterNode],
                previous: Mapping[str, str]) -> list[ClusterNode]:
    before = {previous.get(d.replica_id) for d in unit} - {None}
    wants_cpu = all(d.device == "cpu" for d in unit)
    return sorted(nodes, key=lambda n: (n.node_id not in before, n.inventory.is_cpu != wants_cpu, n.address,
                                        n.node_id))


def _device_refusal(unit: list[ReplicaDemand], node: ClusterNode, any_gpu: bool) -> str | None:
    """`device: auto` means a GPU wherever there is one: on one host the planner never puts it on the CPU next to a
    GPU, so across nodes it goes to a CPU-only node only when no node has a GPU."""
    if any_gpu and node.inventory.is_cpu and any(d.device == "auto" for d in unit):
        return "a CPU-only node, and device 'auto' runs on a GPU while the cluster has one (device: cpu runs it here)"
    return None


def _first_refusal(unit: list[ReplicaDemand], node: ClusterNode, eligible: NodeEligibility | None) -> str | None:
    if eligible is None:
        return None
    return next((reason for d in unit if (reason := eligible(d, node)) is not None), None)


def _node_plan(node: ClusterNode, demands: list[ReplicaDemand], options: PlanOptions,
               refusals: Sequence[NodeRefusal]) -> Plan | str:
    """The node's plan with `demands`, or why it has none: the planner's problems, or a refusal's reason."""
    try:
        result = plan(node.inventory, demands, options)
    except InfeasiblePlan as exc:
        return "; ".join(exc.problems)
    return next((reason for refuse in refusals if (reason := refuse(node, result)) is not None), result)


def _unit_label(unit: list[ReplicaDemand]) -> str:
    first = unit[0]
    if first.mig_instance is not None and first.device != "cpu":
        memory = sum(d.memory_bytes or 0 for d in unit)
        return (f"MIG instance {first.mig_instance!r} ({first.isolation}: {', '.join(d.replica_id for d in unit)}; "
                f"needs {gib(memory)} in all)")
    need = "" if first.memory_bytes is None else f", needs {gib(first.memory_bytes)}"  # on a GPU the reason says
    return f"{first.replica_id} ({first.isolation}, device {first.device}{need})"


