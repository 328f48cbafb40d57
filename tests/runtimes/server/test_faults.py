"""One request's fault, through the replica app: that request gets a 500 with an error id marked as its own, the
replica stays ready, and every other request is served."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from foundation.http.wire import ERROR_SCOPE_HEADER
from tests.runtimes.server.conftest import SERVED_NAME, wait_until
from tests.runtimes.server.test_app import COMPLETIONS, metric_samples, sample, sse_events

POISON = [42, 42, 42, 42]  # a prompt the injected fault picks out
GOOD = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def poisoned(engine, monkeypatch):
    """The model runner raises for any batch holding a POISON request that has produced `after` tokens."""
    execute = engine.engine.runner.execute
    settings = {"after": 0}

    def faulty(plan, block_tables, interrupt=None):
        for item in plan.scheduled:
            request = item.request
            if request.prompt_token_ids[:4] == POISON and request.num_output_tokens >= settings["after"]:
                raise RuntimeError("injected fault")
        return execute(plan, block_tables, interrupt)

    monkeypatch.setattr(engine.engine.runner, "execute", faulty)
    return settings


def test_a_faulting_request_gets_a_500_of_its_own_and_the_replica_stays_ready(client, poisoned):
    response = client.post(COMPLETIONS, json={**GOOD, "prompt": POISON})
    assert response.status_code == 500 and response.headers[ERROR_SCOPE_HEADER] == "request"
    error = response.json()["error"]
    assert error["code"] == "request_failed" and "error id err-" in error["message"]
    assert sample(metric_samples(client), "multiserve_request_success_total", finish_reason="error") == 1
    assert client.get("/ready").status_code == 200
    assert client.post(COMPLETIONS, json=GOOD).json()["usage"]["completion_tokens"] == 4


def test_a_fault_midway_through_a_stream_ends_it_with_an_error_event(client, poisoned):
    poisoned["after"] = 2
    response = client.post(COMPLETIONS, json={**GOOD, "prompt": POISON, "max_tokens": 8, "stream": True})
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_failed"
    text_events = [e for e in events[:-2] if isinstance(e, dict) and "choices" in e]
    assert len(text_events) == 2  # the tokens before the fault went out
    assert client.get("/ready").status_code == 200


def test_an_unexpected_error_in_a_handler_is_the_requests_own(engine, make_app, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(engine.engine.tokenizer, "apply_chat_template", broken)
    with TestClient(make_app(), raise_server_exceptions=False) as client:
        wait_until(lambda: client.get("/ready").status_code == 200, what="/ready")
        response = client.post("/v1/chat/completions", json={"model": SERVED_NAME,
                                                              "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 500 and response.headers[ERROR_SCOPE_HEADER] == "request"
        assert "a bug" not in json.dumps(response.json())  # details stay in the log
        assert client.post(COMPLETIONS, json=GOOD).status_code == 200


def test_an_engine_loop_stuck_in_a_step_makes_the_replica_unready_until_it_moves(client, engine, monkeypatch):
    import threading
    import time

    release = threading.Event()
    execute = engine.engine.runner.execute

    def stuck(plan, block_tables, interrupt=None):
        release.wait(10)  # a hung kernel, until the test lets it go
        return execute(plan, block_tables, interrupt)

    client.app.state.replica.stall_timeout_s = 0.2
    monkeypatch.setattr(engine.engine.runner, "execute", stuck)
    replies: list[int] = []
    worker = threading.Thread(target=lambda: replies.append(client.post(COMPLETIONS, json=GOOD).status_code))
    worker.start()
    wait_until(lambda: client.get("/ready").status_code == 503, what="/ready to notice the stall")
    ready = client.get("/ready").json()
    assert ready["reason"].startswith("stalled: the engine loop has made no progress") and "limit 0.2 s" in \
        ready["reason"]
    refused = client.post(COMPLETIONS, json=GOOD)
    assert refused.status_code == 503 and "stalled" in refused.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # alive: the pool decides when to restart it
    release.set()
    worker.join(10)
    assert replies == [200]
    wait_until(lambda: client.get("/ready").status_code == 200, what="/ready once the loop moves again")
    time.sleep(0.3)  # an idle loop keeps showing progress
    assert client.get("/ready").status_code == 200
