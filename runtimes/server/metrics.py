"""Prometheus metrics of one replica, in a registry of its own (never the process-global one).

`ReplicaMetrics` is what every replica has (end-to-end latency, prompt tokens, the /metrics body); each engine's
metrics extend it. For the LLM engine (`ServerMetrics`), latencies and token counts are recorded by the server as
outputs stream out; engine state (queue, running sequences, KV blocks, prefix-cache hit rate, preemptions) is read at
scrape time by a collector. The engine is only a type here: an embedding replica does not load the LLM runtime.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from foundation.metric_buckets import E2E_BUCKETS_S, ITL_BUCKETS_S, TTFT_BUCKETS_S

if TYPE_CHECKING:
    from runtimes.llm.engine import LLMEngine

PREFIX = "multiserve"
LABELS = ["model_name"]


class ReplicaMetrics:
    """The metrics every replica has, labelled with its model; `render()` is the /metrics body."""

    def __init__(self, model_name: str, *, e2e_doc: str, e2e_buckets_s: tuple[float, ...],
                 prompt_tokens_doc: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.e2e_s = self.histogram("e2e_request_latency_seconds", e2e_doc, e2e_buckets_s)
        self.prompt_tokens = self.counter("prompt_tokens", prompt_tokens_doc)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"{PREFIX}_{name}", doc, LABELS, registry=self.registry, buckets=buckets)

    def counter(self, name: str, doc: str, extra_labels: tuple[str, ...] = ()) -> Counter:
        return Counter(f"{PREFIX}_{name}", doc, [*LABELS, *extra_labels], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reads the engine's counters at scrape time. Plain int reads of state the engine thread owns: a
    scrape may be one step stale, never torn."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        engine, labels = self.engine, [self.model_name]
        kv = engine.kv
        values = [
            ("num_requests_waiting", "Sequences waiting to be scheduled.", len(engine.scheduler.waiting)),
            ("num_requests_running", "Sequences in the running batch.", len(engine.scheduler.running)),
            ("kv_blocks_used", "KV-cache blocks in use.", kv.num_blocks - kv.num_free_blocks),
            ("kv_blocks_free", "KV-cache blocks free (cached prefixes included).", kv.num_free_blocks),
            ("kv_blocks_total", "KV-cache blocks in the pool.", kv.num_blocks),
            ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens queried.",
             kv.stats.hit_rate),
        ]
        for name, doc, value in values:
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=LABELS)
            gauge.add_metric(labels, float(value))
            yield gauge
        preemptions = CounterMetricFamily(f"{PREFIX}_num_preemptions", "Sequences preempted for lack of KV blocks.",
                                          labels=LABELS)
        preemptions.add_metric(labels, float(engine.scheduler.num_preemptions))
        yield preemptions
        for name, doc, count in (
                ("num_interrupted_steps", "Steps stopped between layers for an interactive arrival's step of its own "
                                          "(finished after it).", engine.num_interrupted_steps),
                ("num_dropped_steps", "Stopped steps not finished (a request of theirs changed meanwhile, or finishing "
                                      "failed): their work is redone.", engine.num_dropped_steps),
                ("num_graph_steps", "Decode steps replayed from a CUDA graph.", engine.num_graph_steps),
                ("num_launched_steps", "Decode steps launched before the previous step's tokens were read back.",
                 engine.num_launched_steps)):
            counter = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=LABELS)
            counter.add_metric(labels, float(count))
            yield counter
        if (speculation := engine.speculation) is not None:  # vLLM's spec_decode_num_* counters
            method, stats = speculation.options.method, speculation.stats
            for name, doc, count in (
                    ("spec_decode_num_drafts", "Proposals verified (one per request per step).", stats.num_drafts),
                    ("spec_decode_num_draft_tokens", "Tokens proposed.", stats.num_proposed),
                    ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", stats.num_accepted)):
                counter = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=[*LABELS, "method"])
                counter.add_metric([*labels, method], float(count))
                yield counter


class ServerMetrics(ReplicaMetrics):
    """Every metric of one LLM replica."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        super().__init__(model_name, e2e_doc="Request latency, arrival to last token.", e2e_buckets_s=E2E_BUCKETS_S,
                         prompt_tokens_doc="Prompt tokens of admitted requests.")
        self.ttft_s = self.histogram("time_to_first_token_seconds", "Time to first token (TTFT).", TTFT_BUCKETS_S)
        self.itl_s = self.histogram("inter_token_latency_seconds", "Time between tokens of a sequence (ITL).",
                                    ITL_BUCKETS_S)
        self.generation_tokens = self.counter("generation_tokens", "Generated tokens.")
        self.requests = self.counter("request_success", "Finished sequences by finish reason.", ("finish_reason",))
        self.registry.register(_EngineCollector(engine, model_name))

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft_s.labels(self.model_name).observe(ttft_s)
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def observe_tokens(self, num_tokens: int, itl_s: float | None) -> None:
        """`num_tokens` came `itl_s` after the sequence's previous ones: each counts that time's share (several come
        at once where a proposal was accepted)."""
        self.generation_tokens.labels(self.model_name).inc(num_tokens)
        if itl_s is not None and num_tokens:
            for _ in range(num_tokens):
                self.itl_s.labels(self.model_name).observe(itl_s / num_tokens)

    def observe_finish(self, finish_reason: str) -> None:
        self.requests.labels(self.model_name, finish_reason).inc()

    def observe_request_done(self, e2e_s: float) -> None:
        self.e2e_s.labels(self.model_name).observe(e2e_s)
