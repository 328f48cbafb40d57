"""Slow and abusive HTTP clients, refused at the connection: uvicorn's httptools protocol with deadlines on
reading a request and a bound on the size of its head.

uvicorn (0.54, httptools) closes a connection idle between requests (`timeout_keep_alive`, armed only after a
response) and answers 503 past `limit_concurrency`, but sets no deadline on reading a request: a client that opens
a connection and sends nothing, or sends its head or body a byte at a time (slowloris), or stops midway, keeps its
connection, its parser state and a concurrency slot for as long as it likes. Nor does it bound a head's size with
httptools (`h11_max_incomplete_event_size` is for h11 only): a header of megabytes is buffered whole.
`GuardedHttpToolsProtocol` adds, per connection:

- `header_timeout_s`: from the opening of the connection (for its first request) or from the first byte of a later
  request, until the head (request line and headers) is complete. One deadline per head: bytes arriving do not
  extend it. Past it: 408, and the connection is closed.
- `body_timeout_s`: from a complete head until the whole body has arrived, for a body that did not come with its
  head; it covers bodies the app never reads. Past it: 408 if no response has started, and the connection closed.
- `max_header_bytes`: a larger head gets 431, and the connection is closed.

A deadline runs only while the server is waiting on the client: it stops while reading is paused (the app has not
taken the body buffered so far, or a pipelined request waits its turn) and starts over when reading resumes, and a
body deadline starts only once uvicorn has sent the `100 Continue` that a client sending `Expect: 100-continue`
waits for (when the app first reads the body).

A refusal is answered only where its status line reads as the answer to the request at fault; where an earlier
response is pending or this request's response has started, the connection is just closed.

`guarded_config` builds a `uvicorn.Config` serving with this protocol, with `keep_alive_s` and `max_connections`.
The numbers come as any object with `GuardLimits`' five attributes (foundation/http/limits.py): the gateway passes
the registry's `gateway.http` (registry/schema.py `HttpLimits`), a replica the defaults.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, ClassVar, cast

import uvicorn
from starlette.types import ASGIApp
from uvicorn._types import ASGI3Application
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from foundation.http.errors import APIError, error_response
from foundation.http.limits import DEFAULT_LIMITS, GuardLimits


class _WatchedFlow(FlowControl):
    """uvicorn's flow control, also telling the protocol when reading pauses and resumes. uvicorn resumes reading
    on every `receive()` of the app, so `on_resume` also marks the app asking for the body."""

    def __init__(self, transport: asyncio.Transport, on_pause: Callable[[], None],
                 on_resume: Callable[[], None]) -> None:
        super().__init__(transport)
        self._on_pause = on_pause
        self._on_resume = on_resume

    def pause_reading(self) -> None:
        super().pause_reading()
        self._on_pause()

    def resume_reading(self) -> None:
        super().resume_reading()
        self._on_resume()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with read deadlines and a head size limit (see the module docstring).

    `settings` is bound per server by `guarded_protocol`: uvicorn builds its protocol from the class alone.
    """

    settings: ClassVar[GuardLimits] = DEFAULT_LIMITS

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # One deadline at a time suffices: the parser reads a head, then its body, then the next head.
        self._read_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # waiting for (the rest of) a request head
        self._in_body = False  # a head is complete and its body is not
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _WatchedFlow(transport, on_pause=self._disarm, on_resume=self._watch_reading)
        # From now, not from the first byte, so that a connection that never sends anything is closed too.
        self._in_head = True
        self._watch_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # A later request's head may begin inside a chunk that ends the previous request; the parser gives no offset
        # to split it at, so that chunk is not counted: such a head is bounded by max_header_bytes plus one read.
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.settings.max_header_bytes:
            self._refuse_head(_head_too_large(self.settings.max_header_bytes))
        else:
            self._watch_reading()  # a body still to come: its deadline starts here (none for a body sent whole)

    # Parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._watch_reading()  # a first request keeps the deadline armed when its connection opened

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head, self._in_body, self._head_bytes = False, True, 0  # no body: on_message_complete follows
        head_bytes = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if head_bytes <= self.settings.max_header_bytes:
            super().on_headers_complete()
            return
        # The parser is mid-feed, so refuse through uvicorn's own request cycle: it picks the app for a request in
        # this callback (that is how it answers 503 past limit_concurrency), and for this one the app is a 431.
        error = _head_too_large(self.settings.max_header_bytes)
        self.logger.warning("%s - %s: answered 431", self._peer(), error.message)
        app, self.app = self.app, _refusal_app(error)
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()
        super().on_message_complete()

    # Deadlines

    def _watch_reading(self) -> None:
        """Arm the deadline for what the server now waits to read, unless one is armed or it is not reading."""
        if self._read_timer is not None or self.flow.read_paused or self.transport.is_closing():
            return
        if self._in_head:
            self._read_timer = self.loop.call_later(self.settings.header_timeout_s, self._head_timed_out)
        elif self._in_body and not self.cycle.waiting_for_100_continue:
            self._read_timer = self.loop.call_later(self.settings.body_timeout_s, self._body_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _head_timed_out(self) -> None:
        self._read_timer = None
        timeout_s = self.settings.header_timeout_s
        self._refuse_head(_timed_out(f"request head not received within header_timeout_s={timeout_s}"))

    def _body_timed_out(self) -> None:
        self._read_timer = None
        error = _timed_out(f"request body not received within body_timeout_s={self.settings.body_timeout_s}")
        cycle = self.cycle
        # A queued (pipelined) request's turn comes after an earlier response: a status line now would answer that.
        if cycle.response_started or self.pipeline:
            self._close(error, answer=False)
            return
        cycle.disconnected = True  # the app's receive() now returns http.disconnect, and its send() writes nothing
        cycle.message_event.set()
        self._close(error, answer=True)

    # Refusals

    def _refuse_head(self, error: APIError) -> None:
        # A status line is read as the answer to the oldest unanswered request: this head's only if none is pending.
        self._close(error, answer=self.cycle is None or self.cycle.response_complete)

    def _close(self, error: APIError, *, answer: bool) -> None:
        self._disarm()
        if self.transport.is_closing():  # closed meanwhile (say, after a `connection: close` response): nothing to add
            return
        self.logger.warning("%s - %s: %s", self._peer(), error.message,
                            f"answered {error.status}" if answer else "closed without an answer")
        if answer:
            body = json.dumps(error.payload()).encode()
            head = [STATUS_LINE[error.status]]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
        self.transport.close()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "unknown client"


def _timed_out(message: str) -> APIError:
    return APIError(408, message, type="invalid_request_error", code="request_timeout")


def _head_too_large(max_header_bytes: int) -> APIError:
    return APIError(431, f"request head exceeds max_header_bytes={max_header_bytes}", type="invalid_request_error",
                    code="request_header_fields_too_large")


def _refusal_app(error: APIError) -> ASGI3Application:
    response = error_response(error)
    response.headers["connection"] = "close"  # uvicorn then closes the connection once this is sent
    return cast(ASGI3Application, response)


def guarded_protocol(settings: GuardLimits) -> type[GuardedHttpToolsProtocol]:
    """A `GuardedHttpToolsProtocol` class bound to `settings`, for `uvicorn.Config(http=...)`."""

    class BoundGuardedHttpToolsProtocol(GuardedHttpToolsProtocol):
        pass

    BoundGuardedHttpToolsProtocol.settings = settings
    return BoundGuardedHttpToolsProtocol


# Set from the guard's own arguments: the same keyword in **uvicorn_kwargs would silently disagree with them.
_GUARD_OWNED_KWARGS = frozenset({"http", "timeout_keep_alive", "limit_concurrency"})


def guarded_config(app: ASGIApp | str, *, host: str, port: int, limits: GuardLimits | None = None,
                   **uvicorn_kwargs: Any) -> uvicorn.Config:
    """A `uvicorn.Config` serving `app` over `GuardedHttpToolsProtocol` with `limits` (see the module docstring;
    None: the defaults).

    `limits.keep_alive_s`: a connection idle this long after a response is closed (uvicorn's `timeout_keep_alive`).
    `limits.max_connections` (None: no cap): at most this many connections are served at once. uvicorn decides per
    request, once its head is complete: a request gets 503 (uvicorn's `text/plain` "Service Unavailable", and its
    connection is closed) while more than `max_connections` connections are open, its own included, and idle
    kept-alive ones and ones still sending a head too (those hold a place for up to `header_timeout_s`), or while
    more than `max_connections` request handlers run (one whose client has gone counts until it returns).
    Connections past the cap are still accepted: each gets its 503 when it sends a request.
    Other keyword arguments go to `uvicorn.Config` as they are.
    """
    owned = sorted(_GUARD_OWNED_KWARGS & uvicorn_kwargs.keys())
    if owned:
        raise TypeError(f"guarded_config sets {', '.join(owned)} from its own arguments; do not pass them")
    settings = limits or DEFAULT_LIMITS
    # uvicorn refuses a request once len(connections) >= limit_concurrency, its own connection included, so
    # limit_concurrency=N would serve only N - 1 connections.
    limit_concurrency = None if settings.max_connections is None else settings.max_connections + 1
    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(settings),
                          # typed int, but uvicorn only hands it to loop.call_later, which takes seconds as a float
                          timeout_keep_alive=cast(int, settings.keep_alive_s),
                          limit_concurrency=limit_concurrency, **uvicorn_kwargs)
