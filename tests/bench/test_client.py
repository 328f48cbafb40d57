"""One streamed request, timed on a fake clock against a mock OpenAI server."""

import asyncio
import json

import httpx
import pytest

from bench.client import Target, send_streaming


class TickClock:
    """Advances 0.1 s each time it is read: the n-th event is seen at a known time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.1
        return self.now


def sse(*events: dict, done: bool = True) -> bytes:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


async def send(body: bytes, status: int = 200, endpoint: str = "chat"):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        result = await send_streaming(http, Target("http://server/v1", "m", endpoint), "hello", 8, TickClock())
    return result, seen[0]


def test_usage_from_the_final_chunk_and_token_timing():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}}
    result, body = asyncio.run(send(sse(role, chunk("a"), chunk("b"), chunk("c"), usage)))
    assert body["stream_options"] == {"include_usage": True} and body["messages"][0]["content"] == "hello"
    assert result.ok and result.usage_reported
    assert (result.num_prompt_tokens, result.num_output_tokens) == (11, 3)
    # clock reads: sent 0.1, role 0.2, a 0.3, b 0.4, c 0.5, usage 0.6, end 0.7
    assert result.ttft_s == pytest.approx(0.2)
    assert result.itl_s == pytest.approx([0.1, 0.1])
    assert result.e2e_s == pytest.approx(0.6)
    assert result.tpot_s == pytest.approx((0.6 - 0.2) / 2)


def test_without_usage_output_is_counted_in_chunks():
    completion = {"choices": [{"index": 0, "text": "x"}]}
    result, body = asyncio.run(send(sse(completion, completion), endpoint="completions"))
    assert body["prompt"] == "hello"
    assert not result.usage_reported and result.num_output_tokens == 2


def test_error_status_is_a_result_not_an_exception():
    result, _ = asyncio.run(send(b'{"error": {"message": "busy"}}', status=429))
    assert result.status == 429 and not result.ok and "busy" in result.error


def test_an_error_event_midstream_fails_the_request():
    result, _ = asyncio.run(send(sse(chunk("a"), {"error": {"message": "replica failed"}})))
    assert not result.ok and result.error == "replica failed"


def test_connection_failure_has_status_zero():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as http:
            return await send_streaming(http, Target("http://server", "m"), "hi", 4, TickClock())

    result = asyncio.run(run())
    assert result.status == 0 and "ConnectError" in result.error
