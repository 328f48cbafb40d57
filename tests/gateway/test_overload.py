"""Overload and deadlines at the gateway: a replica's 429 sends the request to another replica or a fallback,
a model whose replicas are all full answers 429 with Retry-After; `request_timeout_s` ends a request with 504
and aborts it upstream. Keyed routing: prefix affinity and sessions."""

from __future__ import annotations

import json
import time
from collections import Counter

from model_pool.health import BreakerState
from tests.gateway.fakes import REGISTRY, FakeGateway, chat, error_of


def _with_alpha_policy(policy: str) -> str:
    return REGISTRY.replace("    fallbacks: [beta]\n", f"    fallbacks: [beta]\n    policy: {policy}\n")


def test_a_full_replica_passes_the_request_to_another_without_backoff(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("alpha/0", "overloaded")
        for _ in range(4):
            response = await gw.client.post("/v1/chat/completions", json=chat())
            assert response.json()["replica"] == "fake-alpha-1"
        assert set(gw.proxy_sleep.delays) <= {0.0}  # no backoff before trying a replica with room
        assert {r.breaker.state for r in gw.pool.group("alpha").replicas} == {BreakerState.CLOSED}
        assert set(gw.outstanding().values()) == {0}

    with_gateway(scenario)


def test_an_overloaded_model_falls_back_then_answers_429_with_retry_after(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "overloaded")
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.json()["replica"] == "fake-beta-0"  # fallbacks also take overflow
        gw.replicas.set("beta/0", "overloaded")
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 429 and response.headers["retry-after"] == "7"
        error = error_of(response)
        assert error["code"] == "overloaded" and error["type"] == "rate_limit_error"
        assert "'alpha' is overloaded" in error["message"] and "fallbacks tried: beta" in error["message"]
        assert gw.metric("multiserve_gateway_requests_total", model="alpha", endpoint="chat", status="429") == 1

    with_gateway(scenario)


def test_request_timeout_is_504_and_aborts_the_upstream_request(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1", "beta/0"], "slow")
        started = time.monotonic()
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert time.monotonic() - started < 5  # not the replica's 30 s
        assert response.status_code == 504
        error = error_of(response)
        assert error["code"] == "request_timeout" and "request_timeout_s=0.3" in error["message"]
        assert sum(gw.replicas.cancelled.values()) == 1  # the replica's request was given up, not left running
        assert set(gw.outstanding().values()) == {0}

    with_gateway(scenario, registry_text=_with_alpha_policy("{request_timeout_s: 0.3}"))


def test_a_stream_past_its_deadline_ends_with_a_504_event_and_closes_upstream(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "stall_midstream")
        response = await gw.client.post("/v1/chat/completions", json=chat(stream=True))
        assert response.status_code == 200  # the headers left before the deadline
        blocks = [b.removeprefix("data: ") for b in response.text.split("\n\n") if b]
        assert len(blocks) == 4 and blocks[-1] == "[DONE]"  # two content chunks, the error event, DONE
        assert json.loads(blocks[2])["error"]["code"] == "request_timeout"
        assert all(stream.closed for stream in gw.replicas.streams)
        assert set(gw.outstanding().values()) == {0}

    with_gateway(scenario, registry_text=_with_alpha_policy("{request_timeout_s: 0.3}"))


def _document(i: int) -> str:
    return f"Document {i}: " + "the quarterly report says revenue grew. " * 20


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        homes: dict[int, set[str]] = {}
        for question in range(3):
            for doc in range(8):
                body = {"model": "alpha", "prompt": _document(doc) + f"Question {question}?", "max_tokens": 4}
                response = await gw.client.post("/v1/completions", json=body)
                homes.setdefault(doc, set()).add(response.json()["replica"])
        assert all(len(replicas) == 1 for replicas in homes.values())  # each document stays where its KV is
        assert len({next(iter(r)) for r in homes.values()}) == 2  # and the documents use both replicas
        messages = [{"role": "system", "content": _document(0)}, {"role": "user", "content": "hi"}]
        first = await gw.client.post("/v1/chat/completions", json=chat(messages=messages))
        second = await gw.client.post("/v1/chat/completions", json=chat(messages=[*messages[:1], {
            "role": "user", "content": "something else"}]))
        assert first.json()["replica"] == second.json()["replica"]

    with_gateway(scenario, registry_text=_with_alpha_policy("{routing: prefix_affinity, prefix_chars: 200}"))


def test_session_routing_follows_the_header(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        seen: dict[str, Counter[str]] = {}
        for _turn in range(3):
            for user in ("ann", "bob", "cy", "dee", "eve"):
                response = await gw.client.post("/v1/chat/completions", json=chat(),
                                                headers={"x-user": user})
                seen.setdefault(user, Counter())[response.json()["replica"]] += 1
        assert all(len(replicas) == 1 for replicas in seen.values())
        gw.replicas.set("alpha/0", "down")  # a session's replica gone: it moves, it is not refused
        for user in seen:
            response = await gw.client.post("/v1/chat/completions", json=chat(), headers={"x-user": user})
            assert response.json()["replica"] == "fake-alpha-1"

    with_gateway(scenario, registry_text=_with_alpha_policy("{routing: session, session_header: x-user}"))
