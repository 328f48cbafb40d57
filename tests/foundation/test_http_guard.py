"""The HTTP guard against slow and abusive clients: a real uvicorn server on 127.0.0.1 with the guarded protocol,
misbehaving clients on raw sockets, and limits of tenths of a second so that each test takes about one.
Every wait is bounded, so a regression fails instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pydantic
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from foundation.http.guard import GuardedHttpToolsProtocol, guarded_config
from registry.schema import HttpLimits

WAIT_S = 3.0  # bound on any single wait: far above every limit below
SLACK_S = 0.8  # how late past its limit a refusal may come on a loaded machine
STREAM_CHUNKS = 5
STREAM_GAP_S = 0.1  # so a streamed reply lasts 0.5 s, longer than the read deadlines it is tested with


# The app: a tiny Starlette app, inline


async def hello(request: Request) -> Response:
    return PlainTextResponse("hello")


async def echo(request: Request) -> Response:
    """Answers the body's length, after `wait_s` (a slow app, not a slow client)."""
    await asyncio.sleep(float(request.query_params.get("wait_s", "0")))
    return PlainTextResponse(str(len(await request.body())))


async def ignore_body(request: Request) -> Response:
    """Answers after `wait_s` without reading the body."""
    await asyncio.sleep(float(request.query_params.get("wait_s", "0")))
    return PlainTextResponse("ignored")


async def stream(request: Request) -> Response:
    async def chunks() -> AsyncIterator[bytes]:
        for index in range(STREAM_CHUNKS):
            await asyncio.sleep(STREAM_GAP_S)
            yield b"chunk %d\n" % index

    return StreamingResponse(chunks(), media_type="text/plain")


APP = Starlette(routes=[Route("/", hello), Route("/echo", echo, methods=["POST"]),
                        Route("/ignore", ignore_body, methods=["POST"]),
                        Route("/stream", stream, methods=["GET", "POST"])])
STREAMED = b"".join(b"chunk %d\n" % index for index in range(STREAM_CHUNKS))


# The server


@dataclass
class Served:
    port: int
    server: uvicorn.Server
    protocols: list[GuardedHttpToolsProtocol] = field(default_factory=list)


@contextlib.asynccontextmanager
async def serving(**limits: Any) -> AsyncIterator[Served]:
    """uvicorn with the guard on a free port; on exit, checks that no deadline or request task is left behind."""
    config = guarded_config(APP, host="127.0.0.1", port=0, limits=HttpLimits(**{"max_connections": None, **limits}),
                            lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=1)
    protocols: list[GuardedHttpToolsProtocol] = []

    class Recording(config.http):
        def connection_made(self, transport: asyncio.Transport) -> None:
            protocols.append(self)
            super().connection_made(transport)

    config.http = Recording
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    served = Served(sock.getsockname()[1], server, protocols)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await until(lambda: server.started)
        yield served
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S)
    assert [p for p in protocols if p._read_timer is not None] == []
    assert [p for p in protocols if p.timeout_keep_alive_task is not None] == []
    assert not server.server_state.tasks and not server.server_state.connections


async def until(condition: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), WAIT_S)


# The clients


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        return json.loads(self.body)["error"]


@contextlib.asynccontextmanager
async def connection(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT_S)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):  # the server reset it: closed all the same
            await asyncio.wait_for(writer.wait_closed(), WAIT_S)


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    async def read() -> Reply:
        status = int((await reader.readuntil(b"\r\n")).split()[1])
        headers = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            return Reply(status, headers, await reader.readexactly(int(headers["content-length"])))
        body = b""
        while size := int(await reader.readuntil(b"\r\n"), 16):  # chunked
            body += await reader.readexactly(size + 2)
            body = body[:-2]
        await reader.readexactly(2)
        return Reply(status, headers, body)

    return await asyncio.wait_for(read(), WAIT_S)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), WAIT_S) == b""


async def send(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await asyncio.wait_for(writer.drain(), WAIT_S)


async def trickle(writer: asyncio.StreamWriter, data: bytes, gap_s: float, piece_bytes: int = 1) -> int:
    """Send `data`, one piece per `gap_s`, until the server hangs up; how many bytes went."""
    sent = 0
    try:
        while sent < len(data):
            await send(writer, data[sent:sent + piece_bytes])
            sent += piece_bytes
            await asyncio.sleep(gap_s)
    except ConnectionError:
        pass
    return sent


def head(method: str, path: str, *extra: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: test", *extra, "", ""]).encode()


async def expect_timed_out(reader: asyncio.StreamReader, started: float, limit_s: float, what: str) -> None:
    """The server answers 408 about `limit_s` after `started`, naming the limit `what`, and closes the connection."""
    reply = await read_reply(reader)
    elapsed_s = time.monotonic() - started
    assert reply.status == 408, reply
    assert reply.headers["connection"] == "close" and reply.headers["content-type"] == "application/json"
    error = reply.error()
    assert error["type"] == "invalid_request_error" and error["code"] == "request_timeout" and error["param"] is None
    assert f"{what}={limit_s}" in error["message"]
    assert limit_s * 0.9 <= elapsed_s < limit_s + SLACK_S, elapsed_s
    assert await closed_by_server(reader)


def run_on(loop: str, scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `scenario` on asyncio's own loop, or on uvloop's (what uvicorn picks in production)."""
    if loop == "uvloop":
        pytest.importorskip("uvloop").run(scenario())
    else:
        asyncio.run(scenario())


# Reading the head


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_client_that_stalls_inside_its_request_line_gets_408_and_a_closed_connection(loop):
    async def scenario() -> None:
        async with serving(header_timeout_s=0.3) as served, connection(served.port) as (reader, writer):
            started = time.monotonic()
            await send(writer, b"GET /ind")
            await expect_timed_out(reader, started, 0.3, "header_timeout_s")

    run_on(loop, scenario)


def test_a_connection_that_never_sends_a_byte_is_refused_after_the_header_timeout():
    async def scenario() -> None:
        async with serving(header_timeout_s=0.3) as served, connection(served.port) as (reader, _):
            # uvicorn alone would hold this connection for as long as the client liked
            await expect_timed_out(reader, time.monotonic(), 0.3, "header_timeout_s")

    asyncio.run(scenario())


def test_header_bytes_trickled_past_the_timeout_do_not_extend_it():
    async def scenario() -> None:
        async with serving(header_timeout_s=0.3) as served, connection(served.port) as (reader, writer):
            started = time.monotonic()
            trickler = asyncio.create_task(trickle(writer, b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 100, gap_s=0.1))
            await expect_timed_out(reader, started, 0.3, "header_timeout_s")
            assert await asyncio.wait_for(trickler, WAIT_S) < 20  # cut off long before the head could end

    asyncio.run(scenario())


# Reading the body


@pytest.mark.parametrize(("loop", "path"),
                         [("asyncio", "/echo"), ("asyncio", "/ignore?wait_s=0.7"), ("uvloop", "/echo")],
                         ids=["app-reads-the-body", "app-never-reads-it", "uvloop"])
def test_a_body_that_stalls_midway_gets_408_after_the_body_timeout(loop, path):
    async def scenario() -> None:
        async with serving(header_timeout_s=0.3, body_timeout_s=0.5) as served, \
                connection(served.port) as (reader, writer):
            started = time.monotonic()
            await send(writer, head("POST", path, "Content-Length: 100") + b"x" * 10)
            # the body's deadline, not the head's: the head's was cancelled once the head was in
            await expect_timed_out(reader, started, 0.5, "body_timeout_s")
        # the app's late answer (if any) went nowhere: the 408 was all the client saw

    run_on(loop, scenario)


def test_a_client_waiting_for_100_continue_is_not_timed_out_while_the_app_takes_its_time():
    async def scenario() -> None:
        async with serving(body_timeout_s=0.3) as served, connection(served.port) as (reader, writer):
            # the app reads the body after 0.6 s; only then does uvicorn send `100 Continue`, and only then the client
            await send(writer, head("POST", "/echo?wait_s=0.6", "Content-Length: 5", "Expect: 100-continue"))
            assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S) == b"HTTP/1.1 100 Continue\r\n\r\n"
            await send(writer, b"hello")
            reply = await read_reply(reader)
            assert (reply.status, reply.body) == (200, b"5")

    asyncio.run(scenario())


def test_a_body_the_server_stopped_reading_is_not_timed_out_meanwhile():
    async def scenario() -> None:
        body = b"x" * (1024 * 1024)  # past uvicorn's 64 KiB buffer, so reading pauses until the app reads
        async with serving(body_timeout_s=0.4) as served, connection(served.port) as (reader, writer):
            await send(writer, head("POST", "/echo?wait_s=0.8", f"Content-Length: {len(body)}") + body[:1024])
            await asyncio.sleep(0.1)  # the body's deadline runs: now reading pauses with it armed
            writer.write(body[1024:])
            reply = await read_reply(reader)
            assert (reply.status, reply.body) == (200, str(len(body)).encode())
            await asyncio.wait_for(writer.drain(), WAIT_S)

    asyncio.run(scenario())


# Well-behaved clients


def test_a_keep_alive_client_pausing_less_than_each_limit_is_served_on_one_connection():
    async def scenario() -> None:
        async with serving(header_timeout_s=0.4, body_timeout_s=0.4, keep_alive_s=2.0) as served, \
                connection(served.port) as (reader, writer):
            for index in range(3):
                # after the first: idle 0.3 s, then a head over 0.15 s, 0.45 s past the last response: fine, since a
                # later head's deadline starts at its first byte (a first head's starts when the connection opens)
                await asyncio.sleep(0.3 if index else 0)
                request = head("POST", "/echo", "Content-Length: 4")
                await send(writer, request[:10])
                await asyncio.sleep(0.15)
                await send(writer, request[10:] + b"ab")
                await asyncio.sleep(0.15)
                await send(writer, b"cd")
                reply = await read_reply(reader)
                assert (reply.status, reply.body) == (200, b"4"), index
                assert reply.headers.get("connection") != "close"

    asyncio.run(scenario())


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_streamed_reply_longer_than_the_read_deadlines_is_not_cut(method):
    async def scenario() -> None:
        async with serving(header_timeout_s=0.3, body_timeout_s=0.3) as served, \
                connection(served.port) as (reader, writer):
            await send(writer, head(method, "/stream", "Content-Length: 3") + b"abc")
            reply = await read_reply(reader)  # lasts 0.5 s
            assert (reply.status, reply.body) == (200, STREAMED)

    asyncio.run(scenario())


def test_a_stalled_pipelined_head_closes_the_connection_without_a_status_line_inside_the_reply():
    async def scenario() -> None:
        async with serving(header_timeout_s=0.3) as served, connection(served.port) as (reader, writer):
            await send(writer, head("GET", "/stream") + b"GET / HT")
            # the reply (0.5 s) is cut when the next head's deadline passes (0.3 s), but no 408 lands inside it
            received = await asyncio.wait_for(reader.read(), WAIT_S)  # until the server closes
            assert received.startswith(b"HTTP/1.1 200 OK\r\n") and received.count(b"HTTP/1.1") == 1
            assert b"408" not in received

    asyncio.run(scenario())


def test_clients_that_hang_up_midway_leave_no_deadline_behind():
    async def scenario() -> None:
        async with serving(header_timeout_s=5.0, body_timeout_s=5.0) as served:
            for partial in (b"GET / HT", head("POST", "/echo", "Content-Length: 10") + b"abc"):
                async with connection(served.port) as (_, writer):
                    await send(writer, partial)
                    await asyncio.sleep(0.1)  # for the server to read it
                    assert served.protocols[-1]._read_timer is not None  # the head's deadline, then the body's
            await until(lambda: not served.server.server_state.connections)
        # serving() checks, once the server has stopped, that no connection left a deadline armed

    asyncio.run(scenario())


# Idle connections


def test_an_idle_kept_alive_connection_is_closed_after_keep_alive_s():
    async def scenario() -> None:
        async with serving(keep_alive_s=0.3) as served, connection(served.port) as (reader, writer):
            await send(writer, head("GET", "/"))
            assert (await read_reply(reader)).status == 200
            answered = time.monotonic()
            assert await closed_by_server(reader)
            assert 0.25 <= time.monotonic() - answered < 0.3 + SLACK_S

    asyncio.run(scenario())


# Head size


def test_a_head_over_max_header_bytes_gets_431_and_one_under_it_is_served():
    async def scenario() -> None:
        async with serving(max_header_bytes=16 * 1024) as served:
            async with connection(served.port) as (reader, writer):
                await send(writer, head("GET", "/", "X-Big: " + "a" * 15_000))
                assert (await read_reply(reader)).status == 200
            async with connection(served.port) as (reader, writer):
                await send(writer, head("GET", "/", "X-Big: " + "a" * 17_000))
                reply = await read_reply(reader)
                assert reply.status == 431 and reply.headers["connection"] == "close"
                error = reply.error()
                assert error["code"] == "request_header_fields_too_large"
                assert "max_header_bytes=16384" in error["message"]
                assert await closed_by_server(reader)

    asyncio.run(scenario())


def test_a_head_that_never_ends_is_refused_before_the_server_buffers_much_more_than_the_limit():
    async def scenario() -> None:
        async with serving(max_header_bytes=16 * 1024) as served, connection(served.port) as (reader, writer):
            endless = b"GET / HTTP/1.1\r\nX-Endless: " + b"a" * (1024 * 1024)
            sender = asyncio.create_task(trickle(writer, endless, gap_s=0.01, piece_bytes=4096))
            reply = await read_reply(reader)
            assert reply.status == 431 and reply.error()["code"] == "request_header_fields_too_large"
            assert await asyncio.wait_for(sender, WAIT_S) <= 16 * 1024 + 3 * 4096  # stopped by the server

    asyncio.run(scenario())


# Connection cap


def test_max_connections_serves_that_many_connections_and_answers_503_past_them():
    async def scenario() -> None:
        async with serving(max_connections=2) as served:
            async with connection(served.port) as first, connection(served.port) as second:
                for reader, writer in (first, second):  # both stay open, kept alive
                    await send(writer, head("GET", "/"))
                    assert (await read_reply(reader)).status == 200
                async with connection(served.port) as (reader, writer):
                    await send(writer, head("GET", "/"))
                    reply = await read_reply(reader)  # uvicorn's own refusal, in plain text
                    assert (reply.status, reply.body, reply.headers["connection"]) == (503, b"Service Unavailable",
                                                                                      "close")
                    assert await closed_by_server(reader)
                await until(lambda: len(served.server.server_state.connections) == 2)
                reader, writer = second  # an open connection's next request counts the same way: it has a place
                await send(writer, head("GET", "/"))
                assert (await read_reply(reader)).status == 200
            await until(lambda: not served.server.server_state.connections)
            async with connection(served.port) as (reader, writer):  # places free up as connections close
                await send(writer, head("GET", "/"))
                assert (await read_reply(reader)).status == 200

    asyncio.run(scenario())


# Configuration


def test_guarded_config_validates_its_limits_and_keeps_its_own_keywords():
    config = guarded_config(APP, host="127.0.0.1", port=8000, limits=HttpLimits(keep_alive_s=2.5, max_connections=10))
    assert config.timeout_keep_alive == 2.5 and config.limit_concurrency == 11
    assert issubclass(config.http, GuardedHttpToolsProtocol)
    assert config.http.settings.header_timeout_s == 10.0
    assert guarded_config(APP, host="127.0.0.1", port=8000).limit_concurrency == 1001  # the default cap of 1000
    unlimited = HttpLimits(max_connections=None)
    assert guarded_config(APP, host="127.0.0.1", port=8000, limits=unlimited).limit_concurrency is None
    with pytest.raises(pydantic.ValidationError, match="header_timeout_s"):
        HttpLimits(header_timeout_s=0)
    with pytest.raises(TypeError, match="limit_concurrency"):
        guarded_config(APP, host="127.0.0.1", port=8000, limit_concurrency=5)
