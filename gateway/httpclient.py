"""A small keep-alive HTTP/1.1 client for the gateway's hop to plain http:// replicas: asyncio protocol
callbacks and httptools' response parser (llhttp, the one uvicorn parses requests with), nothing more.

Why not httpx here: through httpx (httpcore, anyio streams, h11) that hop was 60-65 % of the gateway's own
time per request, and the gateway's added latency missed its 1 ms goal (docs/benchmarks.md). This client does
only what the forwarder needs: POST a body, return once the reply's head is in, hand over its body whole or
chunk by chunk as it arrives.

What must stay true:
- One request at a time per connection. A connection goes back to its host's idle list only after a whole
  reply was parsed and the replica allows keep-alive; any reply closed early (`aclose` before its end, a
  timeout, a cancelled caller) closes its connection, which is how a replica learns that its client left.
- An idle connection is reused for at most `max_idle_s` (below uvicorn's 5 s keep-alive, so the replica does
  not close it as we send); one that still turns out closed before any reply byte came is replaced by a new
  connection once — the replica never read that request.
- A streamed reply read slower than it arrives stops the socket reading past `_HIGH_WATER_BYTES` buffered.
- Failures are `UpstreamError`; timeouts (connect, or `read_s` without a byte of the reply) `UpstreamTimeout`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import cast
from urllib.parse import urlsplit

import httptools

from gateway.upstream import Timeouts, UpstreamError, UpstreamTimeout

_HIGH_WATER_BYTES = 1 << 20  # buffered body bytes at which a streamed reply stops reading its socket
_LOW_WATER_BYTES = 256 << 10  # and resumes when the reader has taken it back under this


class KeepAliveClient:
    """`gateway.upstream.Upstream` for http:// URLs, with a LIFO list of idle connections per host."""

    def __init__(self, max_idle_s: float = 4.0, max_idle_per_host: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_idle_s, self.max_idle_per_host, self.clock = max_idle_s, max_idle_per_host, clock
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(self, url: str, content: bytes, headers: Mapping[str, str], timeouts: Timeouts) -> Reply:
        host, port, prefix = _target(url)
        data = _request_head(prefix, len(content), headers) + content
        while True:
            connection = await self._acquire(host, port, timeouts.connect_s)
            reply = connection.send(data, timeouts.read_s)
            try:
                await reply.wait_head()
            except _StaleConnection:
                continue  # it was closed while idle; a new connection is tried next
            except BaseException:
                await reply.aclose()
                raise
            return reply

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()

    async def _acquire(self, host: str, port: int, connect_s: float) -> _Connection:
        idle = self._idle.get((host, port))
        now = self.clock()
        while idle:
            connection = idle.pop()
            if not connection.lost and now - connection.idle_since < self.max_idle_s:
                connection.reused = True
                return connection
            connection.close()
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, (host, port)), host, port), connect_s)
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"connecting to {host}:{port} took over {connect_s:g} s") from None
        except OSError as err:
            raise UpstreamError(f"connecting to {host}:{port} failed: {err!r}") from err
        return connection

    def _release(self, connection: _Connection) -> None:
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= self.max_idle_per_host:
            connection.close()
            return
        connection.idle_since = self.clock()
        idle.append(connection)

    def _forget(self, connection: _Connection) -> None:
        idle = self._idle.get(connection.key)
        if idle is not None and connection in idle:
            idle.remove(connection)


class _StaleConnection(UpstreamError):
    """A reused connection closed before any byte of the reply: the replica dropped it while it was idle."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: the socket's callbacks feed the parser, whose callbacks feed the reply."""

    def __init__(self, client: KeepAliveClient, key: tuple[str, int]) -> None:
        self.client, self.key = client, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reply: Reply | None = None  # the request in flight, until its reply is whole
        self.reused = False
        self.lost = False
        self.idle_since = 0.0

    def send(self, data: bytes, read_s: float) -> Reply:
        assert self.transport is not None and self.reply is None, "a connection carries one request at a time"
        self.reply = Reply(self, read_s)
        self.transport.write(data)
        return self.reply

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply is None:  # bytes nobody asked for: this connection is no longer in step with the replica
            self.close()
            return
        reply.started = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._end(UpstreamError(f"the replica's reply is not valid HTTP/1.1: {err}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.client._forget(self)
        reply = self.reply
        if reply is None:
            return
        if reply.head_done and reply.close_delimited:  # a body without length ends where the connection does
            self._end(None)
        elif not reply.started and self.reused:
            self._end(_StaleConnection("the idle connection was closed by the replica"))
        else:
            self._end(UpstreamError(f"the replica closed the connection mid-reply ({exc!r})"))

    # ------------------------------------------------------------------ httptools parser callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.reply is not None
        self.reply.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.reply is not None
        status = self.parser.get_status_code()
        if status < 200:  # an interim reply (100 Continue, 103 Early Hints): the real one follows
            self.reply.raw_headers.clear()
            return
        self.reply.on_head(status)

    def on_body(self, body: bytes) -> None:
        assert self.reply is not None
        self.reply.on_body(body)

    def on_message_complete(self) -> None:
        reply = self.reply
        if reply is None or not reply.head_done:  # the end of an interim reply
            return
        self._end(None)
        if self.lost or not self.parser.should_keep_alive():
            self.close()
        else:
            self.reused = False
            self.client._release(self)

    def _end(self, error: UpstreamError | None) -> None:
        reply, self.reply = self.reply, None
        if reply is None:
            return
        if reply.paused and self.transport is not None and not self.lost:
            self.transport.resume_reading()
        reply.on_end(error)
        if error is not None:
            self.close()


class Reply:
    """`gateway.upstream.UpstreamReply` of `KeepAliveClient`: fed by its connection, read by the forwarder."""

    def __init__(self, connection: _Connection, read_s: float) -> None:
        self.connection: _Connection | None = connection  # None once the reply is whole, broken or closed
        self.read_s = read_s
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.started = self.head_done = self.done = self.paused = False
        self.close_delimited = False
        self.error: UpstreamError | None = None
        self.chunks: deque[bytes] = deque()
        self.num_buffered_bytes = 0
        self.waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ fed by the connection

    def on_head(self, status: int) -> None:
        self.status_code = status
        for name, value in self.raw_headers:
            key, text = name.decode("latin-1").lower(), value.decode("latin-1")
            self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text
        chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        self.close_delimited = not chunked and "content-length" not in self.headers
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.num_buffered_bytes += len(body)
        connection = self.connection
        if self.num_buffered_bytes > _HIGH_WATER_BYTES and not self.paused and connection is not None:
            assert connection.transport is not None
            connection.transport.pause_reading()
            self.paused = True
        self._wake()

    def on_end(self, error: UpstreamError | None) -> None:
        self.connection, self.done, self.error = None, True, error
        self._wake()

    # ------------------------------------------------------------------ read by the forwarder

    async def wait_head(self) -> None:
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self._wait()

    def aiter_raw(self) -> Reply:
        return self

    def __aiter__(self) -> Reply:
        return self

    async def __anext__(self) -> bytes:
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.done:
                raise StopAsyncIteration
            await self._wait()
        chunk = self.chunks.popleft()
        self.num_buffered_bytes -= len(chunk)
        if self.paused and self.num_buffered_bytes < _LOW_WATER_BYTES and self.connection is not None:
            assert self.connection.transport is not None
            self.connection.transport.resume_reading()
            self.paused = False
        return chunk

    async def aread(self) -> bytes:
        while not self.done:
            await self._wait()
        if self.error is not None:
            raise self.error
        body = b"".join(self.chunks)
        self.chunks.clear()
        self.num_buffered_bytes = 0
        return body

    async def aclose(self) -> None:
        """Release the reply; one not yet whole closes its connection (the replica sees its client leave)."""
        connection = self.connection
        if connection is not None:
            connection._end(UpstreamError("the reply was closed before its end"))

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        timer = loop.call_later(self.read_s, _time_out, waiter, self.read_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _time_out(waiter: asyncio.Future[None], read_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout(f"no reply bytes from the replica within {read_s:g} s"))


@lru_cache(maxsize=1024)
def _target(url: str) -> tuple[str, int, bytes]:
    """(host, port, the request line and Host header) of an http:// URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"KeepAliveClient speaks plain http:// only, got {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, parts.port or 80, f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode("latin-1")


def _request_head(prefix: bytes, num_body_bytes: int, headers: Mapping[str, str]) -> bytes:
    lines = [f"{name}: {value}\r\n" for name, value in headers.items()]
    text = "".join(lines)
    if text.count("\n") != len(lines) or "\r" in text.replace("\r\n", ""):
        raise ValueError(f"header names and values must not contain line breaks: {dict(headers)!r}")
    return prefix + f"{text}content-length: {num_body_bytes}\r\n\r\n".encode("latin-1")
