"""Gateway metrics in a registry of its own: requests by model and status, TTFT and end-to-end
latency, retries and failovers; replica and breaker states are read from the pool at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from foundation.metric_buckets import E2E_BUCKETS_S, TTFT_BUCKETS_S
from model_pool.health import BreakerState
from model_pool.pool import ModelPool
from model_pool.replica import ReplicaState

PREFIX = "multiserve_gateway"


class _PoolCollector(Collector):
    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        states = GaugeMetricFamily(f"{PREFIX}_replica_state", "1 for the state each replica is in.",
                                   labels=["model", "replica", "state"])
        breakers = GaugeMetricFamily(f"{PREFIX}_breaker_state", "1 for the state of each replica's breaker.",
                                     labels=["model", "replica", "state"])
        in_flight = GaugeMetricFamily(f"{PREFIX}_replica_in_flight", "Requests in flight per replica.",
                                      labels=["model", "replica"])
        for replica in self.pool.replicas():
            name = replica.model
            for state in ReplicaState:
                states.add_metric([name, replica.replica_id, state.value], float(replica.state == state))
            current = replica.breaker.state
            for bstate in BreakerState:
                breakers.add_metric([name, replica.replica_id, bstate.value], float(current == bstate))
            in_flight.add_metric([name, replica.replica_id], float(replica.outstanding))
        yield states
        yield breakers
        yield in_flight
        yield from self._residency()

    def _residency(self) -> Iterator[Metric]:
        """Models on demand: cold starts by outcome, replicas unloaded (idle or evicted), and each device's memory
        budget and what resident replicas hold of it."""
        stats = self.pool.stats
        cold = CounterMetricFamily(f"{PREFIX}_cold_starts", "Replicas started on demand for a request, by outcome: "
                                   "ok, failed (exited or not ready in time) or refused (no room in the memory "
                                   "budget).", labels=["model", "outcome"])
        for (model, outcome), n in sorted(stats.cold_starts.items()):
            cold.add_metric([model, outcome], float(n))
        unloads = CounterMetricFamily(f"{PREFIX}_replica_unloads", "Replicas of models on demand stopped, by reason: "
                                      "idle (scaling.idle_unload_s) or evicted (room for another under the memory "
                                      "budget).", labels=["model", "reason"])
        for (model, reason), n in sorted(stats.unloads.items()):
            unloads.add_metric([model, reason], float(n))
        held = GaugeMetricFamily(f"{PREFIX}_memory_held_bytes", "Memory the replicas on a device hold by the "
                                 "planner's model (starting and stopping ones included).", labels=["device"])
        budget = GaugeMetricFamily(f"{PREFIX}_memory_budget_bytes", "A device's memory budget for resident "
                                   "replicas (gateway.memory_budget_gib, else the device's memory).", labels=["device"])
        for device, memory in self.pool.memory().items():
            held.add_metric([device], float(memory["held_bytes"]))
            if memory["budget_bytes"] is not None:
                budget.add_metric([device], float(memory["budget_bytes"]))
        yield from (cold, unloads, held, budget)


SharesSource = Callable[[], Mapping[str, Sequence[Any]]]  # device -> arbiter ClientShares


class _TimeShareCollector(Collector):
    """The time-slice arbiters' view: per device and replica, weight, device time held, and recent share."""

    def __init__(self, source: SharesSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        labels = ["device", "replica"]
        weight = GaugeMetricFamily(f"{PREFIX}_timeslice_weight", "Time-slice weight of each replica on a shared "
                                   "device.", labels=labels)
        share = GaugeMetricFamily(f"{PREFIX}_timeslice_share", "Share of the device's time each replica held "
                                  "recently (exponentially decayed over ~10 s).", labels=labels)
        busy = CounterMetricFamily(f"{PREFIX}_timeslice_busy_seconds", "Device time each replica held under "
                                   "its lease.", labels=labels)
        steps = CounterMetricFamily(f"{PREFIX}_timeslice_steps", "Engine steps each replica ran under its lease.",
                                    labels=labels)
        expired = CounterMetricFamily(f"{PREFIX}_timeslice_leases_expired", "Leases a replica held past the "
                                      "arbiter's max_lease_s, which then passed on (a hung or very long step).",
                                      labels=labels)
        for device, clients in self.source().items():
            for c in clients:
                weight.add_metric([device, c.client_id], c.weight)
                share.add_metric([device, c.client_id], c.recent_share)
                busy.add_metric([device, c.client_id], c.busy_s)
                steps.add_metric([device, c.client_id], float(c.num_steps))
                expired.add_metric([device, c.client_id], float(c.num_expired))
        yield from (weight, share, busy, steps, expired)


class GatewayMetrics:
    def __init__(self, pool: ModelPool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(f"{PREFIX}_requests", "Requests by model, endpoint and status.",
                                ["model", "endpoint", "status"], registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_byte_seconds",
                              "Streaming: time until the first event reached the client (the first token).",
                              ["model"], buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.cold_ttft = Histogram(f"{PREFIX}_cold_time_to_first_byte_seconds",
                                   "Streaming requests that waited for their model to start on demand: time until "
                                   "the first event reached the client, the start included.",
                                   ["model"], buckets=E2E_BUCKETS_S, registry=self.registry)
        self.cold_start_wait = Histogram(f"{PREFIX}_cold_start_wait_seconds", "Time a request waited for its model "
                                         "to start on demand (its replica's launch until ready, or a share of it).",
                                         ["model"], buckets=E2E_BUCKETS_S, registry=self.registry)
        self.e2e = Histogram(f"{PREFIX}_request_duration_seconds", "End-to-end request latency.",
                             ["model"], buckets=E2E_BUCKETS_S, registry=self.registry)
        self.retries = Counter(f"{PREFIX}_retries", "Requests re-sent to another replica after a failure.",
                               ["model"], registry=self.registry)
        self.failovers = Counter(f"{PREFIX}_failovers", "Requests served by a fallback model.",
                                 ["model", "fallback"], registry=self.registry)
        self.migrations = Counter(f"{PREFIX}_stream_migrations", "Streams continued on another replica mid-way, by "
                                  "cause: replica_failed (it died or broke off), replica_unhealthy (its probes "
                                  "failed), stalled (silent for stream_stall_s) or drained (drain with migration, "
                                  "scale-down, rollout).", ["model", "cause"], registry=self.registry)
        self.resumed_tokens = Counter(f"{PREFIX}_resumed_tokens", "Tokens already streamed that continuations handed "
                                      "to another replica (it computes them again, like a prompt).", ["model"],
                                      registry=self.registry)
        self.registry.register(_PoolCollector(pool))

    def add_time_shares(self, source: SharesSource) -> None:
        """Export the time-slice arbiters' shares (`PlacementApplier.shares`, partitioner/applying/placements.py) at
        each scrape."""
        self.registry.register(_TimeShareCollector(source))

    def render(self) -> bytes:
        return generate_latest(self.registry)
