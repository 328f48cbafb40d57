"""Forwarding: resolve the model, pick a replica, retry elsewhere, fall back, stream through, map errors."""

from __future__ import annotations

import json

import httpx
import pytest

from model_pool.health import BreakerConfig, BreakerState
from model_pool.pool import PoolSettings
from tests.gateway.fakes import NUM_STREAM_CHUNKS, REGISTRY, FakeGateway, Received, chat, error_of

ONE_FAILURE_OPENS = PoolSettings(breaker=BreakerConfig(failure_threshold=1, cooldown_s=60.0))


def events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [block.removeprefix("data: ") for block in response.text.split("\n\n") if block]


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["replica"]


# ------------------------------------------------------------------------------------ resolving


def test_routes_by_name_and_by_alias(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        assert served_by(await gw.client.post("/v1/chat/completions", json=chat("alpha"))).startswith("fake-alpha-")
        by_alias = await gw.client.post("/v1/chat/completions", json=chat("a"))
        assert served_by(by_alias).startswith("fake-alpha-")
        assert by_alias.json()["model"] == "alpha"  # the replica is asked for the model's own name
        assert served_by(await gw.client.post("/v1/chat/completions", json=chat("beta"))) == "fake-beta-0"
        sent = chat("beta", temperature=0.5, top_k=3)
        await gw.client.post("/v1/chat/completions", json=sent)
        assert gw.replicas.received[-1].body == sent  # passed through as the client wrote it

    with_gateway(scenario)


def test_structured_output_and_other_fields_the_gateway_does_not_read_reach_the_replica_unchanged(with_gateway):
    """The replica decides what these fields mean (and refuses those it does not know); the gateway must neither
    drop nor alter them, also when it rewrites the body to ask for the model's own name."""
    schema = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}
    json_schema = {"name": "r", "schema": schema, "strict": True}
    fields = {"response_format": {"type": "json_schema", "json_schema": json_schema},
              "structured_outputs": {"choice": ["yes", "no"]}, "guided_regex": "[a-z]+", "guided_choice": ["a"],
              "guided_json": '{"type": "string"}', "guided_grammar": 'root ::= "x"',
              "guided_decoding_backend": "xgrammar", "metadata": {"k": "v"}, "store": False,
              "service_tier": "auto", "unknown_to_everyone": [1, {"b": None}]}

    async def scenario(gw: FakeGateway) -> None:
        for model in ("beta", "a"):  # by name the bytes as sent; by alias re-encoded with the served name
            sent = chat(model, **fields)
            assert (await gw.client.post("/v1/chat/completions", json=sent)).status_code == 200
            assert gw.replicas.received[-1].body == {**sent, "model": "beta" if model == "beta" else "alpha"}
        sent = {"model": "comp", "prompt": "hi", **fields}
        assert (await gw.client.post("/v1/completions", json=sent)).status_code == 200
        assert gw.replicas.received[-1].body == sent

    with_gateway(scenario)


def test_each_endpoint_reaches_the_models_that_serve_it(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        completion = await gw.client.post("/v1/completions", json={"model": "comp", "prompt": "hi"})
        assert served_by(completion) == "fake-comp-0" and completion.json()["object"] == "text_completion"
        # a chat model also serves plain completions
        assert served_by(await gw.client.post("/v1/completions", json={"model": "a", "prompt": "hi"})
                         ).startswith("fake-alpha-")
        embedding = await gw.client.post("/v1/embeddings", json={"model": "emb", "input": "hi"})
        assert served_by(embedding) == "fake-emb-0"
        assert [r.path for r in gw.replicas.received] == ["/v1/completions", "/v1/completions", "/v1/embeddings"]

    with_gateway(scenario)


def test_least_outstanding_spreads_sequential_requests_over_the_group(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        for _ in range(6):
            await gw.client.post("/v1/chat/completions", json=chat())
        assert gw.replicas.count("alpha/0") == gw.replicas.count("alpha/1") == 3

    with_gateway(scenario)


def test_unknown_model_is_404_listing_the_available_ones(with_gateway):
    disabled = REGISTRY + "\n  - name: retired\n    type: chat\n    source: {path: /m/r.gguf}\n    enabled: false\n"

    async def scenario(gw: FakeGateway) -> None:
        for name in ("gpt-9", "retired"):  # a disabled model is as good as absent
            response = await gw.client.post("/v1/chat/completions", json=chat(name))
            assert response.status_code == 404
            error = error_of(response)
            assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model",
                                                                      "invalid_request_error")
            assert repr(name) in error["message"]
            assert error["message"].endswith("available: a, alpha, beta, comp, emb")
        assert gw.replicas.received == []

    with_gateway(scenario, registry_text=disabled)


@pytest.mark.parametrize(("path", "body", "fits"), [
    ("/v1/chat/completions", chat("emb"), "use /v1/embeddings"),
    ("/v1/completions", {"model": "emb", "prompt": "x"}, "use /v1/embeddings"),
    ("/v1/embeddings", {"model": "alpha", "input": "x"}, "use /v1/chat/completions or /v1/completions"),
    ("/v1/embeddings", {"model": "a", "input": "x"}, "use /v1/chat/completions or /v1/completions"),
    ("/v1/chat/completions", chat("comp"), "use /v1/completions"),
])
def test_a_model_on_the_wrong_endpoint_is_400_naming_the_one_that_fits(with_gateway, path, body, fits):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.post(path, json=body)
        assert response.status_code == 400
        error = error_of(response)
        assert error["code"] == "wrong_endpoint" and error["param"] == "model"
        assert error["message"].endswith(fits)
        assert gw.replicas.received == []

    with_gateway(scenario)


@pytest.mark.parametrize("body", [{"messages": []}, {"model": "", "messages": []}, {"model": 5, "messages": []}])
def test_a_missing_model_field_is_400(with_gateway, body):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400
        error = error_of(response)
        assert error["param"] == "model" and error["message"].startswith("model:")
        assert error["type"] == "invalid_request_error"

    with_gateway(scenario)


@pytest.mark.parametrize(("content", "says"), [
    (b'{"model": "alpha", ', "not valid JSON"),
    (b"\xff\xfe", "must be UTF-8"),
    (b'["alpha"]', "must be a JSON object"),
])
def test_a_body_that_is_not_a_json_object_is_400(with_gateway, content, says):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.post("/v1/chat/completions", content=content,
                                        headers={"content-type": "application/json"})
        assert response.status_code == 400
        error = error_of(response)
        assert error["code"] == "invalid_json" and says in error["message"]
        assert error["type"] == "invalid_request_error"

    with_gateway(scenario)


# ------------------------------------------------------------------------------------ retries and failover


@pytest.mark.parametrize("behaviour", ["down", "error500", "hang"])
def test_a_failing_replica_is_retried_on_the_other(with_gateway, behaviour):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("alpha/0", behaviour)
        served = {served_by(await gw.client.post("/v1/chat/completions", json=chat())) for _ in range(3)}
        assert served == {"fake-alpha-1"}
        assert gw.replicas.count("alpha/0") == 1  # tried once; its breaker then kept it out
        assert gw.pool.find_replica("alpha/0").breaker.state == BreakerState.OPEN
        assert gw.metric("multiserve_gateway_retries_total", model="alpha") == 1
        assert gw.proxy_sleep.delays == [pytest.approx(0.05)]  # the backoff went through the injected sleep
        assert gw.metric("multiserve_gateway_requests_total", model="alpha", endpoint="chat", status="200") == 3

    with_gateway(scenario, pool_settings=ONE_FAILURE_OPENS)


def test_a_stream_that_fails_before_its_first_byte_is_retried(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("alpha/1", "break_at_start")
        response = await gw.client.post("/v1/chat/completions", json=chat(stream=True))
        assert response.status_code == 200
        assert {json.loads(e)["replica"] for e in events(response)[:-1]} == {"fake-alpha-0"}
        assert events(response)[-1] == "[DONE]"
        assert gw.replicas.count("alpha/1") == 1
        assert gw.metric("multiserve_gateway_retries_total", model="alpha") == 1

    with_gateway(scenario)


def test_when_every_replica_of_a_model_fails_its_fallback_serves(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("alpha/0", "down")
        gw.replicas.set("alpha/1", "error500")
        response = await gw.client.post("/v1/chat/completions", json=chat("a"))
        assert served_by(response) == "fake-beta-0"
        assert response.json()["model"] == "beta"  # the fallback is asked for by its own name
        assert gw.replicas.count("alpha/0") == gw.replicas.count("alpha/1") == 1
        assert gw.metric("multiserve_gateway_failovers_total", model="alpha", fallback="beta") == 1
        assert gw.metric("multiserve_gateway_requests_total", model="alpha", endpoint="chat", status="200") == 1
        # one re-send (alpha/0 -> alpha/1), one backoff; none once the group had no replica left to try
        assert gw.metric("multiserve_gateway_retries_total", model="alpha") == 1
        assert len(gw.proxy_sleep.delays) == 1

    with_gateway(scenario)


def test_when_everything_fails_the_answer_is_503_with_retry_after(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1", "beta/0"], "down")
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        error = error_of(response)
        assert error["code"] == "no_ready_replica" and "fallbacks tried: beta" in error["message"]
        assert error["type"] == "service_unavailable_error"
        assert gw.metric("multiserve_gateway_requests_total", model="alpha", endpoint="chat", status="503") == 1
        assert set(gw.outstanding().values()) == {0}

    with_gateway(scenario)


def test_a_model_with_no_ready_replica_is_503_without_contacting_anyone(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.post("/v1/completions", json={"model": "comp", "prompt": "hi"})
        assert response.status_code == 503 and "retry-after" in response.headers
        assert gw.replicas.received == []

    with_gateway(scenario, ready=False)


def test_when_every_replica_times_out_the_answer_is_504(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1", "beta/0"], "hang")
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 504
        error = error_of(response)
        assert error["code"] == "upstream_timeout" and error["type"] == "timeout_error"
        assert "did not answer within" in error["message"]
        assert gw.replicas.count("beta/0") == 1  # the fallback was tried too
        assert "retry-after" not in response.headers

    with_gateway(scenario)


def test_a_client_error_from_the_replica_is_passed_through_without_retry(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1", "beta/0"], "error400")
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 400 and error_of(response)["param"] == "max_tokens"
        assert len(gw.replicas.received) == 1
        assert gw.metric("multiserve_gateway_retries_total", model="alpha") == 0
        assert gw.metric("multiserve_gateway_requests_total", model="alpha", endpoint="chat", status="400") == 1
        assert {r.breaker.state for r in gw.pool.group("alpha").replicas} == {BreakerState.CLOSED}

    with_gateway(scenario, pool_settings=ONE_FAILURE_OPENS)


# ------------------------------------------------------------------------------------ streaming


def test_a_stream_is_passed_through_whole_and_in_order(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.post("/v1/chat/completions", json=chat(stream=True))
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = events(response)
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert [c["choices"][0]["delta"]["content"] for c in chunks] == [f"tok{i}" for i in range(NUM_STREAM_CHUNKS)]
        assert len({c["replica"] for c in chunks}) == 1
        assert gw.replicas.streams[-1].closed  # the upstream reply was released
        assert gw.pool.find_replica("alpha/0").breaker.state == BreakerState.CLOSED

    with_gateway(scenario)


def test_a_stream_that_cannot_resume_and_breaks_midway_ends_with_an_error_event_and_done(with_gateway):
    """n > 1 streams are not resumed (gateway/resume.py follows one choice): a break ends them in-band."""

    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "break_midstream")
        response = await gw.client.post("/v1/chat/completions", json=chat(stream=True, n=2))
        assert response.status_code == 200  # the headers went out before the break
        payloads = events(response)
        assert [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads[:2]] == ["tok0", "tok1"]
        error = json.loads(payloads[2])["error"]
        assert error["code"] == "stream_interrupted" and "incomplete" in error["message"]
        assert payloads[3:] == ["[DONE]"]
        broken = gw.replicas.received[-1].host.removeprefix("fake-").replace("-", "/")
        assert gw.pool.find_replica(broken).breaker.state == BreakerState.OPEN
        assert len(gw.replicas.received) == 1  # bytes had reached the client: no retry
        assert gw.replicas.streams[-1].closed

    with_gateway(scenario, pool_settings=ONE_FAILURE_OPENS)


def test_outstanding_counts_requests_in_flight_and_returns_to_zero(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        in_flight: list[dict[str, int]] = []

        def note(received: Received) -> None:
            in_flight.append(gw.outstanding())

        gw.replicas.on_request = note
        gw.replicas.set("alpha/1", "break_midstream")
        await gw.client.post("/v1/chat/completions", json=chat())
        await gw.client.post("/v1/chat/completions", json=chat(stream=True))
        await gw.client.post("/v1/chat/completions", json=chat(stream=True))
        gw.replicas.set("alpha/0", "down")
        gw.replicas.set("alpha/1", "down")
        await gw.client.post("/v1/chat/completions", json=chat())
        assert [sum(counts.values()) for counts in in_flight] == [1] * len(in_flight)
        hosts = [r.host for r in gw.replicas.received]
        # 3 served (what broke off on alpha/1 resumed on alpha/0: one more each) + what the last one tried
        assert len(in_flight) == len(hosts) and hosts[-1] == "fake-beta-0"
        assert hosts[:6] == ["fake-alpha-1", "fake-alpha-0"] * 3, hosts
        assert set(gw.outstanding().values()) == {0}

    with_gateway(scenario)
