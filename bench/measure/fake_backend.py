"""A fast fake OpenAI backend for gateway benchmarks: a raw ASGI app, no model, no delays.

GET /ready and /health answer 200; POST /v1/chat/completions and /v1/completions answer a small fixed
OpenAI-shaped JSON, or with `"stream": true` a fixed SSE stream of `--chunks` chunks then `[DONE]`.
Anything else is 404. Served by uvicorn (no access log), so its cost per request is uvicorn's plus a
`json.loads` of the request body. With `--protocol` it answers a gateway that asks for token ids
(`x-multiserve-resumable: 1`) as a multiserve replica does (foundation/http/wire.py): a token-id comment line before
each streamed event, and a whole reply sent as progress (a token line per token, then the reply line and the reply):

    python -m bench.measure.fake_backend --port 9001 [--protocol]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_CREATED = int(time.time())
_JSON = [(b"content-type", b"application/json")]


def completion_body() -> bytes:
    return json.dumps({
        "id": "chatcmpl-fake", "object": "chat.completion", "created": _CREATED, "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello from the fake backend."},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16},
    }).encode()


def stream_events(chunks: int) -> list[bytes]:
    """`chunks` SSE events (role with the first token, one token each, finish_reason on the last) and [DONE]."""
    events = []
    for i in range(chunks):
        delta: dict[str, str] = {"content": f"tok{i} "}
        if i == 0:
            delta["role"] = "assistant"
        chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": _CREATED, "model": "fake",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if i == chunks - 1 else None}]}
        events.append(f"data: {json.dumps(chunk)}\n\n".encode())
    events.append(b"data: [DONE]\n\n")
    return events


def with_token_ids(events: list[bytes]) -> list[bytes]:
    """The events, each but `[DONE]` after a token-id line (ids 100, 101, ...)."""
    return [f": multiserve-tokens {100 + i}\n".encode() + event for i, event in enumerate(events[:-1])] + events[-1:]


def progress_body(body: bytes, chunks: int) -> bytes:
    """A whole reply as progress: a token line for each token but the last, then the reply line and `body`."""
    lines = "".join(f": multiserve-tokens {100 + i}\n" for i in range(chunks - 1))
    return lines.encode() + b": multiserve-reply 200\n" + body


class FakeBackend:
    def __init__(self, chunks: int = 8, protocol: bool = False) -> None:
        self.body = completion_body()
        self.events = stream_events(chunks)
        self.length = [(b"content-length", str(len(self.body)).encode())]
        self.protocol = protocol
        self.tracked_events = with_token_ids(self.events)
        self.progress = progress_body(self.body, chunks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; nothing else is expected
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and path in ("/ready", "/health"):
            await _reply(send, 200, b'{"status":"ready"}')
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            payload = json.loads(await _read_body(receive) or b"{}")
            tracked = self.protocol and (b"x-multiserve-resumable", b"1") in scope["headers"]
            if payload.get("stream") is True:
                await self._stream(send, tracked)
            elif tracked:
                headers = [(b"content-type", b"application/x-multiserve-progress"), (b"x-multiserve-resumable", b"1"),
                           (b"content-length", str(len(self.progress)).encode())]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": self.progress})
            else:
                await send({"type": "http.response.start", "status": 200, "headers": [*_JSON, *self.length]})
                await send({"type": "http.response.body", "body": self.body})
        else:
            await _reply(send, 404, b'{"error":{"message":"not found"}}')

    async def _stream(self, send: Send, tracked: bool) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        if tracked:
            headers.append((b"x-multiserve-resumable", b"1"))
        events = self.tracked_events if tracked else self.events
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for event in events[:-1]:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": events[-1]})


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _reply(send: Send, status: int, body: bytes) -> None:
    headers = [*_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--chunks", type=int, default=8, help="content chunks per streamed reply")
    parser.add_argument("--protocol", action="store_true",
                        help="answer a gateway's request for token ids as a multiserve replica does")
    args = parser.parse_args(argv)
    uvicorn.run(FakeBackend(args.chunks, args.protocol), host=args.host, port=args.port, log_level="warning",
                access_log=False, lifespan="off", timeout_keep_alive=75)


if __name__ == "__main__":
    main()
