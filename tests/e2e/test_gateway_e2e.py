"""The whole system on loopback: `multiserve serve` with real worker processes, the official openai client,
failover under `kill -9`, live registry edits, bad input, and a clean SIGTERM shutdown.

Tests run in file order on one gateway; the last one shuts it down.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from bench.measure.memory_watch import children_of
from tests.e2e.conftest import ADMIN_TOKEN, Gateway, replica_get

pytestmark = pytest.mark.slow


def test_openai_client(gateway):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        _check_openai_client(client)


def _check_openai_client(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list()}
    assert {"tiny-chat", "tiny"} <= ids
    done = client.completions.create(model="tiny", prompt="hello", max_tokens=5, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=7, stream=True,
        logprobs=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    streamed = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    assert usage is not None and usage.completion_tokens == streamed == 7

    def seeded() -> str:
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "seed me"}],
                                               max_tokens=12, temperature=1.0, seed=1234,
                                               extra_body={"ignore_eos": True})
        return reply.choices[0].message.content

    assert seeded() == seeded()
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=-1)


class Colour(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    colour: Literal["red", "green"]
    ok: bool


def test_structured_outputs_through_the_openai_client(gateway):
    """Whatever the tiny model's random weights would say, the reply follows the schema, the choice or the regex:
    OpenAI's parse helper (a strict json_schema), a streamed vLLM guided_choice, structured_outputs on completions."""
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        parsed = client.chat.completions.parse(model="tiny-chat", messages=[{"role": "user", "content": "colour?"}],
                                               max_tokens=60, temperature=0.0, response_format=Colour)
        assert parsed.choices[0].finish_reason == "stop" and isinstance(parsed.choices[0].message.parsed, Colour)
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "yes or no?"}], max_tokens=10, stream=True,
            extra_body={"guided_choice": ["yes", "no"]}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) in ("yes", "no")
        done = client.completions.create(model="tiny", prompt="digits:", max_tokens=10, temperature=1.0, seed=7,
                                         extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
        assert re.fullmatch("[0-9]{3}", done.choices[0].text) and done.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="regex"):
            client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                      extra_body={"structured_outputs": {"regex": "(unclosed"}})


CLOCK_TOOL = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_forced_tool_calls_through_the_openai_client(gateway):
    """tool_choice naming the function or "required": the random weights' reply is a call whose arguments parse and
    follow the parameters, as a whole reply and as the client's streamed deltas put together."""
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for choice in ({"type": "function", "function": {"name": "now"}}, "required"):
            ask = {"model": "tiny", "messages": [{"role": "user", "content": "time?"}], "tools": [CLOCK_TOOL],
                   "tool_choice": choice, "parallel_tool_calls": False, "max_tokens": 60, "temperature": 1.0,
                   "seed": 3}
            done = client.chat.completions.create(**ask)
            [call] = done.choices[0].message.tool_calls
            assert done.choices[0].finish_reason == "tool_calls" and done.choices[0].message.content is None
            assert call.id.startswith("call_") and call.function.name == "now"
            assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
            names, arguments, finish = [], "", None
            for chunk in client.chat.completions.create(**ask, stream=True):
                for delta_call in chunk.choices[0].delta.tool_calls or ():
                    names += [delta_call.function.name] if delta_call.function.name else []
                    arguments += delta_call.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            assert names == ["now"] and finish == "tool_calls"
            assert arguments == call.function.arguments  # the same seed: the same call


def test_tool_choice_auto_through_the_openai_client(gateway):
    """tools with no tool_choice (OpenAI's default "auto"): the model's text is read for calls in the syntax the
    default tool prompt asks for. The random weights are held to such a text by a regex, so the call is known; the
    client gets it as tool_calls, whole and streamed, and the text around it as content."""
    text = 'Checking. <tool_call>\n{"name": "now", "arguments": {"zone": "CET"}}\n</tool_call>'
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "time?"}], "tools": [CLOCK_TOOL],
               "max_tokens": 90, "extra_body": {"guided_regex": re.escape(text)}}
        done = client.chat.completions.create(**ask)
        message = done.choices[0].message
        assert done.choices[0].finish_reason == "tool_calls" and message.content.strip() == "Checking."
        [call] = message.tool_calls
        assert call.function.name == "now" and json.loads(call.function.arguments) == {"zone": "CET"}
        content, names, arguments, finish = "", [], "", None
        for chunk in client.chat.completions.create(**ask, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for delta_call in delta.tool_calls or ():
                names += [delta_call.function.name] if delta_call.function.name else []
                arguments += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (content.strip(), names, json.loads(arguments), finish) == ("Checking.", ["now"], {"zone": "CET"},
                                                                           "tool_calls")


BAD_REQUESTS = [
    ("invalid json", "/v1/completions", b"{not json", 400, "JSON"),
    ("wrong type", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("temperature range", "/v1/completions", {"model": "tiny", "prompt": "x", "temperature": 9}, 400, "temperature"),
    ("absurd n", "/v1/completions", {"model": "tiny", "prompt": "x", "n": 1000}, 400, "n"),
    ("absurd max_tokens", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**9}, 400,
     "context length"),
    ("prompt over limit", "/v1/completions", {"model": "tiny", "prompt": "ab " * 400, "max_tokens": 1}, 400,
     "context length"),
    ("empty messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("message without role", "/v1/chat/completions", {"model": "tiny", "messages": [{"content": "x"}]}, 400,
     "role"),
    ("token ids outside vocab", "/v1/completions", {"model": "tiny", "prompt": [1, 99999], "max_tokens": 1}, 400,
     "vocabulary"),
    ("unknown model", "/v1/completions", {"model": "ghost", "prompt": "x"}, 404, "ghost"),
    ("wrong endpoint", "/v1/embeddings", {"model": "tiny", "input": "x"}, 400, "/v1/chat/completions"),
]


@pytest.mark.parametrize(("case", "path", "body", "status", "mentions"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_a_clear_4xx_and_nothing_breaks(gateway, case, path, body, status, mentions):
    with gateway.client() as http:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = http.post(path, **kwargs)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert mentions in error["message"]
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "still there?", "max_tokens": 2})
        assert ok.status_code == 200


def test_oversized_body_is_413(gateway):
    with gateway.client() as http:
        response = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "' + b"x" * (5 << 20) + b'"}')
        assert response.status_code == 413
        assert "limit" in response.json()["error"]["message"]


def _replicas(gateway: Gateway) -> list[dict]:
    return httpx.get(f"{gateway.url}/health/models", timeout=10).json()["models"]["tiny-chat"]["replicas"]


def test_failover_when_a_replica_is_killed(gateway):
    # The gateway is ready once each model has a ready replica; failover needs the second one too (on a loaded
    # machine it may still be loading, and then every request in flight rightly gets 503 when the first dies).
    _wait_for(lambda: all(r["state"] == "ready" for r in _replicas(gateway)), what="both tiny-chat replicas ready")
    victim = _replicas(gateway)[0]
    ready_codes: list[int] = []
    stop = threading.Event()

    def watch_ready() -> None:
        while not stop.is_set():
            ready_codes.append(httpx.get(f"{gateway.url}/ready", timeout=10).status_code)
            time.sleep(0.05)

    async def fire() -> list:
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            calls = [client.completions.create(model="tiny", prompt=f"request {i}", max_tokens=120,
                                               extra_body={"ignore_eos": True}) for i in range(24)]
            tasks = [asyncio.create_task(c) for c in calls]
            await asyncio.sleep(0.4)  # all 24 are in flight, spread over both replicas
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    watcher = threading.Thread(target=watch_ready)
    watcher.start()
    try:
        results = asyncio.run(fire())
    finally:
        stop.set()
        watcher.join()
    assert len(results) == 24 and all(r.usage.completion_tokens == 120 for r in results)
    assert ready_codes and set(ready_codes) == {200}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        replica = next(r for r in _replicas(gateway) if r["id"] == victim["id"])
        if replica["state"] == "ready" and replica["restarts"] >= 1:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the killed replica did not come back: {replica}")
    states = [t["state"] for t in replica["transitions"]]
    assert "unhealthy" in states and states[-1] == "ready"
    assert replica["pid"] != victim["pid"]


def _wait_for(predicate, timeout_s: float = 90.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def test_live_registry_edits(gateway):
    path: Path = gateway.registry_path
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with gateway.client() as http:
        assert http.get("/admin/registry/status").status_code == 401
        assert http.get("/admin/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        version = http.get("/admin/registry/status", headers=admin).json()["version"]

        # (a) the file: a new model is served without a restart
        good = path.read_text() + (
            "  - name: tiny-two   # added by editing the file\n"
            "    type: completion\n"
            f"    source: {{path: {gateway.model_path}}}\n"
            "    replicas: 1\n"
            "    device: cpu\n"
            "    engine: {kv_cache_gib: 0.01, max_model_len: 256}\n"
        )
        path.write_text(good)
        _wait_for(lambda: any(m["id"] == "tiny-two" for m in http.get("/v1/models").json()["data"]),
                  what="tiny-two in /v1/models")
        _wait_for(lambda: http.get("/ready").status_code == 200, what="tiny-two ready")
        assert http.post("/v1/completions", json={"model": "tiny-two", "prompt": "hi", "max_tokens": 2}
                         ).status_code == 200

        # a broken edit is rejected and reported; the last good registry keeps serving
        path.write_text(good.replace("replicas: 1\n", "replicas: -1\n"))
        status = _wait_for(lambda: (s := http.get("/admin/registry/status", headers=admin).json())["last_rejected"]
                           and s, what="the rejected edit to be reported")
        assert "replicas" in str(status["last_rejected"]["errors"])
        assert status["version"] == version + 1
        assert http.post("/v1/completions", json={"model": "tiny-two", "prompt": "hi", "max_tokens": 2}
                         ).status_code == 200
        path.write_text(good)
        time.sleep(1.5)  # let the watcher see the file is good again before the admin edit below

        # (b) the admin API persists edits and keeps the operator's comments
        scaled = http.post("/admin/models/tiny-two/scale", json={"replicas": 0}, headers=admin)
        assert scaled.status_code == 200, scaled.text
        text = path.read_text()
        assert "# e2e registry: the operator's comments must survive admin edits" in text
        assert "# added by editing the file" in text and "# two replicas for failover" in text
        assert "replicas: 0" in text
        bad = http.put("/admin/models/tiny-two", json={"type": "chat", "replicas": "many"}, headers=admin)
        assert bad.status_code == 400 and path.read_text() == text


def _gauge_on_replicas(gateway: Gateway, name: str, label: str = "") -> float:
    """Sum of a metric over the replicas of tiny-chat, read from each worker's own /metrics."""
    total = 0.0
    for replica in _replicas(gateway):
        text = replica_get(replica, "/metrics").text
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith(name) and label in line)
    return total


def _aborted_on_replicas(gateway: Gateway) -> float:
    return _gauge_on_replicas(gateway, "multiserve_request_success_total", 'finish_reason="abort"')


def test_streams_pass_through_unbuffered_and_disconnects_abort(gateway):
    body = {"model": "tiny", "prompt": "stream", "max_tokens": 400, "stream": True, "ignore_eos": True}
    before = _aborted_on_replicas(gateway)
    with gateway.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        running = _gauge_on_replicas(gateway, "multiserve_num_requests_running")
        for _ in range(5):
            next(lines)
    # the first token reached us while its request was still generating (nothing buffered the reply), and
    # leaving early (closing the connection) aborted the request on its replica
    assert '"text"' in first and running >= 1
    _wait_for(lambda: _aborted_on_replicas(gateway) >= before + 1, timeout_s=30, what="the abort on the replica")


def test_sigterm_shuts_down_cleanly(gateway):
    workers = children_of(gateway.process.pid)
    assert len(workers) >= 2
    assert gateway.stop() == 0
    time.sleep(0.5)
    assert [pid for pid in workers if Path(f"/proc/{pid}").exists()
            and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]] == []
