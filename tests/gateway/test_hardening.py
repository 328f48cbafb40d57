"""The gateway as a public entry: hostile bodies get a 400, a request's own fault is not the replica's, a stalled
reply is a 504, and a client that leaves stops its request upstream."""

from __future__ import annotations

import asyncio
import json

import pytest

from model_pool.health import BreakerState
from tests.gateway.fakes import REGISTRY, FakeGateway, chat, error_of
from tests.gateway.test_proxy import ONE_FAILURE_OPENS

BIG_BODIES = REGISTRY.replace("max_body_bytes: 2048", "max_body_bytes: 1048576")  # let these bodies in
NESTED = b'{"model": "alpha", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize(("content", "says"), [
    (NESTED, "deeper than 128 levels"),  # deeper than the parser's own recursion
    (b'{"model": "alpha", "x": ' + b"[" * 200 + b"]" * 200 + b"}", "deeper than 128 levels"),
    (b'{"model": "alpha", "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"model": "alpha", "temperature": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"model": "alpha", "temperature": 1e999}', "the number 1e999 is too large"),
    (b'{"model": "alpha", "seed": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    (b'{"model": "alpha", "messages": "\xff\xfe"}', "must be UTF-8"),
    ('{"model": "alpha", "messages": []}'.encode("utf-16"), "must be UTF-8"),  # json.loads alone would take these
    ('{"model": "alpha", "messages": []}'.encode("utf-32"), "must be UTF-8"),
    ('{"model": "alpha", "messages": []}'.encode("utf-16-le"), "not valid JSON"),  # valid UTF-8, full of NULs
    (b"[1, 2, 3]", "must be a JSON object"),
    (b'"a string"', "must be a JSON object"),
    (b"null", "must be a JSON object"),
])
def test_hostile_bodies_are_400_at_the_gateway_and_never_reach_a_replica(with_gateway, content, says):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.post("/v1/chat/completions", content=content)
        assert response.status_code == 400, response.text
        error = error_of(response)
        assert error["code"] == "invalid_json" and says in error["message"], error
        assert not gw.replicas.received

    with_gateway(scenario, registry_text=BIG_BODIES)


def test_a_500_a_request_caused_is_passed_through_and_not_held_against_the_replica(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1", "beta/0"], "request_fault")
        for _ in range(5):
            response = await gw.client.post("/v1/chat/completions", json=chat())
            assert response.status_code == 500 and error_of(response)["code"] == "request_failed"
        assert len(gw.replicas.received) == 5  # never retried elsewhere: it would fail there too
        assert gw.metric("multiserve_gateway_retries_total", model="alpha") == 0
        assert {r.breaker.state for r in gw.pool.group("alpha").replicas} == {BreakerState.CLOSED}
        gw.replicas.set_all(["alpha/0", "alpha/1"], "ok")
        assert (await gw.client.post("/v1/chat/completions", json=chat())).status_code == 200

    with_gateway(scenario, pool_settings=ONE_FAILURE_OPENS)


def test_a_reply_whose_body_stalls_is_a_504(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1", "beta/0"], "timeout_midbody")
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 504, response.text
        assert error_of(response)["code"] == "upstream_timeout"

    with_gateway(scenario)


def test_a_client_that_leaves_cancels_its_request_upstream(with_gateway):
    """The replica is slow to answer; the client goes away meanwhile: the gateway stops waiting at once and lets
    go of the replica (which sees its connection close and aborts)."""
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "slow")
        task = asyncio.create_task(gw.client.post("/v1/chat/completions", json=chat()))
        while not gw.replicas.received:
            await asyncio.sleep(0.01)
        task.cancel()  # httpx's ASGI transport tells the app `http.disconnect`
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if sum(gw.replicas.cancelled.values()) == 1:
                break
            await asyncio.sleep(0.01)
        assert sum(gw.replicas.cancelled.values()) == 1
        assert all(r.outstanding == 0 for r in gw.pool.group("alpha").replicas)

    with_gateway(scenario)


def test_non_finite_numbers_never_leave_the_gateway():
    from gateway.request_body import parse_json_object

    payload = parse_json_object(b'{"model": "m", "temperature": 1.5, "seed": 12345678901234567890}')
    assert json.loads(json.dumps(payload)) == payload  # re-encodable as strict JSON for a fallback model
