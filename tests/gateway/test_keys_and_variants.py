"""API keys beyond access: a default lane, a tenant class that picks a model's variant, requests/min and
tokens/min limits (429 with Retry-After). And the context-window fallback."""

from __future__ import annotations

import pytest

from gateway.middleware import ApiKey, parse_api_keys
from tests.gateway.fakes import REGISTRY, FakeGateway, chat, error_of


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


KEYS = {
    "batch": ApiKey(priority="background"),
    "staff": ApiKey(tenant="internal"),
    "metered": ApiKey(requests_per_minute=2),
    "tokens": ApiKey(tokens_per_minute=6),
}
VARIANTS = REGISTRY.replace("    fallbacks: [beta]\n", "    fallbacks: [beta]\n    variants: {internal: beta}\n")


def test_a_keys_default_lane_reaches_the_replica_unless_the_request_names_one(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        await gw.client.post("/v1/chat/completions", json=chat(), headers=bearer("batch"))
        await gw.client.post("/v1/chat/completions", json=chat(), headers={**bearer("batch"), "x-priority": "0"})
        await gw.client.post("/v1/chat/completions", json=chat(), headers=bearer("staff"))
        sent = [r.headers.get("x-priority") for r in gw.replicas.received]
        assert sent == ["background", "0", None]

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
def test_tokens_per_minute_is_charged_from_the_replys_usage(with_gateway, stream):
    async def scenario(gw: FakeGateway) -> None:
        body = chat(stream=stream, stream_options={"include_usage": True}) if stream else chat()
        first = await gw.client.post("/v1/chat/completions", json=body, headers=bearer("tokens"))
        assert first.status_code == 200  # the budget of 6 was full; this reply used 5 (fake usage) or 4 chunks
        second = await gw.client.post("/v1/chat/completions", json=body, headers=bearer("tokens"))
        assert second.status_code == 200  # 1-2 tokens left: still admitted, now in debt
        refused = await gw.client.post("/v1/chat/completions", json=body, headers=bearer("tokens"))
        assert refused.status_code == 429 and "tokens_per_minute=6" in error_of(refused)["message"]

    with_gateway(scenario, api_keys=KEYS)


@pytest.mark.parametrize("raw, expected", [
    ('{"a": "*"}', {"a": ApiKey()}),
    ('{"a": ["m1"]}', {"a": ApiKey(models=frozenset({"m1"}))}),
    ('{"a": {"models": "*", "priority": 2, "tenant": "internal", "requests_per_minute": 5}}',
     {"a": ApiKey(priority=2, tenant="internal", requests_per_minute=5)}),
])
def test_api_key_forms(raw, expected):
    assert parse_api_keys(raw) == expected


@pytest.mark.parametrize("raw, message", [
    ('{"a": {"requests_per_minute": 0}}', "API key #1: requests_per_minute: Input should be greater than or equal"),
    ('{"a": "*", "b": {"priority": "urgent"}}', "API key #2: priority: Value error, priority must be a number or"),
    ('{"a": {"model": ["x"]}}', "API key #1: model: Extra inputs are not permitted"),
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
