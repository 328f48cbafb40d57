"""The per-replica app in process over a tiny model: endpoints, streaming, errors, readiness, metrics."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from tests.runtimes.server.conftest import ALIAS, SERVED_NAME, all_blocks_free, wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hello there"}]


def sse_events(text: str) -> list[dict | str]:
    """The `data:` payloads of an SSE body, JSON-decoded except the final `[DONE]`."""
    events: list[dict | str] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def metric_samples(client: TestClient) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": SERVED_NAME, **labels}.items()))), 0.0)


# ---------------------------------------------------------------------------------------------- happy paths


def test_completion_non_stream(client):
    response = client.post(COMPLETIONS, json={"model": SERVED_NAME, "prompt": "hello", "max_tokens": 6,
                                              "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == SERVED_NAME
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def test_chat_non_stream_via_alias(client):
    response = client.post(CHAT, json={"model": ALIAS, "messages": USER, "max_tokens": 5, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == ALIAS
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] > 5  # template added


def test_completion_stream_usage_matches_streamed_tokens(client):
    response = client.post(COMPLETIONS, json={
        "model": SERVED_NAME, "prompt": [5, 6, 7], "max_tokens": 7, "ignore_eos": True, "logprobs": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    *chunks, usage, done = sse_events(response.text)
    assert done == "[DONE]"
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 7 == len(chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 6 + ["length"]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 7,
                                                         "total_tokens": 10}
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))


def test_chat_stream_shape_and_usage(client):
    response = client.post(CHAT, json={"model": SERVED_NAME, "messages": USER, "max_tokens": 6, "ignore_eos": True,
                                       "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    *chunks, usage, done = sse_events(response.text)
    assert done == "[DONE]" and usage["choices"] == []
    openers = chunks[:2]
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in openers] == [
        (0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""})]
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks[2:] if c["choices"][0]["index"] == index]
        assert len(deltas) == 6 and all(set(d["delta"]) == {"content"} for d in deltas)
        assert [d["finish_reason"] for d in deltas] == [None] * 5 + ["length"]
    assert usage["usage"]["completion_tokens"] == 12 == len(chunks) - 2
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_chat_stream_without_usage_ends_with_done(client):
    response = client.post(CHAT, json={"model": SERVED_NAME, "messages": USER, "max_tokens": 2, "stream": True})
    *chunks, done = sse_events(response.text)
    assert done == "[DONE]" and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_n_choices_and_seeded_reproducibility(client):
    request = {"model": SERVED_NAME, "prompt": "abc", "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 11,
               "ignore_eos": True}
    first = client.post(COMPLETIONS, json=request).json()
    second = client.post(COMPLETIONS, json=request).json()
    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in second["choices"]]
    assert first["usage"]["completion_tokens"] == 16
    other = client.post(COMPLETIONS, json={**request, "seed": 12, "n": 1}).json()
    assert other["choices"][0]["text"] != first["choices"][0]["text"]


def test_completion_logprobs_shape(client):
    body = client.post(COMPLETIONS, json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 4,
                                          "ignore_eos": True, "logprobs": 3}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(1 <= len(top) <= 4 for top in logprobs["top_logprobs"])  # 3 best, plus the sampled one


def test_chat_logprobs_shape(client):
    body = client.post(CHAT, json={"model": SERVED_NAME, "messages": USER, "max_tokens": 3, "ignore_eos": True,
                                   "logprobs": True, "top_logprobs": 2, "temperature": 0}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(entry["bytes"], list) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2 and set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])  # greedy takes the best


def test_stop_string_ends_the_choice(client):
    greedy = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = client.post(COMPLETIONS, json=greedy).json()["choices"][0]["text"]
    cut = next(i for i, ch in enumerate(text) if i > 0 and ch.isascii() and ch.isalnum())  # this model: "ӽmmm…"
    stopped = client.post(COMPLETIONS, json={**greedy, "stop": text[cut]}).json()["choices"][0]
    assert (stopped["text"], stopped["finish_reason"], stopped["stop_reason"]) == (text[:cut], "stop", text[cut])


def test_models_lists_name_and_aliases(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [SERVED_NAME, ALIAS]
    assert all(m["object"] == "model" and m["root"] == SERVED_NAME and m["max_model_len"] == 512
               for m in body["data"])


def test_health(client):
    assert client.get("/health").json() == {"status": "ok"}


# ---------------------------------------------------------------------------------------------- refusals

GOOD = {"model": SERVED_NAME, "prompt": "ok", "max_tokens": 2}


@pytest.mark.parametrize(("path", "body", "status", "param", "fragment"), [
    (COMPLETIONS, "{not json", 400, None, "not valid JSON"),
    (COMPLETIONS, "", 400, None, "not valid JSON"),
    (COMPLETIONS, "[1, 2]", 400, None, "Input should be an object"),
    (COMPLETIONS, {**GOOD, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    (COMPLETIONS, {**GOOD, "prompt": 5}, 400, "prompt", "must be a string"),
    (COMPLETIONS, {"prompt": "x"}, 400, "model", "Field required"),
    (COMPLETIONS, {**GOOD, "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    (COMPLETIONS, {**GOOD, "top_p": 0}, 400, "top_p", "greater than 0"),
    (COMPLETIONS, {**GOOD, "n": 1000}, 400, "n", "less than or equal to 16"),
    (COMPLETIONS, {**GOOD, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    (COMPLETIONS, {**GOOD, "max_tokens": 10**9}, 400, "max_tokens", "maximum context length is 512"),
    (COMPLETIONS, {**GOOD, "prompt": [7] * 600}, 400, "prompt", "maximum context length is 512"),
    (COMPLETIONS, {**GOOD, "prompt": "x" * 600}, 400, "prompt", "the prompt has 600 tokens"),
    (COMPLETIONS, {**GOOD, "prompt": [1, 300]}, 400, "prompt", "token id 300 is outside the vocabulary"),
    (COMPLETIONS, {**GOOD, "prompt": [-1]}, 400, "prompt", "outside the vocabulary"),
    (COMPLETIONS, {**GOOD, "prompt": ""}, 400, "prompt", "the prompt is empty"),
    (COMPLETIONS, {**GOOD, "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    (COMPLETIONS, {**GOOD, "echo": True}, 400, "echo", "echo is not supported"),
    (COMPLETIONS, {**GOOD, "stream": True, "max_tokens": 10**9}, 400, "max_tokens", "maximum context length"),
    (COMPLETIONS, {**GOOD, "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
    (COMPLETIONS, {**GOOD, "stop_token_ids": [999999999]}, 400, "stop_token_ids", "outside the vocabulary [0, 259)"),
    (COMPLETIONS, {**GOOD, "logit_bias": {"259": 1}}, 400, "logit_bias", "token id 259 is outside"),
    (COMPLETIONS, {**GOOD, "seed": 2**64}, 400, "seed", "less than or equal to 9223372036854775807"),
    (COMPLETIONS, {**GOOD, "min_tokens": 3}, 400, "min_tokens", "must not exceed max_tokens (2)"),
    (COMPLETIONS, {**GOOD, "prompt": [1] * 500, "max_tokens": None, "min_tokens": 20}, 400, "min_tokens",
     "exceeds the 12 tokens"),
    (CHAT, {"model": SERVED_NAME, "messages": USER, "functions": [{"name": "f"}]}, 400, "functions",
     "not supported"),
    (CHAT, {"model": SERVED_NAME, "messages": USER, "tool_choice": "auto"}, 400, "tool_choice", "only allowed"),
    (CHAT, {"model": SERVED_NAME, "messages": []}, 400, "messages", "at least 1 item"),
    (CHAT, {"model": SERVED_NAME, "messages": [{"content": "x"}]}, 400, "messages[0].role", "Field required"),
    (CHAT, {"model": SERVED_NAME, "messages": [{"role": "user"}]}, 400, "messages[0].content", "Field required"),
    (CHAT, {"model": SERVED_NAME, "messages": "hi"}, 400, "messages", "valid array"),
    (CHAT, {"model": SERVED_NAME, "messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "requires logprobs"),
    (CHAT, {"model": SERVED_NAME, "messages": [{"role": "user", "content": "x" * 600}], "max_tokens": 1}, 400,
     "prompt", "maximum context length is 512"),
    (CHAT, {"model": "nope", "messages": USER}, 404, "model", "does not exist"),
])
def test_bad_requests_are_refused_and_the_server_keeps_serving(client, path, body, status, param, fragment):
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    response = client.post(path, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and fragment in error["message"], error
    good = client.post(COMPLETIONS, json=GOOD)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("body", [{**GOOD, "max_tokens": 10**9}, {**GOOD, "prompt": [7] * 600}])
def test_a_context_overflow_carries_openais_code(client, body):
    """`context_length_exceeded` is what lets a gateway send the request to a model with a longer context."""
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert client.post(COMPLETIONS, json={**GOOD, "temperature": -1}).json()["error"]["code"] != \
        "context_length_exceeded"


def test_oversized_body_is_413(make_app):
    with TestClient(make_app(max_body_bytes=100)) as client:
        response = client.post(COMPLETIONS, json={**GOOD, "prompt": "x" * 200})
        assert response.status_code == 413 and "limit of 100 bytes" in response.json()["error"]["message"]


def test_unknown_route_and_method_use_the_error_shape(client):
    assert client.get("/v1/nothing").json()["error"]["message"] == "Not Found"
    response = client.get(COMPLETIONS)
    assert response.status_code == 405 and "error" in response.json()


# ---------------------------------------------------------------------------------------------- readiness


def test_ready_after_probe_and_503_while_draining(client):
    assert client.get("/ready").json() == {"status": "ready", "model": SERVED_NAME}
    client.app.state.replica.draining = True
    try:
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["reason"].startswith("draining")
        refused = client.post(COMPLETIONS, json=GOOD)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "service_unavailable_error"
        assert client.get("/health").status_code == 200  # alive, just not taking work
    finally:
        client.app.state.replica.draining = False
    assert client.post(COMPLETIONS, json=GOOD).status_code == 200


def test_ready_is_503_before_the_probe(make_app):
    async def main():
        transport = httpx.ASGITransport(make_app())  # no lifespan: the probe never runs
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            return await client.get("/ready")

    response = asyncio.run(main())
    assert response.status_code == 503 and response.json()["reason"].startswith("loading")


def test_failed_probe_makes_the_replica_unready(engine, make_app):
    with TestClient(make_app(probe_timeout_s=0.0)) as client:
        wait_until(lambda: client.app.state.replica.failure is not None, what="the probe to fail")
        ready = client.get("/ready")
        assert ready.status_code == 503 and "startup probe failed" in ready.json()["reason"]
        assert client.post(COMPLETIONS, json=GOOD).status_code == 503
    wait_until(lambda: all_blocks_free(engine), what="the probe's blocks to be freed")


# ---------------------------------------------------------------------------------------------- metrics


def test_metrics_count_a_request(client):
    before = metric_samples(client)
    for name in ("multiserve_num_requests_waiting", "multiserve_num_requests_running", "multiserve_kv_blocks_used",
                 "multiserve_kv_blocks_free", "multiserve_prefix_cache_hit_rate", "multiserve_num_preemptions_total"):
        assert any(key[0] == name for key in before), name
    client.post(COMPLETIONS, json={"model": SERVED_NAME, "prompt": [3, 4, 5, 6], "max_tokens": 5,
                                   "ignore_eos": True})
    after = metric_samples(client)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("multiserve_prompt_tokens_total") == 4
    assert delta("multiserve_generation_tokens_total") == 5
    assert delta("multiserve_request_success_total", finish_reason="length") == 1
    assert delta("multiserve_time_to_first_token_seconds_count") == 1
    assert delta("multiserve_inter_token_latency_seconds_count") == 4
    assert delta("multiserve_e2e_request_latency_seconds_count") == 1
    assert sample(after, "multiserve_kv_blocks_used") == 0
    assert sample(after, "multiserve_kv_blocks_free") == sample(after, "multiserve_kv_blocks_total") == 512


def test_latencies_use_the_injected_clock(make_app):
    ticks = itertools.count()
    with TestClient(make_app(clock=lambda: float(next(ticks)))) as client:
        wait_until(lambda: client.get("/ready").status_code == 200, what="/ready")
        client.post(COMPLETIONS, json={"model": SERVED_NAME, "prompt": "a", "max_tokens": 3, "ignore_eos": True})
        samples = metric_samples(client)
    # one tick at arrival, one per output: TTFT 1, two ITLs of 1, end to end 3
    assert sample(samples, "multiserve_time_to_first_token_seconds_sum") == 1.0
    assert sample(samples, "multiserve_inter_token_latency_seconds_sum") == 2.0
    assert sample(samples, "multiserve_e2e_request_latency_seconds_sum") == 3.0
