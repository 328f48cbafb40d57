"""The replica's side of resumable generations: token ids beside each streamed event (or, for a whole reply, as
progress before it) when the gateway asks, and a continuation (`multiserve_resume`) that goes on exactly where
another replica broke off."""

from __future__ import annotations

import json

import pytest

from foundation.http.wire import PROGRESS_MEDIA_TYPE, REPLY_LINE, RESUMABLE_HEADER, RESUME_FIELD, TOKENS_COMMENT
from tests.runtimes.server.conftest import SERVED_NAME

RESUMABLE = {RESUMABLE_HEADER: "1"}


def tagged_events(text: str) -> list[tuple[dict | str, list[int]]]:
    """Each `data:` payload with the token ids of the comment line before it (none: [])."""
    events: list[tuple[dict | str, list[int]]] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        ids: list[int] = []
        for line in block.split("\n"):
            if line.startswith(TOKENS_COMMENT):
                ids = [int(t) for t in line.removeprefix(TOKENS_COMMENT).split(",")]
            else:
                data = line.removeprefix("data: ")
                events.append((data if data == "[DONE]" else json.loads(data), ids))
    return events


def stream(client, path: str, body: dict, headers: dict | None = None) -> list[tuple[dict | str, list[int]]]:
    response = client.post(path, json={**body, "stream": True}, headers=headers)
    assert response.status_code == 200, response.text
    return tagged_events(response.text)


def texts(events, key: str) -> str:
    out = ""
    for event, _ in events:
        if isinstance(event, dict) and event["choices"]:
            choice = event["choices"][0]
            out += choice["text"] if key == "text" else choice["delta"].get("content", "")
    return out


def test_token_ids_ride_only_when_asked(client):
    body = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json={**body, "stream": True})
    assert TOKENS_COMMENT.strip() not in plain.text and RESUMABLE_HEADER not in plain.headers
    assert client.post("/v1/completions", json={**body, "stream": True}, headers=RESUMABLE).headers[
        RESUMABLE_HEADER] == "1"
    events = stream(client, "/v1/completions", body, RESUMABLE)
    assert sum(len(ids) for _, ids in events) == 8
    assert all(ids for event, ids in events if isinstance(event, dict) and event["choices"][0]["text"])
    assert texts(events, "text") == texts(tagged_events(plain.text), "text")


@pytest.mark.parametrize("path,key,prompt", [
    ("/v1/completions", "text", {"prompt": "the quick brown fox"}),
    ("/v1/chat/completions", "content", {"messages": [{"role": "user", "content": "hello there"}]}),
])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11, "top_p": 0.95}])
def test_a_continuation_goes_on_exactly_where_the_stream_broke(client, path, key, prompt, sampling):
    body = {"model": SERVED_NAME, **prompt, **sampling, "max_tokens": 12, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    whole = stream(client, path, body, RESUMABLE)
    ids = [t for _, tokens in whole for t in tokens]
    assert len(ids) == 12
    first = whole[0][0]
    assert isinstance(first, dict)
    for cut in (0, 1, 5, 11):  # 0: drained after a chat stream's role chunk, before its first token
        sent = [e for e in whole if e[1]]  # the events that carried tokens, in order
        shown: list[tuple[dict | str, list[int]]] = []
        count = 0
        for event in whole:  # what a client had seen once `cut` tokens were out
            if count >= cut:
                break
            shown.append(event)
            count += len(event[1])
        assert sent and count == cut
        resume = {"token_ids": ids[:cut], "id": first["id"], "created": first["created"]}
        rest = stream(client, path, {**body, RESUME_FIELD: resume}, RESUMABLE)
        assert [t for _, tokens in rest for t in tokens] == ids[cut:]
        assert texts(shown, key) + texts(rest, key) == texts(whole, key)
        chunks = [e for e, _ in rest if isinstance(e, dict)]
        assert {c["id"] for c in chunks} == {first["id"]} and {c["created"] for c in chunks} == {first["created"]}
        if key == "content":  # the role was sent by the first stream
            assert not any("role" in c["delta"] for e in chunks for c in e["choices"])
        assert chunks[-1]["usage"] == whole[-2][0]["usage"]  # every token counted once, prompt from the request
        assert rest[-1][0] == "[DONE]"


def progress(client, path: str, body: dict) -> tuple[list[list[int]], int, dict]:
    """A whole reply asked for as progress: the token ids of each line, the status and the reply."""
    response = client.post(path, json={**body, "stream": False}, headers=RESUMABLE)
    assert response.status_code == 200 and response.headers["content-type"].startswith(PROGRESS_MEDIA_TYPE)
    assert response.headers[RESUMABLE_HEADER] == "1"
    head, _, reply = response.text.partition(REPLY_LINE)
    status, _, body_text = reply.partition("\n")
    lines = [line.removeprefix(TOKENS_COMMENT) for line in head.splitlines()]
    return [[int(t) for t in line.split(",")] for line in lines], int(status), json.loads(body_text)


def reply_text(reply: dict, key: str) -> str:
    choice = reply["choices"][0]
    return choice["text"] if key == "text" else choice["message"]["content"]


@pytest.mark.parametrize("path,key,prompt", [
    ("/v1/completions", "text", {"prompt": "the quick brown fox"}),
    ("/v1/chat/completions", "content", {"messages": [{"role": "user", "content": "hello there"}]}),
])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11, "stop": ["e t"]}])
def test_a_whole_reply_comes_as_progress_and_a_continuation_finishes_it_whole(client, path, key, prompt, sampling):
    """A gateway that may have to continue a non-streamed reply gets its token ids as they come, then the reply the
    client gets; the reply a continuation gives after any number of those tokens is the undisturbed one, whole (text
    from the first token, usage counting every token once), under a new id."""
    body = {"model": SERVED_NAME, **prompt, **sampling, "max_tokens": 12, "ignore_eos": True}
    plain = client.post(path, json=body)
    assert plain.status_code == 200 and RESUMABLE_HEADER not in plain.headers
    lines, status, reply = progress(client, path, body)
    ids = [t for line in lines for t in line]
    assert status == 200 and reply_text(reply, key) == reply_text(plain.json(), key)
    # every token's id but the last one's, which comes with the reply
    assert reply["usage"] == plain.json()["usage"] and len(ids) == reply["usage"]["completion_tokens"] - 1
    for cut in (1, len(ids) // 2, len(ids)):
        rest_lines, status, rest = progress(client, path, {**body, RESUME_FIELD: {"token_ids": ids[:cut]}})
        assert status == 200 and [t for line in rest_lines for t in line] == ids[cut:]
        assert reply_text(rest, key) == reply_text(reply, key) and rest["usage"] == reply["usage"]
        assert rest["choices"][0]["finish_reason"] == reply["choices"][0]["finish_reason"]
        assert rest["id"] != reply["id"]


def test_a_whole_reply_that_fails_midway_ends_its_progress_with_the_error(client, engine, monkeypatch):
    """The status line has not been sent when generation fails: it carries the error's status and body, as a plain
    reply would have."""
    execute = engine.engine.runner.execute
    poison = [42, 42, 42, 42]

    def failing_later(plan, block_tables, interrupt=None):  # type: ignore[no-untyped-def]
        if any(item.request.prompt_token_ids == poison and item.request.num_output_tokens >= 3
               for item in plan.scheduled):
            raise RuntimeError("injected fault")
        return execute(plan, block_tables, interrupt)

    monkeypatch.setattr(engine.engine.runner, "execute", failing_later)
    body = {"model": SERVED_NAME, "prompt": poison, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    lines, status, reply = progress(client, "/v1/completions", body)
    assert [len(line) for line in lines] == [1, 1, 1] and status == 500
    assert reply["error"]["code"] == "request_failed"


@pytest.mark.parametrize("change,fragment", [
    ({"n": 2}, "needs n = 1, got n = 2"),
    ({"stream": False, "logprobs": 1}, "cannot have logprobs"),
    ({RESUME_FIELD: {"token_ids": [5], "id": "", "created": 1}}, "id"),
    ({RESUME_FIELD: {"token_ids": [1, 2], "id": "x", "created": 1}, "max_tokens": 2}, "leave nothing"),
])
def test_bad_continuations_are_refused_by_name(client, change, fragment):
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 5, "stream": True,
            RESUME_FIELD: {"token_ids": [5, 6], "id": "cmpl-1", "created": 1}, **change}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and (error["param"] or "").startswith(("multiserve_resume", "resume"))
