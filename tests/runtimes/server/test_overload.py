"""Overload at a replica: a full queue and a too-long queue wait are 429s with Retry-After; the requests
already accepted still finish and no block leaks."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.server.app import build_app
from tests.runtimes.llm.tiny import loaded_tiny
from tests.runtimes.server.conftest import all_blocks_free, wait_until

LONG = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "temperature": 0.0}


class Clock:
    """The engine's clock: real time plus whatever the test skips ahead."""

    def __init__(self) -> None:
        import time

        self._now = time.monotonic
        self.skipped_s = 0.0

    def __call__(self) -> float:
        return self._now() + self.skipped_s


@pytest.fixture
def serve() -> Iterator:
    engines: list[AsyncLLMEngine] = []

    def make(clock: Clock | None = None, **limits: object) -> tuple[TestClient, AsyncLLMEngine]:
        config = EngineConfig(kv_cache_bytes=1 << 20, block_size=4, max_num_seqs=1, **limits)
        engine = AsyncLLMEngine(LLMEngine(loaded_tiny(), config, clock=clock or Clock()))
        engines.append(engine)
        return TestClient(build_app(engine, "tiny")), engine

    yield make
    for engine in engines:
        engine.shutdown()


def _in_background(client: TestClient, body: dict, results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(client.post("/v1/completions", json=body)))
    thread.start()
    return thread


def _counts(engine: AsyncLLMEngine) -> tuple[int, int]:
    scheduler = engine.engine.scheduler
    return len(scheduler.running), len(scheduler.waiting)


def test_a_full_queue_is_a_429_with_retry_after(serve):
    client, engine = serve(max_queue_len=1)
    results: list = []
    with client:
        wait_until(lambda: client.get("/ready").status_code == 200, what="/ready")
        threads = [_in_background(client, LONG, results)]
        wait_until(lambda: _counts(engine) == (1, 0), what="one running")
        threads.append(_in_background(client, LONG, results))
        wait_until(lambda: _counts(engine) == (1, 1), what="one waiting")
        refused = client.post("/v1/completions", json={**LONG, "max_tokens": 5})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
        assert "max_queue_len=1" in error["message"]
        for thread in threads:
            thread.join(60)
        assert [r.status_code for r in results] == [200, 200]  # what was accepted finished in full
        assert all(r.json()["usage"]["completion_tokens"] == 400 for r in results)
        assert 'finish_reason="rejected"' in client.get("/metrics").text
    wait_until(lambda: all_blocks_free(engine), what="every block free")


def test_a_request_that_waited_too_long_is_a_429(serve):
    clock = Clock()
    client, engine = serve(clock, max_queue_wait_s=5.0)
    results: list = []
    with client:
        wait_until(lambda: client.get("/ready").status_code == 200, what="/ready")
        first = _in_background(client, LONG, results)
        wait_until(lambda: _counts(engine) == (1, 0), what="one running")
        second = _in_background(client, {**LONG, "stream": True}, results)
        wait_until(lambda: _counts(engine) == (1, 1), what="one waiting")
        clock.skipped_s = 10.0  # the waiting request is now 10 s old; the running one keeps going
        second.join(60)
        first.join(60)
        refused, done = (results[0], results[1]) if results[0].status_code == 429 else (results[1], results[0])
        assert refused.status_code == 429 and "max_queue_wait_s=5" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"]
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 400
    wait_until(lambda: all_blocks_free(engine), what="every block free")


@pytest.mark.parametrize("extra, headers, lane", [
    ({}, {}, 2),  # 12 prompt tokens: background by the configured length threshold
    ({}, {"x-priority": "interactive"}, 0),  # the header (or the gateway, from the API key) says otherwise
    ({"priority": 1}, {"x-priority": "interactive"}, 1),  # the body's own priority comes first
])
def test_the_lane_comes_from_priority_header_or_configured_length(serve, extra, headers, lane):
    thresholds = {"interactive_max_prompt_tokens": 4, "background_min_prompt_tokens": 10}
    client, engine = serve(scheduling="multilevel", lanes=thresholds)
    results: list = []
    body = {**LONG, "prompt": [5, 6, 7] * 4, **extra}
    with client:
        wait_until(lambda: client.get("/ready").status_code == 200, what="/ready")
        thread = threading.Thread(target=lambda: results.append(
            client.post("/v1/completions", json=body, headers=headers)))
        thread.start()
        wait_until(lambda: _counts(engine) == (1, 0), what="the request running")
        assert engine.engine.scheduler.running[0].priority == lane
        thread.join(60)
        assert results[0].status_code == 200
    wait_until(lambda: all_blocks_free(engine), what="every block free")
