"""Simulate every candidate plan on the same traffic and rank them by goodput (what `partition simulate` prints and
`partition plan --objective goodput` chooses from)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from partitioner.devices.inventory import Inventory
from partitioner.planning.demand import ModelShape, ReplicaDemand
from partitioner.planning.placement import PlanOptions
from partitioner.simulate.candidates import Candidate, candidate_plans
from partitioner.simulate.engine import EngineLimits
from partitioner.simulate.pools import plan_pools
from partitioner.simulate.simulator import DEFAULT_DRAIN_S, ModelResult, SimModel, simulate
from partitioner.simulate.traffic import Traffic
from registry.engine import EngineSpec
from registry.schema import Registry


@dataclass(frozen=True)
class Evaluated:
    candidate: Candidate
    models: dict[str, ModelResult] = field(default_factory=dict)
    error: str | None = None  # why it was not simulated (infeasible: the planner's problems; or the simulator's)
    unplanned_bytes: int = 0  # memory our replicas may use on the devices it uses, left unplanned

    @property
    def goodput_per_s(self) -> float:
        return sum(m.goodput_per_s for m in self.models.values())

    @property
    def throughput_per_s(self) -> float:
        return sum(m.throughput_per_s for m in self.models.values())


def sim_models(registry: Registry, shapes: Mapping[str, ModelShape]) -> dict[str, SimModel]:
    """The simulator's view of each LLM of the registry that has a shape: the shape and the engine's batch limits
    (`max_model_len` unset: the shape's context)."""
    out = {}
    for model in registry.models:
        engine, shape = model.engine, shapes.get(model.name)
        if isinstance(engine, EngineSpec) and shape is not None:
            out[model.name] = SimModel(shape, EngineLimits(engine.max_num_seqs, engine.max_num_batched_tokens,
                                                           engine.max_model_len or shape.context_len,
                                                           engine.block_size))
    return out


def evaluate(candidates: Sequence[Candidate], inventory: Inventory, models: Mapping[str, SimModel], traffic: Traffic,
             drain_s: float = DEFAULT_DRAIN_S) -> list[Evaluated]:
    """Each candidate simulated on `traffic` (infeasible ones carried with their problems), in the given order."""
    out = []
    for candidate in candidates:
        if candidate.plan is None:
            out.append(Evaluated(candidate, error="; ".join(candidate.problems)))
            continue
        try:
            pools = plan_pools(candidate.plan, inventory)
            results = simulate(pools, models, traffic, drain_s)
        except ValueError as exc:
            out.append(Evaluated(candidate, error=str(exc)))
            continue
        unplanned = sum((d.capacity_bytes or 0) - d.planned_bytes for d in candidate.plan.devices
                        if d.managed and d.replica_ids)
        out.append(Evaluated(candidate, results, unplanned_bytes=unplanned))
    return out


def evaluate_candidates(inventory: Inventory, demands: Sequence[ReplicaDemand], models: Mapping[str, SimModel],
                        traffic: Traffic, options: PlanOptions, drain_s: float = DEFAULT_DRAIN_S) -> list[Evaluated]:
    """Every candidate plan of `demands` (`candidate_plans`; its shares by load weigh each model's offered tokens by
    its weight bytes), simulated on `traffic`."""
    load = {m: t.offered_tokens_per_s(traffic.duration_s) * models[m].shape.weights_bytes
            for m, t in traffic.models.items() if m in models}
    return evaluate(candidate_plans(inventory, demands, options, load), inventory, models, traffic, drain_s)


def static_mig(evaluated: Sequence[Evaluated]) -> Evaluated | None:
    """The memory-sized all-MIG candidate (static partitioning), when it was simulated."""
    return next((e for e in evaluated if e.error is None and e.candidate.static), None)


def best(evaluated: Sequence[Evaluated]) -> Evaluated | None:
    """The simulated candidate with the most goodput (ties: the most throughput, then the earliest listed)."""
    ok = [e for e in evaluated if e.error is None]
    return max(ok, key=lambda e: (e.goodput_per_s, e.throughput_per_s), default=None)
