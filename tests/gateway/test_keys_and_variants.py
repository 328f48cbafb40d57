"""API keys beyond access: a default lane, a tenant class that picks a model's variant, requests/min and
tokens/min limits (429 with Retry-After). And the context-window fallback."""

from __future__ import annotations

import asyncio

import pytest

from gateway.auth_keys import ApiKey, parse_api_keys
from tests.gateway.fakes import REGISTRY, FakeGateway, chat, error_of


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


KEYS = {
    "batch": ApiKey(priority="background"),
    "staff": ApiKey(tenant="internal"),
    "metered": ApiKey(requests_per_minute=2),
    "tokens": ApiKey(tokens_per_minute=6),
    "tokens10": ApiKey(tokens_per_minute=10),
}
VARIANTS = REGISTRY.replace("    fallbacks: [beta]\n", "    fallbacks: [beta]\n    variants: {internal: beta}\n")


def test_a_keys_lane_reaches_the_replica_and_a_more_urgent_ask_does_not(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        await gw.client.post("/v1/chat/completions", json=chat(), headers=bearer("batch"))
        await gw.client.post("/v1/chat/completions", json=chat(), headers={**bearer("batch"), "x-priority": "0"})
        await gw.client.post("/v1/chat/completions", json=chat(), headers=bearer("staff"))
        sent = [r.headers.get("x-priority") for r in gw.replicas.received]
        assert sent == ["2", "2", None]  # (more in test_lanes.py)

    with_gateway(scenario, api_keys=KEYS)


def test_a_tenant_class_is_routed_to_the_models_variant(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        internal = await gw.client.post("/v1/chat/completions", json=chat("a"), headers=bearer("staff"))
        assert internal.json()["replica"] == "fake-beta-0" and internal.json()["model"] == "beta"
        customer = await gw.client.post("/v1/chat/completions", json=chat("a"), headers=bearer("batch"))
        assert customer.json()["replica"].startswith("fake-alpha-")

    with_gateway(scenario, api_keys=KEYS, registry_text=VARIANTS)


def test_requests_per_minute_is_a_429_naming_the_limit(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        codes = [(await gw.client.post("/v1/chat/completions", json=chat(), headers=bearer("metered"))).status_code
                 for _ in range(2)]
        refused = await gw.client.post("/v1/chat/completions", json=chat(), headers=bearer("metered"))
        assert codes == [200, 200] and refused.status_code == 429
        assert refused.headers["retry-after"] == "30"  # 2 per minute: one every 30 s
        error = error_of(refused)
        assert error["code"] == "rate_limit_exceeded" and "requests_per_minute=2" in error["message"]
        assert len(gw.replicas.received) == 2  # the refused one never reached a replica
        other = await gw.client.post("/v1/chat/completions", json=chat(), headers=bearer("batch"))
        assert other.status_code == 200  # other keys are not affected

    with_gateway(scenario, api_keys=KEYS)


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_per_minute_reserves_before_and_charges_the_replys_usage(with_gateway, stream):
    async def scenario(gw: FakeGateway) -> None:
        # "hi" is 1 token + 4 for the message, plus max_tokens 1: 6 tokens reserved, all of the budget
        body = chat(max_tokens=1, **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}))
        first = await gw.client.post("/v1/chat/completions", json=body, headers=bearer("tokens"))
        assert first.status_code == 200  # the reply used 5 (its usage) or 3 + 4 chunks (prompt + content events)
        refused = await gw.client.post("/v1/chat/completions", json=body, headers=bearer("tokens"))
        assert refused.status_code == 429 and "tokens_per_minute=6" in error_of(refused)["message"]
        assert len(gw.replicas.received) == 1

    with_gateway(scenario, api_keys=KEYS)


def test_embeddings_are_charged_the_usage_their_replica_reports(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        body = {"model": "emb", "input": "a" * 20}  # estimated 5 tokens; the replica reports 2
        statuses = [(await gw.client.post("/v1/embeddings", json=body, headers=bearer("tokens10"))).status_code
                    for _ in range(3)]
        assert statuses == [200, 200, 200]  # 2 + 2 charged, so the third's 5 still fit the 10

    with_gateway(scenario, api_keys=KEYS)


def test_concurrent_requests_cannot_all_slip_under_the_token_limit(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "slow")
        body = chat(max_tokens=1)  # reserves 6 of the key's 10
        first = asyncio.create_task(gw.client.post("/v1/chat/completions", json=body, headers=bearer("tokens10")))
        while not gw.replicas.received:
            await asyncio.sleep(0.01)
        second = await gw.client.post("/v1/chat/completions", json=body, headers=bearer("tokens10"))
        assert second.status_code == 429  # the first one's reservation is still held
        assert second.headers["retry-after"] == "12"  # 2 more tokens at 10 per minute
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first

    with_gateway(scenario, api_keys=KEYS)


def test_a_stream_without_usage_is_charged_its_prompt_too(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        stream = chat(max_tokens=1, stream=True)  # no include_usage: 3 prompt tokens (header) + 4 content events
        assert (await gw.client.post("/v1/chat/completions", json=stream, headers=bearer("tokens10"))).status_code \
            == 200
        refused = await gw.client.post("/v1/chat/completions", json=chat(max_tokens=1), headers=bearer("tokens10"))
        assert refused.status_code == 429 and refused.headers["retry-after"] == "18"  # 10 - 7 = 3 left, 6 needed

    with_gateway(scenario, api_keys=KEYS)


def test_a_request_larger_than_the_whole_budget_is_refused_outright(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        refused = await gw.client.post("/v1/chat/completions", json=chat(max_tokens=100), headers=bearer("tokens"))
        assert refused.status_code == 429
        assert "needs an estimated 105 tokens" in error_of(refused)["message"] and not gw.replicas.received

    with_gateway(scenario, api_keys=KEYS)


@pytest.mark.parametrize("raw, expected", [
    ('{"a": "*"}', {"a": ApiKey()}),
    ('{"a": ["m1"]}', {"a": ApiKey(models=frozenset({"m1"}))}),
    ('{"a": {"models": "*", "priority": 2, "tenant": "internal", "requests_per_minute": 5}}',
     {"a": ApiKey(priority=2, tenant="internal", requests_per_minute=5)}),
    ('{"a": {"lanes": ["Normal", 2, "background"], "priority": "normal"}}',
     {"a": ApiKey(priority="normal", lanes=frozenset({1, 2}))}),
])
def test_api_key_forms(raw, expected):
    assert parse_api_keys(raw) == expected


@pytest.mark.parametrize("raw, message", [
    ('{"a": {"requests_per_minute": 0}}', "API key #1: requests_per_minute: Input should be greater than or equal"),
    ('{"a": "*", "b": {"priority": "urgent"}}', "API key #2: priority: Value error, priority must be a number or"),
    ('{"a": {"model": ["x"]}}', "API key #1: model: Extra inputs are not permitted"),
    ('{"a": {"lanes": []}}', "API key #1: lanes: Value error, must be a non-empty list of lanes: interactive, "
                             "normal, background or 0-2"),
    ('{"a": {"lanes": "normal"}}', "API key #1: lanes: Value error, must be a non-empty list of lanes"),
    ('{"a": "*", "b": {"lanes": ["normal", "urgent"]}}', "API key #2: lanes: Value error, 'urgent' is not a lane"),
    ('{"a": {"lanes": [3]}}', "API key #1: lanes: Value error, 3 is not a lane: use interactive, normal, background"),
    ('{"a": {"lanes": [true]}}', "API key #1: lanes: Value error, True is not a lane"),
    ('{"a": {"priority": "interactive", "lanes": ["normal", "background"]}}',
     "API key #1: lanes: Value error, the key's priority (interactive) must be one of its lanes (normal, background)"),
    ('["a"]', "API keys must be a JSON object"),
])
def test_bad_api_keys_name_the_key_and_field(raw, message):
    with pytest.raises(ValueError) as err:
        parse_api_keys(raw)
    assert message in str(err.value)
    assert '"a"' not in str(err.value) or raw.startswith("[")  # the secret itself is never echoed


CONTEXT = REGISTRY.replace("    fallbacks: [beta]\n", "    fallbacks: [beta]\n    context_window_fallbacks: [beta]\n")


def test_a_context_overflow_is_retried_on_the_longer_context_model(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "context")
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 200 and response.json()["replica"] == "fake-beta-0"
        assert [r.host for r in gw.replicas.received][1:] == ["fake-beta-0"]  # one alpha try, no retry
        assert gw.metric("multiserve_gateway_failovers_total", model="alpha", fallback="beta") == 1

    with_gateway(scenario, registry_text=CONTEXT)


def test_without_a_context_fallback_the_400_passes_through(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "context")
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"
        assert len(gw.replicas.received) == 1

    with_gateway(scenario)
