"""A small keep-alive HTTP/1.1 client for the gateway's hop to plain http:// replicas: asyncio protocol
callbacks and httptools' response parser (llhttp, the one uvicorn parses requests with), nothing more.

Why not httpx here: through httpx (httpcore, anyio streams, h11) that hop was 60-65 % of the gateway's own
time per request, and the gateway's added latency missed its 1 ms goal (docs/benchmarks.md). This client does
only what the forwarder needs: POST a body, return once the reply's head is in, hand over its body whole or
chunk by chunk as it arrives.

A replica is only semi-trusted (buggy, hung or compromised): nothing it sends may stall the event loop, grow
without bound, or be taken for the reply to another request.

What must stay true:
- One request at a time per connection. A connection goes back to its host's idle list only after a whole,
  well-formed reply with nothing after it, and when the replica allows keep-alive. A reply closed early
  (`aclose` before its end, a timeout, a cancelled caller), a malformed one, one that passes a limit while it
  arrives, or bytes after a reply (in the same read or while idle) close the connection; closing is how a
  replica learns that its client left.
- A request is written at most once. An idle connection is reused for at most `max_idle_s` (below uvicorn's
  5 s keep-alive), and only if a poll of its socket just before the write finds it open with nothing unread.
  Once written, a connection that closes before the reply is an `UpstreamError` with `maybe_sent` set: the
  replica may have read the request, so it is never resent here.
- Every reply says where its body ends (content-length or chunked; 204 and 304 have none). One that would
  run until the connection closes is refused: its end cannot be told from a cut.
- What a replica may send is bounded, counted as it arrives in constant time per callback: header fields per
  head, bytes of status lines and headers (interim 1xx heads included), and the bytes of a body read whole
  by `aread`. A streamed reply read slower than it arrives instead stops the socket reading past
  `_HIGH_WATER_BYTES` buffered; `aread` drains as data comes.
- Failures are `UpstreamError`, naming any limit; timeouts (connect, or `read_s` without a byte of the reply)
  `UpstreamTimeout`. Only a failure to connect has `maybe_sent` clear.
"""

from __future__ import annotations

import asyncio
import base64
import select
import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import NamedTuple, cast
from urllib.parse import SplitResult, unquote_to_bytes, urlsplit

import httptools

from gateway.upstream import MAX_REPLY_BYTES, Timeouts, UpstreamError, UpstreamTimeout

_HIGH_WATER_BYTES = 1 << 20  # buffered body bytes at which a streamed reply stops reading its socket
_LOW_WATER_BYTES = 256 << 10  # and resumes when the reader has taken it back under this


class KeepAliveClient:
    """`gateway.upstream.Upstream` for http:// URLs, with a LIFO list of idle connections per host.

    Limits on what a replica may send (defaults in line with Envoy's and nginx's): `max_header_fields` per
    head, `max_head_bytes` of status lines and headers, `max_body_bytes` of a body read whole with `aread`.
    """

    def __init__(self, max_idle_s: float = 4.0, max_idle_per_host: int = 256,
                 clock: Callable[[], float] = time.monotonic, *, max_header_fields: int = 100,
                 max_head_bytes: int = 64 << 10, max_body_bytes: int = MAX_REPLY_BYTES) -> None:
        for name, value in (("max_header_fields", max_header_fields), ("max_head_bytes", max_head_bytes),
                            ("max_body_bytes", max_body_bytes)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.max_idle_s, self.max_idle_per_host, self.clock = max_idle_s, max_idle_per_host, clock
        self.max_header_fields, self.max_head_bytes = max_header_fields, max_head_bytes
        self.max_body_bytes = max_body_bytes
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(self, url: str, content: bytes, headers: Mapping[str, str], timeouts: Timeouts) -> Reply:
        """POST `content` and return once the reply's head is in. The request is written once, on one
        connection: a failure after that is not retried here, and says `maybe_sent`."""
        target = _target(url)
        data = _request_head(target, len(content), headers) + content
        connection = await self._acquire(target.host, target.port, timeouts.connect_s)
        reply = connection.send(data, timeouts.read_s)
        try:
            await reply.wait_head()
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
            if now - connection.idle_since < self.max_idle_s and connection.in_step():
                return connection
            connection.close()
        loop = asyncio.get_running_loop()
        try:  # a timeout scope: wait_for would drop a cancellation that comes as the connection does
            async with asyncio.timeout(connect_s):
                _, connection = await loop.create_connection(lambda: _Connection(self, (host, port)), host, port)
        except TimeoutError:  # nothing was written: `maybe_sent` is clear
            raise UpstreamTimeout(f"connecting to {host}:{port} took over {connect_s:g} s",
                                  maybe_sent=False) from None
        except OSError as err:
            raise UpstreamError(f"connecting to {host}:{port} failed: {err!r}", maybe_sent=False) from err
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


class _Connection(asyncio.Protocol):
    """One keep-alive connection: the socket's callbacks feed the parser, whose callbacks feed the reply."""

    def __init__(self, client: KeepAliveClient, key: tuple[str, int]) -> None:
        self.client, self.key = client, key
        self.transport: asyncio.Transport | None = None
        self.readable = select.poll()  # on the socket's descriptor, for `in_step`
        self.parser = httptools.HttpResponseParser(self)
        self.reply: Reply | None = None  # the request in flight, until its reply is whole
        self.keep_alive = False  # whether the replica allows another request after the reply just ended
        self.lost = False
        self.idle_since = 0.0

    def send(self, data: bytes, read_s: float) -> Reply:
        assert self.transport is not None and self.reply is None, "a connection carries one request at a time"
        self.reply = Reply(self, read_s, self.client.max_body_bytes)
        self.transport.write(data)
        return self.reply

    def in_step(self) -> bool:
        """Whether this idle connection may carry a request: open, with nothing unread. Asked just before the
        write, because a close or stray bytes may have arrived since the loop last looked. A zero-timeout poll
        of the descriptor tells (anything readable, EOF included, or an error means no) for a third of what a
        MSG_PEEK recv costs, and needs no socket object: asyncio's and uvloop's transport sockets have no recv.
        The descriptor is the transport's until it closes, and a closing transport is never polled."""
        if self.lost or self.transport is None or self.transport.is_closing():
            return False
        return not self.readable.poll(0)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.readable.register(transport.get_extra_info("socket").fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply is None:  # bytes nobody asked for: this connection is no longer in step with the replica
            self.close()
            return
        reply.started = True
        try:
            if reply.head_done:
                self.parser.feed_data(data)
            else:
                self._feed_head(reply, data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, UpstreamError) as err:
            self._end(_parse_failure(err))
            self.close()  # also where the reply had ended: the error is then in bytes after it
            return
        if reply.done:  # whole, and nothing came after it in this read
            if self.keep_alive and not self.lost:
                self.client._release(self)
            else:
                self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.client._forget(self)
        reply = self.reply
        if reply is not None:  # the request was written: the replica may have read it
            when = "mid-reply" if reply.started else "before any byte of its reply"
            self._end(UpstreamError(f"the replica closed the connection {when} ({exc!r})"))

    def _feed_head(self, reply: Reply, data: bytes) -> None:
        """Feed bytes that come before the head is whole, counted against `max_head_bytes` as they arrive, so an
        endless head is cut off at the limit rather than buffered (httptools joins a header that spans reads by
        concatenation; this bound is also what keeps that cheap). A read that crosses the limit is fed in two
        parts: if the head is not whole by the limit it is refused, else the rest (body) follows."""
        room = self.client.max_head_bytes - reply.num_head_bytes
        reply.num_head_bytes += len(data)
        if len(data) <= room:
            self.parser.feed_data(data)
            return
        view = memoryview(data)
        self.parser.feed_data(view[:room])
        if not reply.head_done:
            raise UpstreamError(f"the replica's reply head (status lines and header fields) is over "
                                f"max_head_bytes={self.client.max_head_bytes}")
        self.parser.feed_data(view[room:])

    # ------------------------------------------------------------------ httptools parser callbacks
    # An UpstreamError raised here stops the parser; data_received finds it as the parser error's context.

    def on_message_begin(self) -> None:
        if self.reply is None:  # another message in the read that ended the reply
            raise UpstreamError("the replica sent bytes after the end of its reply")

    def on_header(self, name: bytes, value: bytes) -> None:
        reply = self.reply
        assert reply is not None
        if len(reply.raw_headers) >= self.client.max_header_fields:
            raise UpstreamError(f"the replica's reply has more than max_header_fields={self.client.max_header_fields} "
                                "header fields")
        reply.raw_headers.append((name, value))

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
        assert reply is not None
        if not reply.head_done:  # the end of an interim reply
            return
        self.keep_alive = self.parser.should_keep_alive()
        self._end(None)  # data_received releases the connection once the rest of the read proves empty

    def _end(self, error: UpstreamError | None) -> None:
        reply, self.reply = self.reply, None
        if reply is None:
            return
        reply._resume_reading()
        reply.on_end(error)
        if error is not None:
            self.close()


class Reply:
    """`gateway.upstream.UpstreamReply` of `KeepAliveClient`: fed by its connection, read by the forwarder."""

    def __init__(self, connection: _Connection, read_s: float, max_body_bytes: int) -> None:
        self.connection: _Connection | None = connection  # None once the reply is whole, broken or closed
        self.read_s, self.max_body_bytes = read_s, max_body_bytes
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.num_head_bytes = 0  # bytes received before the head was whole (see _Connection._feed_head)
        self.started = self.head_done = self.done = self.paused = self.reading_whole = False
        self.high_water_bytes = _HIGH_WATER_BYTES  # buffered body bytes past which `_over_high_water` acts
        self.error: UpstreamError | None = None
        self.chunks: deque[bytes] = deque()
        self.num_buffered_bytes = 0
        self.waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ fed by the connection

    def on_head(self, status: int) -> None:
        headers = _join_headers(self.raw_headers)
        if not _is_framed(status, headers):
            raise UpstreamError(f"the replica's {status} reply has neither content-length nor chunked "
                                "transfer-encoding: its end could not be told from a cut")
        self.status_code, self.headers, self.head_done = status, headers, True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.num_buffered_bytes += len(body)
        if self.num_buffered_bytes > self.high_water_bytes:
            self._over_high_water()
        self._wake()

    def on_end(self, error: UpstreamError | None) -> None:
        self.connection, self.done, self.error = None, True, error
        self._wake()

    def _over_high_water(self) -> None:
        if self.reading_whole:  # `aread` takes every byte as it comes, so this is the body's size
            raise self._over_max_body()
        connection = self.connection
        if not self.paused and connection is not None:  # a stream read slower than it arrives
            assert connection.transport is not None
            connection.transport.pause_reading()
            self.paused = True

    def _over_max_body(self) -> UpstreamError:
        return UpstreamError(f"the replica's reply body is over max_body_bytes={self.max_body_bytes}")

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
        if self.paused and self.num_buffered_bytes < _LOW_WATER_BYTES:
            self._resume_reading()
        return chunk

    async def aread(self) -> bytes:
        """The whole body. It is taken as it arrives, without back-pressure, up to `max_body_bytes`."""
        self.reading_whole, self.high_water_bytes = True, self.max_body_bytes
        if self.num_buffered_bytes > self.max_body_bytes:  # buffered before this call
            self._abort(self._over_max_body())
        self._resume_reading()
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

    def _abort(self, error: UpstreamError) -> None:
        if self.connection is not None:
            self.connection._end(error)  # closes it and ends the reply with `error`
        else:  # the reply is whole and its connection in step (maybe idle again): only the reader fails
            self.error = error

    def _resume_reading(self) -> None:
        connection = self.connection
        if self.paused and connection is not None and not connection.lost:
            assert connection.transport is not None
            connection.transport.resume_reading()
            self.paused = False

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


def _parse_failure(err: Exception) -> UpstreamError:
    """The `UpstreamError` for what stopped the parser: one a callback raised (a limit), or the reply itself."""
    if isinstance(err, UpstreamError):
        return err
    if isinstance(err.__context__, UpstreamError):
        return err.__context__
    if isinstance(err, httptools.HttpParserUpgrade):
        return UpstreamError("the replica switched protocols, which the gateway never asks for")
    cause = f" ({err.__context__!r})" if err.__context__ is not None else ""
    return UpstreamError(f"the replica's reply is not valid HTTP/1.1: {err}{cause}")


def _join_headers(raw_headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """Lower-case names to values, a repeated name's values joined with ", " (RFC 9110 §5.3), in linear time:
    each repeat is appended to a list and every list joined once."""
    headers: dict[str, str] = {}
    repeated: dict[str, list[str]] = {}
    for name, value in raw_headers:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        if key not in headers:
            headers[key] = text
        elif key in repeated:
            repeated[key].append(text)
        else:
            repeated[key] = [headers[key], text]
    for key, texts in repeated.items():
        headers[key] = ", ".join(texts)
    return headers


def _is_framed(status: int, headers: Mapping[str, str]) -> bool:
    """Whether a reply says where its body ends (RFC 9112 §6.3): no body, a content-length, or chunked as the
    last transfer coding. Anything else runs until the connection closes."""
    if status in (204, 304) or "content-length" in headers:
        return True
    return headers.get("transfer-encoding", "").rstrip().lower().endswith("chunked")


class _Target(NamedTuple):
    host: str
    port: int
    head: bytes  # the request line and the Host header
    authorization: bytes  # an Authorization header line for the URL's user and password, or b""


@lru_cache(maxsize=1024)
def _target(url: str) -> _Target:
    """Where an http:// URL points, and the start of a request's head for it."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"KeepAliveClient speaks plain http:// only, got {url!r}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rpartition("@")[2]  # the Host header never carries the URL's user and password
    head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\n".encode("latin-1")
    return _Target(parts.hostname, parts.port or 80, head, _basic_authorization(parts))


def _basic_authorization(parts: SplitResult) -> bytes:
    """The `Authorization: Basic` line (RFC 7617) for a URL's percent-decoded `user:password@`, or b""."""
    if parts.username is None:
        return b""
    user_pass = unquote_to_bytes(parts.username) + b":" + unquote_to_bytes(parts.password or "")
    return b"authorization: Basic " + base64.b64encode(user_pass) + b"\r\n"


def _request_head(target: _Target, num_body_bytes: int, headers: Mapping[str, str]) -> bytes:
    lines = [f"{name}: {value}\r\n" for name, value in headers.items()]
    text = "".join(lines)
    if text.count("\n") != len(lines) or "\r" in text.replace("\r\n", ""):
        raise ValueError(f"header names and values must not contain line breaks: {dict(headers)!r}")
    head = target.head
    if target.authorization and not any(name.lower() == "authorization" for name in headers):
        head += target.authorization  # the caller's own authorization, if any, is the one sent
    return head + f"{text}content-length: {num_body_bytes}\r\n\r\n".encode("latin-1")
