"""Prometheus metrics of one embedding replica, in a registry of its own (never the process-global one).

Request latency and token counts are recorded by the server; the batcher's state and work (waiting inputs,
forward passes, inputs and tokens encoded, padding) are read from the engine at scrape time, so batch
efficiency shows as `embedding_batched_inputs / embedding_batches` and `tokens / padded_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runtimes.embedding.engine import EmbeddingEngine
from runtimes.server.metrics import LABELS, PREFIX, ReplicaMetrics

# An embedding request takes milliseconds to seconds (a 2048-input request on CPU).
E2E_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EmbeddingEngineCollector(Collector):
    """Plain int reads of counters the engine thread owns: a scrape may be one batch stale, never torn."""

    def __init__(self, engine: EmbeddingEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily(f"{PREFIX}_embedding_inputs_waiting", "Inputs waiting to be encoded.",
                                    labels=LABELS)
        waiting.add_metric([self.model_name], float(self.engine.batcher.num_waiting))
        yield waiting
        stats = self.engine.stats
        counters = [
            ("embedding_batches", "Encoder forward passes (one per length bucket).", stats.num_batches),
            ("embedding_batched_inputs", "Inputs encoded.", stats.num_inputs),
            ("embedding_tokens", "Tokens encoded, padding excluded.", stats.num_tokens),
            ("embedding_padded_tokens", "Tokens fed to the encoder, padding included.", stats.num_padded_tokens),
        ]
        for name, doc, value in counters:
            counter = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=LABELS)
            counter.add_metric([self.model_name], float(value))
            yield counter


class EmbeddingServerMetrics(ReplicaMetrics):
    """Every metric of one embedding replica."""

    def __init__(self, engine: EmbeddingEngine, model_name: str) -> None:
        super().__init__(model_name, e2e_doc="Request latency, arrival to response.", e2e_buckets_s=E2E_BUCKETS_S,
                         prompt_tokens_doc="Input tokens of embedded requests.")
        self.requests = self.counter("embedding_requests", "Embedding requests answered.")
        self.registry.register(_EmbeddingEngineCollector(engine, model_name))

    def observe_request(self, e2e_s: float, num_prompt_tokens: int) -> None:
        self.e2e_s.labels(self.model_name).observe(e2e_s)
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.requests.labels(self.model_name).inc()
