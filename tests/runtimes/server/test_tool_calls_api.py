"""Tool calls through the replica's app over the tiny random-weight model: whatever its weights say, a tool_choice of
"required" or naming a function gives calls whose arguments parse and follow the tool's parameters, streamed (in
OpenAI's deltas) and not, for every choice of n; the prompt carries the tools (its template has no syntax for them)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from foundation.http.wire import RESUME_FIELD
from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from tests.runtimes.llm.tiny import TinySpec, loaded_tiny
from tests.runtimes.server.conftest import SERVED_NAME
from tests.runtimes.server.test_app import sse_events

CHAT = "/v1/chat/completions"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]},
                                          "exact": {"type": "boolean"}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
NAMED = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLMEngine]:
    """The tiny model with room for the tools' system prompt (its byte tokenizer spends a token a character)."""
    engine = AsyncLLMEngine(LLMEngine(loaded_tiny(TinySpec(max_position_embeddings=2048)),
                                      EngineConfig(kv_cache_bytes=4 << 20, block_size=4)))
    yield engine
    engine.shutdown()


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": USER, "tools": TOOLS, "max_tokens": 300, "temperature": 1.0, **extra}


def _check_calls(calls: list[dict[str, Any]], named: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
        name = call["function"]["name"]
        assert name == named if named else name in SCHEMAS
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def _streamed(events: list[Any], n: int) -> list[tuple[dict[str, Any], str | None]]:
    """Each choice's message put together from OpenAI's deltas, and its finish_reason."""
    messages: list[dict[str, Any]] = [{"content": "", "tool_calls": {}} for _ in range(n)]
    finish: list[str | None] = [None] * n
    for event in events[:-1]:
        for choice in event["choices"]:
            message, delta = messages[choice["index"]], choice["delta"]
            message["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                known = message["tool_calls"].get(call["index"])
                if known is None:  # a call's first delta: its id, type and name (and the output's first piece)
                    assert {"id", "type"} <= set(call) and set(call["function"]) == {"name", "arguments"}
                    message["tool_calls"][call["index"]] = {**call, "function": dict(call["function"])}
                else:
                    assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                    known["function"]["arguments"] += call["function"]["arguments"]
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert events[-1] == "[DONE]"
    return [({**m, "tool_calls": [m["tool_calls"][i] for i in sorted(m["tool_calls"])]}, f)
            for m, f in zip(messages, finish, strict=True)]


# "required" with one call at most: random weights may otherwise go on calling past any max_tokens
FORCED = [pytest.param({"tool_choice": NAMED}, "get_time", id="named"),
          pytest.param({"tool_choice": "required", "parallel_tool_calls": False}, None, id="required")]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(("choice", "named"), FORCED)
def test_forced_calls_parse_and_follow_the_parameters(client, seed, choice, named):
    response = client.post(CHAT, json=_body(**choice, seed=seed, n=2))
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"]) == 2
    for c in body["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
        _check_calls(c["message"]["tool_calls"], named)
        if named:
            assert len(c["message"]["tool_calls"]) == 1
    assert body["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(("choice", "named"), FORCED)
def test_forced_calls_stream_as_openai_deltas(client, seed, choice, named):
    body = _body(**choice, seed=seed, n=2, stream=True, stream_options={"include_usage": True})
    response = client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    for message, finish in _streamed(events, 2):
        assert finish == "tool_calls" and message["content"] == ""
        _check_calls(message["tool_calls"], named)
    # the same calls as a whole reply of the same seed
    whole = client.post(CHAT, json={**body, "stream": False, "stream_options": None}).json()
    streamed = _streamed(events, 2)
    for c, (message, _) in zip(whole["choices"], streamed, strict=True):
        assert [x["function"] for x in c["message"]["tool_calls"]] == [x["function"] for x in message["tool_calls"]]
    assert events[-2]["usage"] == whole["usage"]


def test_one_call_only_without_parallel_calls(client):
    for seed in range(3):
        body = client.post(CHAT, json=_body(tool_choice="required", parallel_tool_calls=False, seed=seed)).json()
        assert len(body["choices"][0]["message"]["tool_calls"]) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_calls_each_follow_their_tool_and_match_streamed_or_not(client, stream):
    """Any number of calls, of either tool; only a last one cut short by max_tokens may be incomplete."""
    body = _body(tool_choice="required", seed=1, n=2, max_tokens=400)
    whole = client.post(CHAT, json=body).json()
    for c in whole["choices"]:
        calls = c["message"]["tool_calls"]
        _check_calls(calls if c["finish_reason"] == "tool_calls" else calls[:-1])
    if stream:
        streamed = _streamed(sse_events(client.post(CHAT, json={**body, "stream": True}).text), 2)
        assert [(m["tool_calls"] and [x["function"] for x in m["tool_calls"]], f) for m, f in streamed] == [
            ([x["function"] for x in c["message"]["tool_calls"]], c["finish_reason"]) for c in whole["choices"]]


def test_a_call_cut_short_keeps_its_length_finish(client):
    body = client.post(CHAT, json=_body(tool_choice=NAMED, max_tokens=3, seed=0)).json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"]) == 1


def test_the_prompt_carries_the_tools_and_none_leaves_them_out(client):
    with_tools = client.post(CHAT, json=_body(tool_choice="required", max_tokens=1)).json()["usage"]
    without = client.post(CHAT, json=_body(tool_choice="none", max_tokens=1)).json()
    plain = client.post(CHAT, json={**_body(max_tokens=1), "tools": None}).json()
    assert without["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert with_tools["prompt_tokens"] > plain["usage"]["prompt_tokens"] + len(json.dumps(TOOLS))
    assert isinstance(without["choices"][0]["message"]["content"], str)
    assert "tool_calls" not in without["choices"][0]["message"]


def test_a_conversation_that_called_tools_renders(client):
    messages = [*USER,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = client.post(CHAT, json=_body(messages=messages, tool_choice="none", max_tokens=2))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "ghost"}}}, "tool_choice.function.name"),
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "no spaces"}}]}, "tools[2].function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, extra, param):
    response = client.post(CHAT, json=_body(**extra))
    assert response.status_code == 400 and response.json()["error"]["param"] == param


# tool_choice "auto": the model's own text is read by the tool parser (here "hermes", the default template's). The
# random weights are held to a text by a regex, so that what is read is known: some content, then a call.
AUTO_TEXT = 'Let me check. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_calls_in_the_models_text(client, stream):
    body = _body(tool_choice="auto", seed=1, structured_outputs={"regex": re.escape(AUTO_TEXT)}, stream=stream)
    response = client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    if stream:
        [(message, finish)] = _streamed(sse_events(response.text), 1)
    else:
        choice = response.json()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
    assert finish == "tool_calls"
    assert message["content"].strip() == "Let me check."
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"]) == {"zone": "UTC"}


def test_auto_without_a_call_is_plain_content(client):
    body = _body(tool_choice="auto", seed=1, structured_outputs={"regex": "No tool needed\\."})
    choice = client.post(CHAT, json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "No tool needed."
    assert "tool_calls" not in choice["message"]


RESUMED = [pytest.param({"tool_choice": NAMED}, id="named"),
           pytest.param({"tool_choice": "required", "parallel_tool_calls": False}, id="required"),
           pytest.param({"tool_choice": "auto", "structured_outputs": {"regex": re.escape(AUTO_TEXT)}}, id="auto")]


@pytest.mark.parametrize("choice", RESUMED)
def test_a_call_stream_cut_anywhere_goes_on_exactly_on_another_replica(client, choice):
    """A stream of tool-call deltas broken after any token (before the name, inside the arguments) and continued
    from its tokens (`multiserve_resume`): what the client saw plus the continuation is the whole stream's call,
    announced once (one id, one name), its arguments in order."""
    from tests.runtimes.server.test_resume_protocol import RESUMABLE, stream

    body = _body(**choice, seed=4, max_tokens=200)
    whole = stream(client, CHAT, body, RESUMABLE)
    ids = [t for _, tokens in whole for t in tokens]
    [(expected, finish)] = _streamed([e for e, _ in whole], 1)
    assert finish == "tool_calls" and len(expected["tool_calls"]) == 1
    first = whole[0][0]
    assert isinstance(first, dict)
    for cut in sorted({1, len(ids) // 3, len(ids) // 2, len(ids) - 1}):
        shown, count = [], 0
        for event, tokens in whole:  # what the client had seen once `cut` tokens were out
            if count >= cut:
                break
            shown.append(event)
            count += len(tokens)
        resume = {"token_ids": ids[:count], "id": first["id"], "created": first["created"]}
        rest = stream(client, CHAT, {**body, RESUME_FIELD: resume}, RESUMABLE)
        [(message, finish)] = _streamed([*shown, *(e for e, _ in rest)], 1)
        assert finish == "tool_calls", cut
        [call] = message["tool_calls"]
        assert call["function"] == expected["tool_calls"][0]["function"], cut
        assert message["content"] == expected["content"], cut
