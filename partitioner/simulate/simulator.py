"""The simulator: a pure function from pools of replicas, their models and a traffic to per-model latency and goodput.

A *pool* is what replicas share: a whole GPU, one MIG device, or the CPU, with its fraction of the device's SMs and
memory bandwidth (`cost.Share`). Its members run one of three ways:

- `alone` (a mig or exclusive replica): steps back to back at the pool's share;
- `mps`: every member steps whenever it has work, concurrently; a member's kernels get its thread percentage of the
  pool's SMs, and the pool's bandwidth is split between the members stepping at that moment in proportion to their
  thread percentages (all of it when it steps alone), fixed for the step at its start;
- `timeslice`: one member steps at a time, at the pool's full share, in the order the real arbiter
  (`timeslice.arbiter.TimeSliceArbiter`, on the simulated clock) grants leases by weight.

Between two steps an engine spends its model's `host_s_per_step` off the device (scheduling, detokenizing,
delivering outputs); its next step starts no earlier. Under time-slicing it asks for the next lease as its step
ends, as the real client does (`release(more=True)`): granted at once, it holds the idle device through that
host time (uncharged, as the real client measures from its `acquire`); if another member is granted, that one
steps meanwhile.

Requests arrive as the traffic says, go to the model's replica with the fewest outstanding (the gateway's
least-outstanding routing) and are batched by `engine.ReplicaEngine`. Arrivals stop at `duration_s`; the run goes on
for `drain_s` more so that late arrivals can finish, and stops there. Nothing is random but the traffic, which is
seeded, so a run is a pure function of its inputs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from partitioner.planning.demand import ModelShape
from partitioner.simulate.cost import DeviceSpeed, Share, step_seconds
from partitioner.simulate.engine import EngineLimits, ReplicaEngine, SimRequest
from partitioner.simulate.traffic import Traffic
from partitioner.timeslice.arbiter import TimeSliceArbiter

DEFAULT_DRAIN_S = 30.0


@dataclass(frozen=True)
class Member:
    """A replica in a pool."""

    replica_id: str
    model: str
    kv_cache_bytes: int
    sm_fraction: float = 1.0  # of the pool's SMs: its MPS thread percentage / 100 (1 alone or time-sliced)
    weight: float = 1.0  # its time-slice weight


@dataclass(frozen=True)
class Pool:
    key: str
    sharing: Literal["alone", "mps", "timeslice"]
    share: Share  # of the whole device
    speed: DeviceSpeed
    members: tuple[Member, ...]


@dataclass(frozen=True)
class SimModel:
    shape: ModelShape
    limits: EngineLimits = field(default_factory=EngineLimits)


@dataclass(frozen=True)
class ModelResult:
    model: str
    arrived: int
    finished: int
    rejected: int  # could never run (longer than max_model_len or the KV cache)
    in_flight: int  # waiting or running when the run stopped
    good: int  # finished within both SLOs
    goodput_per_s: float  # good / duration_s
    throughput_per_s: float  # finished / duration_s
    output_tokens_per_s: float  # of the finished requests, over duration_s
    generated_tokens: int  # every output token made by the end of the run, finished requests or not
    ttft_ms: dict[str, float]  # p50, p99 (requests that got a first token)
    tpot_ms: dict[str, float]  # p50, p99 (finished requests of more than one output token)
    kv_peak_fraction: float  # the most of any replica's KV cache in use at once
    kv_headroom_bytes: int  # the least KV cache any replica left unused at its peak


def simulate(pools: Sequence[Pool], models: Mapping[str, SimModel], traffic: Traffic,
             drain_s: float = DEFAULT_DRAIN_S) -> dict[str, ModelResult]:
    """Serve `traffic` on `pools` (module docstring); results by model, for every model with traffic or a replica.
    Raises ValueError for traffic of a model with no replica, or a replica of a model with no shape."""
    members = [m for pool in pools for m in pool.members]
    unknown = sorted({m.model for m in members} - set(models))
    if unknown:
        raise ValueError(f"no shape for model(s) {unknown} (they have replicas in the plan); known: {sorted(models)}")
    homeless = sorted(set(traffic.models) - {m.model for m in members})
    if homeless:
        raise ValueError(f"traffic for model(s) {homeless}, which no replica of the plan serves "
                         f"(served: {sorted({m.model for m in members})})")
    run = _Run(pools, models, traffic)
    run.play(traffic.duration_s + drain_s)
    return {model: run.result(model) for model in sorted({m.model for m in members} | set(traffic.models))}


class _Run:
    """One simulation's mutable state: engines, the event heap and the arbiters."""

    def __init__(self, pools: Sequence[Pool], models: Mapping[str, SimModel], traffic: Traffic) -> None:
        self.now = 0.0
        self.models, self.traffic = models, traffic
        self.events: list[tuple[float, int, str, str, SimRequest | None]] = []
        self.pool_of: dict[str, Pool] = {}
        self.member: dict[str, Member] = {}
        self.engines: dict[str, ReplicaEngine] = {}
        self.stepping: dict[str, tuple[list[tuple[SimRequest, int]], float]] = {}  # replica -> its step, its start
        self.ready_at: dict[str, float] = {}  # replica -> when its host work after its last step is done
        self.starting: set[str] = set()  # replicas whose next step waits for their host work
        self.queued: set[str] = set()  # time-sliced replicas waiting for the lease
        self.arbiters: dict[str, TimeSliceArbiter] = {}
        self.arrived: dict[str, int] = dict.fromkeys(traffic.models, 0)
        self._seq = 0
        for pool in pools:
            if pool.sharing == "timeslice":  # leases never expire: a simulated step always releases
                self.arbiters[pool.key] = TimeSliceArbiter(clock=lambda: self.now, max_lease_s=math.inf)
            for m in pool.members:
                shape = models[m.model].shape
                self.pool_of[m.replica_id], self.member[m.replica_id] = pool, m
                self.engines[m.replica_id] = ReplicaEngine(m.replica_id, m.model, models[m.model].limits,
                                                           m.kv_cache_bytes // shape.kv_bytes_per_token)
                if pool.key in self.arbiters:
                    self.arbiters[pool.key].register(m.replica_id, m.weight)
        for model in traffic.models:
            for a in traffic.arrivals(model):
                self._push(a.time_s, "arrival", model, SimRequest(model, a.time_s, a.prompt_tokens, a.output_tokens))

    def play(self, horizon_s: float) -> None:
        while self.events and self.events[0][0] <= horizon_s:
            self.now, _, kind, key, request = heapq.heappop(self.events)
            if kind == "arrival":
                assert request is not None
                self._arrive(key, request)
            elif kind == "step_start":
                self.starting.discard(key)
                self._start_step(key)
            else:
                self._step_ended(key)

    def result(self, model: str) -> ModelResult:
        engines = [e for e in self.engines.values() if e.model == model]
        finished = [r for e in engines for r in e.finished]
        started = [r for e in engines for r in [*e.finished, *e.running] if r.first_token_s is not None]
        slo = self.traffic.models[model].slo if model in self.traffic.models else None
        ttft = [(r.first_token_s or 0.0) - r.arrival_s for r in started]
        tpot = [_tpot_s(r) for r in finished if r.output_tokens > 1]
        good = [r for r in finished if slo is not None and slo.met((r.first_token_s or 0.0) - r.arrival_s, _tpot_s(r))]
        duration = self.traffic.duration_s
        per_token = self.models[model].shape.kv_bytes_per_token
        return ModelResult(
            model=model, arrived=self.arrived.get(model, 0), finished=len(finished),
            rejected=sum(len(e.rejected) for e in engines), in_flight=sum(e.outstanding for e in engines),
            good=len(good), goodput_per_s=len(good) / duration, throughput_per_s=len(finished) / duration,
            output_tokens_per_s=sum(r.output_tokens for r in finished) / duration,
            generated_tokens=sum(r.generated for e in engines for r in [*e.finished, *e.running]),
            ttft_ms=_percentiles_ms(ttft), tpot_ms=_percentiles_ms(tpot),
            kv_peak_fraction=max((e.kv_peak_tokens / e.kv_capacity_tokens for e in engines), default=0.0),
            kv_headroom_bytes=min(((e.kv_capacity_tokens - e.kv_peak_tokens) * per_token for e in engines),
                                  default=0))

    def _push(self, time_s: float, kind: str, key: str, request: SimRequest | None = None) -> None:
        self._seq += 1  # ties: first pushed, first served
        heapq.heappush(self.events, (time_s, self._seq, kind, key, request))

    def _arrive(self, model: str, request: SimRequest) -> None:
        self.arrived[model] += 1
        replica = min((e for e in self.engines.values() if e.model == model), key=lambda e: e.outstanding)
        replica.add(request)
        self._wake(replica.replica_id)

    def _wake(self, replica_id: str) -> None:
        """A replica that got work steps now, or queues for its pool's lease."""
        if (replica_id in self.stepping or replica_id in self.queued or replica_id in self.starting
                or not self.engines[replica_id].has_work()):
            return
        arbiter = self.arbiters.get(self.pool_of[replica_id].key)
        if arbiter is None:
            self._start_step(replica_id)
            return
        self.queued.add(replica_id)
        granted = arbiter.request(replica_id)
        if granted is not None:
            self._granted(granted)

    def _granted(self, replica_id: str) -> None:
        self.queued.discard(replica_id)
        self._start_step(replica_id)

    def _start_step(self, replica_id: str) -> None:
        ready_s = self.ready_at.get(replica_id, 0.0)
        if ready_s > self.now:  # still busy off the device since its last step: it starts (holding any lease) then
            self.starting.add(replica_id)
            self._push(ready_s, "step_start", replica_id)
            return
        engine, pool = self.engines[replica_id], self.pool_of[replica_id]
        plan = engine.plan_step()
        assert plan, f"{replica_id} has work but planned an empty step"
        self.stepping[replica_id] = plan, self.now
        model = self.models[engine.model]
        seconds = step_seconds(model.shape, engine.work(plan), self._share(replica_id, pool), pool.speed,
                               self.traffic.models[engine.model].calibration if engine.model in self.traffic.models
                               else 1.0)
        self._push(self.now + seconds, "step_end", replica_id)

    def _share(self, replica_id: str, pool: Pool) -> Share:
        """What this step's kernels get (module docstring): under MPS, its SMs and its part of the bandwidth."""
        if pool.sharing != "mps":
            return pool.share
        mine = self.member[replica_id].sm_fraction
        busy = sum(m.sm_fraction for m in pool.members if m.replica_id in self.stepping)  # includes this step's
        return Share(pool.share.sm_fraction * mine, pool.share.bandwidth_fraction * mine / busy)

    def _step_ended(self, replica_id: str) -> None:
        engine, (plan, started_s) = self.engines[replica_id], self.stepping.pop(replica_id)
        engine.finish_step(plan, self.now)
        load = self.traffic.models.get(engine.model)
        self.ready_at[replica_id] = self.now + (load.host_s_per_step if load is not None else 0.0)
        arbiter = self.arbiters.get(self.pool_of[replica_id].key)
        if arbiter is None:
            self._wake(replica_id)
            return
        more = engine.has_work()
        if more:
            self.queued.add(replica_id)
        granted = arbiter.release(replica_id, self.now - started_s, more=more)
        if granted is not None:
            self._granted(granted)

def _tpot_s(r: SimRequest) -> float:
    """Mean time per output token after the first (0 for a one-token reply)."""
    if r.output_tokens <= 1 or r.finish_s is None or r.first_token_s is None:
        return 0.0
    return (r.finish_s - r.first_token_s) / (r.output_tokens - 1)


def _percentiles_ms(values_s: Sequence[float]) -> dict[str, float]:
    if not values_s:
        return {"p50": math.nan, "p99": math.nan}
    p50, p99 = np.percentile(np.asarray(values_s) * 1e3, [50, 99])
    return {"p50": float(p50), "p99": float(p99)}
