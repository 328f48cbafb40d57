"""Resumable generations at the gateway, against fake replicas that speak the protocol (tests/gateway/fakes.py): a
stream or a whole reply that breaks, stalls or whose replica is drained with migration goes on elsewhere, seamlessly;
the pieces (`StreamTracker`, `ProgressTracker`, `Pump`) on their own."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.proxy import ProxySettings
from gateway.resume import Moved, ProgressTracker, Pump, StreamTracker
from tests.gateway import fakes
from tests.gateway.fakes import ADMIN_TOKEN, NUM_STREAM_CHUNKS, FakeGateway, Received, chat

ALL_TOKENS = [f"tok{i}" for i in range(NUM_STREAM_CHUNKS)]


def data_events(response: httpx.Response) -> list[str]:
    assert ": multiserve-tokens" not in response.text  # stripped on the way
    return [block.removeprefix("data: ") for block in response.text.split("\n\n") if block]


def contents(payloads: list[str]) -> list[str]:
    return [c["delta"]["content"] for p in payloads if p != "[DONE]" for c in json.loads(p)["choices"]]


def continuations(gw: FakeGateway) -> list[Received]:
    return [r for r in gw.replicas.received if "multiserve_resume" in r.body]


def _start_on_alpha_0(gw: FakeGateway, behaviour: str) -> None:
    """alpha/0 behaves as `behaviour`; alpha/1 refuses connections until a request has reached a replica, so the
    next request starts on alpha/0 and its continuation finds alpha/1 answering."""
    gw.replicas.set("alpha/0", behaviour)
    gw.replicas.set("alpha/1", "down")

    def up_again(received: Received) -> None:
        gw.replicas.set("alpha/1", "ok")

    gw.replicas.on_request = up_again


def test_a_stream_that_breaks_midway_goes_on_on_another_replica(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        _start_on_alpha_0(gw, "break_midstream")
        response = await gw.client.post("/v1/chat/completions", json=chat(
            stream=True, stream_options={"include_usage": True}))
        payloads = data_events(response)
        assert contents(payloads) == ALL_TOKENS  # each token once, in order
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert {c["id"] for c in chunks} == {"chatcmpl-fake-alpha-0"}  # the first stream's id throughout
        assert chunks[-1]["usage"]["completion_tokens"] == NUM_STREAM_CHUNKS and payloads[-1] == "[DONE]"
        assert [c["replica"] for c in chunks[:-1]] == ["fake-alpha-0"] * 2 + ["fake-alpha-1"] * 2
        [resumed] = continuations(gw)
        assert resumed.host == "fake-alpha-1"
        assert resumed.body["multiserve_resume"] == {"token_ids": [100, 101], "id": "chatcmpl-fake-alpha-0",
                                                     "created": 7}
        assert resumed.body["messages"] == chat()["messages"] and resumed.body["stream"] is True
        assert resumed.headers["authorization"] == f"Bearer {gw.launcher.latest('alpha/1').token}"  # its own token
        assert gw.metric("multiserve_gateway_stream_migrations_total", model="alpha", cause="replica_failed") == 1
        assert gw.metric("multiserve_gateway_resumed_tokens_total", model="alpha") == 2
        assert set(gw.outstanding().values()) == {0}

    with_gateway(scenario)


def test_a_single_replica_model_resumes_on_its_own_restarted_replica(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("beta/0", "break_midstream")
        response = await gw.client.post("/v1/chat/completions", json=chat("beta", stream=True))
        assert contents(data_events(response)) == ALL_TOKENS
        assert [r.host for r in continuations(gw)] == ["fake-beta-0"]

    with_gateway(scenario)


def test_a_break_after_the_last_token_only_finishes_the_stream(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "break_before_done")
        response = await gw.client.post("/v1/chat/completions", json=chat(
            stream=True, stream_options={"include_usage": True}))
        payloads = data_events(response)
        assert contents(payloads) == ALL_TOKENS and payloads[-1] == "[DONE]"
        usage = json.loads(payloads[-2])["usage"]  # the replica's own, which it had sent
        assert usage == {"prompt_tokens": 3, "completion_tokens": NUM_STREAM_CHUNKS, "total_tokens": 7}
        assert continuations(gw) == []  # nothing left to generate: no replica asked

    with_gateway(scenario)


def test_a_stalled_stream_goes_on_elsewhere(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        _start_on_alpha_0(gw, "stall_midstream")
        response = await gw.client.post("/v1/chat/completions", json=chat(stream=True))
        assert contents(data_events(response)) == ALL_TOKENS
        assert [r.host for r in continuations(gw)] == ["fake-alpha-1"]
        assert gw.replicas.streams[0].closed  # the stalled reply was let go (its request aborted there)

    with_gateway(scenario, proxy_settings=ProxySettings(stream_stall_s=0.2))


def test_drain_with_migrate_moves_a_live_stream_at_once(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("alpha/0", "stall_midstream")  # holds its stream open (30 s) after two tokens
        gw.replicas.set("alpha/1", "down")
        request = asyncio.create_task(gw.client.post("/v1/chat/completions", json=chat(stream=True)))
        while gw.outstanding().get("alpha/0") != 1:
            await asyncio.sleep(0.001)
        gw.replicas.set("alpha/1", "ok")
        await asyncio.sleep(0.05)  # the first two tokens are out; the replica is silent
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        reply = await gw.client.post("/admin/replicas/alpha/0/drain", json={"migrate": True}, headers=admin)
        assert reply.status_code == 200 and reply.json()["state"] == "draining"
        response = await asyncio.wait_for(request, 5.0)  # long before the stall would have ended
        assert contents(data_events(response)) == ALL_TOKENS
        assert gw.metric("multiserve_gateway_stream_migrations_total", model="alpha", cause="drained") == 1
        assert gw.outstanding()["alpha/0"] == 0 and gw.replicas.streams[0].closed
        bad = await gw.client.post("/admin/replicas/alpha/1/drain", json={"migrate": "yes"}, headers=admin)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "migrate"

    with_gateway(scenario)


def test_drain_with_migrate_of_a_models_only_replica_lets_its_stream_finish_there(with_gateway, monkeypatch):
    """Nowhere to move: moved, the stream would wait resume_wait_s for a replica and end in-band; it finishes."""
    monkeypatch.setattr(fakes, "SLOW_S", 1.0)  # the stall after two tokens: time to drain in, then it goes on

    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("beta/0", "stall_midstream")
        request = asyncio.create_task(gw.client.post("/v1/chat/completions", json=chat("beta", stream=True)))
        while gw.outstanding().get("beta/0") != 1:
            await asyncio.sleep(0.001)
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        reply = await gw.client.post("/admin/replicas/beta/0/drain", json={"migrate": True}, headers=admin)
        answer = reply.json()
        assert (answer["state"], answer["migrated_streams"], answer["finishing_in_place"]) == ("draining", 0, 1)
        assert answer["migration_waiting"] is True
        payloads = data_events(await asyncio.wait_for(request, 5.0))
        assert contents(payloads) == ALL_TOKENS and payloads[-1] == "[DONE]"
        assert not any("error" in json.loads(p) for p in payloads[:-1]) and continuations(gw) == []
        assert gw.metric("multiserve_gateway_stream_migrations_total", model="beta", cause="drained") == 0

    with_gateway(scenario)


def test_with_nowhere_to_go_the_stream_ends_in_band_after_resume_wait(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("beta/0", "break_midstream")

        def drain(received: Received) -> None:  # the model's only replica leaves routing once the stream started
            gw.pool.drain("beta/0")

        gw.replicas.on_request = drain
        response = await gw.client.post("/v1/chat/completions", json=chat("beta", stream=True))
        payloads = data_events(response)
        assert contents(payloads[:2]) == ALL_TOKENS[:2]
        assert json.loads(payloads[2])["error"]["code"] == "stream_interrupted" and payloads[3:] == ["[DONE]"]
        assert 5.0 <= sum(gw.proxy_sleep.delays) < 6.0  # it waited resume_wait_s for a replica

    with_gateway(scenario, proxy_settings=ProxySettings(resume_wait_s=5.0))


def test_a_whole_reply_whose_replica_breaks_midway_is_finished_on_another(with_gateway):
    """Not streamed: the client gets one whole reply, from the replica that finished it, with every token; the
    continuation carried the ids the first one had generated."""
    async def scenario(gw: FakeGateway) -> None:
        _start_on_alpha_0(gw, "break_midstream")
        response = await gw.client.post("/v1/chat/completions", json=chat(max_tokens=4))
        assert response.status_code == 200 and response.headers["content-type"] == "application/json"
        reply = response.json()
        assert reply["choices"][0]["message"]["content"] == "".join(ALL_TOKENS) and reply["replica"] == "fake-alpha-1"
        assert reply["usage"]["completion_tokens"] == NUM_STREAM_CHUNKS
        [resumed] = continuations(gw)
        assert resumed.host == "fake-alpha-1" and "stream" not in resumed.body  # as the client sent it
        assert resumed.body["multiserve_resume"] == {"token_ids": [100, 101]}
        assert gw.replicas.received[0].headers["x-multiserve-resumable"] == "1"
        assert gw.metric("multiserve_gateway_stream_migrations_total", model="alpha", cause="replica_failed") == 1
        assert gw.metric("multiserve_gateway_resumed_tokens_total", model="alpha") == 2
        assert set(gw.outstanding().values()) == {0}

    with_gateway(scenario)


def test_a_whole_reply_moves_at_once_when_its_replica_is_drained_with_migration(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("alpha/0", "stall_midstream")  # two token lines, then silence (30 s)
        gw.replicas.set("alpha/1", "down")
        request = asyncio.create_task(gw.client.post("/v1/completions", json={"model": "alpha", "prompt": "hi"}))
        while gw.outstanding().get("alpha/0") != 1:
            await asyncio.sleep(0.001)
        gw.replicas.set("alpha/1", "ok")
        await asyncio.sleep(0.05)
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        assert (await gw.client.post("/admin/replicas/alpha/0/drain", json={"migrate": True},
                                     headers=admin)).status_code == 200
        response = await asyncio.wait_for(request, 5.0)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "".join(ALL_TOKENS)
        assert [r.body["multiserve_resume"] for r in continuations(gw)] == [{"token_ids": [100, 101]}]
        assert gw.metric("multiserve_gateway_stream_migrations_total", model="alpha", cause="drained") == 1

    with_gateway(scenario)


def test_with_nowhere_to_go_a_whole_reply_is_a_503_after_resume_wait(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("beta/0", "break_midstream")
        gw.replicas.on_request = lambda received: gw.pool.drain("beta/0")
        response = await gw.client.post("/v1/chat/completions", json=chat("beta"))
        assert response.status_code == 503 and response.json()["error"]["code"] == "reply_interrupted"
        assert 5.0 <= sum(gw.proxy_sleep.delays) < 6.0

    with_gateway(scenario, proxy_settings=ProxySettings(resume_wait_s=5.0))


# ------------------------------------------------------------------------------------ the pieces


def test_progress_tracker_reads_lines_across_chunks_and_keeps_the_reply_whole():
    progress = ProgressTracker()
    for chunk in (b": multiserve-tokens 5\n: multiserve-to", b"kens 6,7\n", b": multiserve-reply 200\n{\"a\": ",
                  b"1}"):
        progress.feed(chunk)
    assert progress.token_ids == [5, 6, 7] and progress.reply == (200, b'{"a": 1}')
    again = json.loads(progress.continuation({"model": "m", "stream": False}))
    assert again == {"model": "m", "stream": False, "multiserve_resume": {"token_ids": [5, 6, 7]}}
    assert progress.reply is None  # a continuation starts a new reply
    broken = ProgressTracker()
    broken.feed(b": multiserve-tokens 1\n: multiserve-tok")  # the rest of that line never came
    assert json.loads(broken.continuation({}))["multiserve_resume"] == {"token_ids": [1]}


@pytest.mark.parametrize("line", [b"data: {}\n", b": multiserve-tokens 1,x\n", b": multiserve-reply ok\n"])
def test_progress_tracker_refuses_a_line_it_does_not_know(line):
    from gateway.upstream import UpstreamError

    with pytest.raises(UpstreamError, match=r"not a (progress|token-id|reply) line"):
        ProgressTracker().feed(line)


def _event(tokens: list[int] | None, payload: str) -> bytes:
    head = b"" if tokens is None else f": multiserve-tokens {','.join(map(str, tokens))}\n".encode()
    return head + f"data: {payload}\n\n".encode()


def test_tracker_forwards_only_whole_events_and_keeps_their_token_ids():
    tracker = StreamTracker(include_usage=False)
    first = _event(None, '{"id":"x","created":5,"object":"text_completion","model":"m","choices":[]}')
    second = _event([4, 5], '{"id":"x","choices":[{"index":0,"text":"ab","finish_reason":null}]}')
    stream = first + second
    out = b"".join(tracker.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))  # split anywhere
    assert out == first + second.split(b"\n", 1)[1] and tracker.token_ids == [4, 5]
    assert tracker.resumable and (tracker.id, tracker.created) == ("x", 5)
    assert tracker.feed(_event([6], '{"id":"x","choices":[]}')[:-3]) == b""  # partial: held
    assert tracker.token_ids == [4, 5]  # a partial event's tokens do not count until it is whole
    body = json.loads(tracker.continuation({"model": "m", "prompt": "p"}))
    assert body["multiserve_resume"] == {"token_ids": [4, 5], "id": "x", "created": 5}


@pytest.mark.parametrize(("payload", "attribute"), [
    ('{"id":"x","choices":[{"index":0,"text":"z","finish_reason":"length"}]}', "finished"),
    ('{"error":{"message":"boom"}}', "failed"),
    ("[DONE]", "done"),
])
def test_tracker_does_not_resume_a_stream_that_has_ended(payload, attribute):
    tracker = StreamTracker(include_usage=False)
    tracker.feed(_event([1], '{"id":"x","created":1,"choices":[{"index":0,"text":"a","finish_reason":null}]}'))
    tracker.feed(_event([2] if attribute == "finished" else None, payload))
    assert getattr(tracker, attribute) and not tracker.resumable


def test_tracker_does_not_resume_text_it_has_no_token_ids_for():
    tracker = StreamTracker(include_usage=False)
    tracker.feed(_event(None, '{"id":"x","created":1,"choices":[{"index":0,"delta":{"content":"hi"}}]}'))
    assert tracker.untracked and not tracker.resumable


def test_tracker_ending_adds_the_usage_it_can_count():
    tracker = StreamTracker(include_usage=True)
    tracker.feed(_event([1, 2, 3], '{"id":"x","created":1,"object":"o","model":"m","choices":[{"index":0,'
                                   '"text":"a","finish_reason":"stop"}]}'))
    [usage, done] = [b for b in tracker.ending(prompt_tokens=4).split(b"\n\n") if b]
    assert json.loads(usage.removeprefix(b"data: "))["usage"] == {"prompt_tokens": 4, "completion_tokens": 3,
                                                                  "total_tokens": 7}
    assert done == b"data: [DONE]"
    assert tracker.ending(prompt_tokens=None) == b"data: [DONE]\n\n"


def test_pump_passes_chunks_errors_and_the_end_and_stops_on_request():
    async def chunks(items: list[bytes | Exception], wait: asyncio.Event | None = None):
        for item in items:
            if isinstance(item, Exception):
                raise item
            yield item
        if wait is not None:
            await wait.wait()

    async def main() -> None:
        pump = Pump(chunks([b"a", b"b"]))
        assert [await pump.get(), await pump.get(), await pump.get()] == [b"a", b"b", None]
        pump.cancel()
        broken = Pump(chunks([b"a", ValueError("reset")]))
        assert await broken.get() == b"a"
        with pytest.raises(ValueError, match="reset"):
            await broken.get()
        broken.cancel()
        never = asyncio.Event()
        waiting = Pump(chunks([b"a"], never))
        assert await waiting.get() == b"a"
        reader = asyncio.create_task(waiting.get())
        await asyncio.sleep(0.01)
        waiting.stop()  # the reader waits: it wakes with Moved
        with pytest.raises(Moved):
            await asyncio.wait_for(reader, 1.0)
        with pytest.raises(Moved):
            await waiting.get()
        waiting.cancel()

    asyncio.run(main())


def test_a_partial_event_of_the_broken_reply_is_dropped_not_glued_to_the_next():
    tracker = StreamTracker(include_usage=False)
    tracker.feed(_event([1], '{"id":"x","created":1,"choices":[{"index":0,"text":"a","finish_reason":null}]}'))
    assert tracker.feed(_event([2], '{"id":"x","choices":[]}')[:12]) == b""  # the replica died mid-event
    body = json.loads(tracker.continuation({"prompt": "p"}))
    assert body["multiserve_resume"]["token_ids"] == [1]
    nxt = _event([2], '{"id":"x","choices":[{"index":0,"text":"b","finish_reason":null}]}')
    assert tracker.feed(nxt) == nxt.split(b"\n", 1)[1] and tracker.token_ids == [1, 2] and not tracker.untracked


def test_ending_does_not_repeat_a_usage_chunk_already_sent():
    tracker = StreamTracker(include_usage=True)
    tracker.feed(_event([1], '{"id":"x","created":1,"choices":[{"index":0,"text":"a","finish_reason":"stop"}]}'))
    tracker.feed(_event(None, '{"id":"x","created":1,"choices":[],"usage":{"prompt_tokens":2,'
                              '"completion_tokens":1,"total_tokens":3}}'))
    assert tracker.ending(prompt_tokens=2) == b"data: [DONE]\n\n"


def test_clients_cannot_send_a_continuation_themselves(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        body = chat(stream=True, multiserve_resume={"token_ids": [1], "id": "mine", "created": 1})
        response = await gw.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "multiserve_resume"
        assert gw.replicas.received == []

    with_gateway(scenario)


def test_a_client_gone_before_the_first_body_byte_lets_go_of_the_replica(with_gateway):
    """The relay never starts (the response's head could not be sent): its replica reply, lease and reader are let
    go all the same, so the replica does not generate for nobody."""

    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "stall_midstream")
        app = gw.client._transport.app  # type: ignore[attr-defined]
        body = json.dumps(chat(stream=True)).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 50000), "server": ("gateway", 80)}
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await asyncio.sleep(60)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                raise OSError("the client is gone")

        with pytest.raises(OSError):
            await asyncio.wait_for(app(scope, receive, send), 5.0)
        assert gw.replicas.streams and gw.replicas.streams[-1].closed
        assert set(gw.outstanding().values()) == {0}

    with_gateway(scenario)
