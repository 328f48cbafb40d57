"""Replicas that misbehave inside the continuation protocol (tests/gateway/fakes.py scripts them): a reply over its
cap, a line that never ends, token lines and events that are not what they claim, replies that break again and
again. Each ends its client's reply with a clear error, bounded in bytes and in resends, and a reply cut short is
charged the tokens it made."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from gateway.auth_keys import ApiKey
from gateway.proxy import ProxySettings
from tests.gateway.fakes import REGISTRY, FakeGateway, Received, chat, error_of, raw_reply

REPLY = json.dumps({"id": "chatcmpl-x", "object": "chat.completion", "model": "alpha", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
ALPHA = ["alpha/0", "alpha/1"]


def event(payload: dict | str, token_ids: str | None = None) -> bytes:
    head = b"" if token_ids is None else f": multiserve-tokens {token_ids}\n".encode()
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return head + f"data: {data}\n\n".encode()


def chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 7, "model": "alpha",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def events_of(response: httpx.Response) -> list[str]:
    return [block.removeprefix("data: ") for block in response.text.split("\n\n") if block]


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


# ------------------------------------------------------------------------------------ bounds


def test_a_whole_reply_sent_as_progress_is_capped_and_never_resent(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        huge = b": multiserve-reply 200\n" + b"0" * (256 << 10)
        gw.replicas.script(ALPHA, lambda received: raw_reply(pieces(huge, 4096), progress=True))
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 502, response.text
        error = error_of(response)
        assert error["code"] == "bad_upstream_reply" and "over 65536 bytes" in error["message"]
        assert len(gw.replicas.received) == 1  # a misbehaving answer is an answer: not tried again elsewhere

    with_gateway(scenario, proxy_settings=ProxySettings(max_reply_bytes=64 << 10))


def test_a_stream_event_that_never_ends_is_cut_at_the_bound_with_an_error_event(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        endless = b'data: {"choices": [{"delta": {"content": "' + b"a" * (64 << 10)
        script = [event(chunk("tok0"), "100"), *pieces(endless, 2048)]
        gw.replicas.script(ALPHA, lambda received: raw_reply(script, progress=False))
        response = await gw.client.post("/v1/chat/completions", json=chat(stream=True))
        assert response.status_code == 200
        first, error, done = events_of(response)
        assert json.loads(first)["choices"][0]["delta"]["content"] == "tok0"
        assert json.loads(error)["error"]["code"] == "bad_upstream_reply" and done == "[DONE]"
        assert "over 16384 bytes" in json.loads(error)["error"]["message"]
        assert len(gw.replicas.received) == 1

    with_gateway(scenario, proxy_settings=ProxySettings(max_event_bytes=16 << 10))


def test_a_progress_line_that_never_ends_is_cut_at_the_bound(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        script = [b": multiserve-tokens 1\n", *pieces(b": multiserve-tokens " + b"1," * (32 << 10), 2048)]
        gw.replicas.script(ALPHA, lambda received: raw_reply(script, progress=True))
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 502 and "progress line over 16384 bytes" in error_of(response)["message"]

    with_gateway(scenario, proxy_settings=ProxySettings(max_event_bytes=16 << 10))


# ------------------------------------------------------------------------------------ malformed output


@pytest.mark.parametrize("bad", [
    event(chunk("x"), "zz"),
    event(chunk("x"), "-1"),
    event(chunk("x"), "1_000"),
    event(chunk("x"), "99999999999"),
    event({"id": "chatcmpl-x", "created": 7, "choices": [1]}, "101"),
    event({"id": "chatcmpl-x", "created": 7, "choices": [{"delta": "text"}]}, "101"),
    event("not json", "101"),
    event([1, 2], "101"),
    b": multiserve-tokens 101\n: something else\n\n",
])
def test_a_malformed_stream_event_ends_the_stream_with_an_error_event_and_done(with_gateway, bad):
    async def scenario(gw: FakeGateway) -> None:
        script = [event(chunk("tok0"), "100") + bad + event(chunk("tok2", "stop"), "102"), b"data: [DONE]\n\n"]
        gw.replicas.script(ALPHA, lambda received: raw_reply(script, progress=False))
        response = await gw.client.post("/v1/chat/completions", json=chat(stream=True))
        assert response.status_code == 200
        events = events_of(response)
        assert len(events) == 3 and json.loads(events[0])["choices"][0]["delta"]["content"] == "tok0"
        error = json.loads(events[1])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "bad_upstream_reply"
        assert events[2] == "[DONE]"
        assert len(gw.replicas.received) == 1  # not resumed: a replica that sends garbage is not chased

    with_gateway(scenario)


@pytest.mark.parametrize(("bad", "says"), [
    (b": multiserve-tokens zz\n", "not a token-id line"),
    (b": multiserve-tokens 1, 2\n", "not a token-id line"),
    (b"data: {}\n", "not a progress line"),
    (b": multiserve-reply 99999\n{}", "not a reply line"),
    (b": multiserve-reply 2OO\n{}", "not a reply line"),
    (b": multiserve-reply 200\n{\"choices\": [", "not a JSON object"),
    (b": multiserve-reply 200\n[1, 2]", "not a JSON object"),
])
def test_a_malformed_progress_reply_is_a_502(with_gateway, bad, says):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.script(ALPHA, lambda received: raw_reply([b": multiserve-tokens 100\n", bad], progress=True))
        response = await gw.client.post("/v1/chat/completions", json=chat())
        assert response.status_code == 502, response.text
        error = error_of(response)
        assert error["code"] == "bad_upstream_reply" and says in error["message"], error
        assert len(gw.replicas.received) == 1

    with_gateway(scenario)


# ------------------------------------------------------------------------------------ the resumption budget


def _breaks_after(num_new_tokens: int, progress: bool):
    """A replica that generates `num_new_tokens` more tokens than the continuation names, then drops the
    connection (before its reply line, or before the stream's end)."""

    def respond(received: Received) -> httpx.Response:
        start = len((received.body.get("multiserve_resume") or {}).get("token_ids", ()))
        ids = range(100 + start, 100 + start + num_new_tokens)
        if progress:
            chunks = [f": multiserve-tokens {i}\n".encode() for i in ids] + [b": multiserve-tok"]
        else:
            chunks = [event(chunk(f"tok{i}"), str(i)) for i in ids] + [b": multiserve-tok"]
        if not chunks[:-1]:  # a reply must begin before it can break midway
            chunks = [b": multiserve-tok"]
        return raw_reply(chunks, progress, httpx.ReadError("connection reset"))

    return respond


# (a stream that has sent no event has no id to go on with: it is not resumed at all)
@pytest.mark.parametrize(("stream", "num_new_tokens", "num_sends"), [(False, 1, 4), (False, 0, 2), (True, 1, 4)])
def test_a_reply_that_always_breaks_is_resent_at_most_max_resumes_times(with_gateway, stream, num_new_tokens,
                                                                        num_sends):
    """max_resumes=3: a reply that makes progress on every leg is sent 3 + 1 times; one that makes none costs two
    of the budget per continuation, so it is sent twice."""
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.script(ALPHA, _breaks_after(num_new_tokens, progress=not stream))
        response = await asyncio.wait_for(gw.client.post("/v1/chat/completions", json=chat(stream=stream)), 10)
        assert len(gw.replicas.received) == num_sends
        if stream:
            events = events_of(response)
            assert json.loads(events[-2])["error"]["code"] == "stream_interrupted" and events[-1] == "[DONE]"
            assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-2]] == [
                f"tok{100 + i}" for i in range(num_sends)]
        else:
            assert response.status_code == 503 and error_of(response)["code"] == "reply_interrupted"

    with_gateway(scenario, proxy_settings=ProxySettings(max_resumes=3))


def test_a_client_that_leaves_ends_the_whole_chain_of_continuations(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        left = asyncio.Event()

        def respond(received: Received) -> httpx.Response:
            if "multiserve_resume" not in received.body:
                return raw_reply([b": multiserve-tokens 100\n", b": multiserve-tok"], True, httpx.ReadError("reset"))
            left.set()  # the client leaves while the continuation runs
            return raw_reply([b": multiserve-tokens 101\n", b"unreached"], True, stall_after=1)

        gw.replicas.script(ALPHA, respond)
        task = asyncio.create_task(gw.client.post("/v1/chat/completions", json=chat()))
        await asyncio.wait_for(left.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(50):
            await asyncio.sleep(0.01)
        assert len(gw.replicas.received) == 2  # nothing is resent for a client that has gone
        assert all(r.outstanding == 0 for r in gw.pool.group("alpha").replicas)

    with_gateway(scenario)


# ------------------------------------------------------------------------------------ usage of replies cut short

TIMEOUT_REGISTRY = REGISTRY.replace("    fallbacks: [beta]\n", "    policy: {request_timeout_s: 0.3}\n")


def test_a_whole_reply_cut_short_by_its_timeout_is_charged_the_tokens_it_made(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        made = [f": multiserve-tokens {','.join(str(100 + i) for i in range(j, j + 5))}\n".encode()
                for j in range(0, 15, 5)]
        gw.replicas.script(ALPHA, lambda received: raw_reply([*made, b"unreached"], True, stall_after=3))
        headers = {"authorization": "Bearer metered"}
        body = chat(max_tokens=20)  # reserves 5 + 20 of the key's 40 tokens a minute
        first = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
        assert first.status_code == 504, first.text
        second = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
        assert second.status_code == 429, second.text  # 5 + 15 made were charged: 25 more do not fit the 40
        assert len(gw.replicas.received) == 1

    with_gateway(scenario, registry_text=TIMEOUT_REGISTRY, api_keys={"metered": ApiKey(tokens_per_minute=40)})


def test_a_whole_reply_whose_client_left_is_charged_the_tokens_it_made(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        made = [f": multiserve-tokens {','.join(str(100 + i) for i in range(15))}\n".encode()]
        gw.replicas.script(ALPHA, lambda received: raw_reply([*made, b"unreached"], True, stall_after=1))
        headers = {"authorization": "Bearer metered"}
        body = chat(max_tokens=20)
        task = asyncio.create_task(gw.client.post("/v1/chat/completions", json=body, headers=headers))
        while not gw.replicas.received:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the tokens have come
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        second = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
        assert second.status_code == 429, second.text

    with_gateway(scenario, api_keys={"metered": ApiKey(tokens_per_minute=40)})


def test_a_whole_reply_with_several_choices_is_counted_as_progress_and_retried_afresh_when_it_breaks(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("alpha/0", "break_midstream")
        gw.replicas.on_request = lambda received: gw.replicas.set("alpha/1", "ok")
        for extra in ({"n": 2}, {"logprobs": True}):
            gw.replicas.received.clear()
            response = await gw.client.post("/v1/chat/completions", json=chat(**extra))
            assert response.status_code == 200, response.text
            assert all(r.headers.get("x-multiserve-resumable") == "1" for r in gw.replicas.received)
            assert not [r for r in gw.replicas.received if "multiserve_resume" in r.body]  # never continued

    with_gateway(scenario)


def test_continuations_wait_for_a_replica_resume_wait_s_in_all_not_each(with_gateway):
    """beta's one replica breaks after a token each time and is drained as each request reaches it: the first
    continuation waits 3 s until it is back, the second only the 2 s left of the 5."""
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.script(["beta/0"], _breaks_after(1, progress=True))
        gw.replicas.on_request = lambda received: gw.pool.drain("beta/0")

        def back_after_3_s(seconds: float) -> None:
            if len(gw.replicas.received) == 1 and sum(gw.proxy_sleep.delays) >= 3.0:
                gw.pool.undrain("beta/0")

        gw.proxy_sleep.on_sleep = back_after_3_s
        response = await asyncio.wait_for(gw.client.post("/v1/chat/completions", json=chat("beta")), 10)
        assert response.status_code == 503 and error_of(response)["code"] == "reply_interrupted"
        assert len(gw.replicas.received) == 2
        assert 5.0 <= sum(gw.proxy_sleep.delays) < 6.0  # each continuation's own 5 s would have made it 8

    with_gateway(scenario, proxy_settings=ProxySettings(resume_wait_s=5.0, max_resumes=10))


def test_a_client_that_leaves_mid_progress_stops_the_reading_at_once(with_gateway):
    """The client leaves while token lines pour in (one per loop turn): its cancellation must not be lost when it
    comes just as a line does (asyncio.wait_for on Python 3.11 dropped it, and the gateway read the reply, minutes of
    generation, to its end for nobody)."""
    async def scenario(gw: FakeGateway) -> None:
        lines = [f": multiserve-tokens {i}\n".encode() for i in range(5000)]
        gw.replicas.script(ALPHA, lambda received: raw_reply(lines, progress=True))
        for _ in range(10):
            gw.replicas.streams.clear()
            task = asyncio.create_task(gw.client.post("/v1/chat/completions", json=chat()))
            while not gw.replicas.streams:
                await asyncio.sleep(0)
            for _ in range(50):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(20):
                await asyncio.sleep(0)
            [stream] = gw.replicas.streams
            assert stream.closed and stream.sent < len(lines)  # let go of at once, not read to its end
            assert all(r.outstanding == 0 for r in gw.pool.group("alpha").replicas)

    with_gateway(scenario)
