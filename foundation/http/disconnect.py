"""Doing work for a client that may leave: run it while watching for `http.disconnect`, cancel it if one comes.

The replica apps use it around a whole non-streamed generation and around waiting for a stream's first token;
the gateway around forwarding, until a stream's first byte. Cancelling the work is how the client's departure
travels on: the engine iterator closes (the request is aborted, its KV blocks freed), or the gateway closes its
connection to the replica, which sees its own client leave. Once a streamed response has started, Starlette's
StreamingResponse watches for the disconnect itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from starlette.requests import ClientDisconnect, Request

from foundation.http.errors import APIError

log = structlog.get_logger(__name__)
T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


async def read_body(request: Request) -> bytes:
    """The whole request body. A client that disconnects before it has sent it all (Starlette raises ClientDisconnect)
    gets a 499 that nobody reads: it is no error of the server's, so none is logged and no traceback printed."""
    try:
        return await request.body()
    except ClientDisconnect:
        log.info("client disconnected while sending its request", path=request.url.path)
        raise APIError(CLIENT_CLOSED_REQUEST, "the client disconnected while sending its request") from None


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run `work()`; cancel it (None) if the client disconnects first. What `work()` raises is raised as is.

    The body must have been read: the next ASGI message is then `http.disconnect`, which servers send when the
    client closes the connection (uvicorn) or once the response is complete (test transports). Plain asyncio, not
    an anyio task group: this wraps every request, and on a replica the HTTP thread shares the GIL with the engine
    loop, so each extra hop through the event loop there is paid for in interactive latency.
    """
    host = asyncio.current_task()
    assert host is not None, "until_disconnect runs inside a task"
    left = False

    async def watch() -> None:
        nonlocal left
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("client disconnected; aborting", path=request.url.path)
        left = True
        host.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work()
    except asyncio.CancelledError:
        if left and host.uncancel() == 0:  # cancelled by the watcher alone: the client left
            return None
        raise
    finally:
        watcher.cancel()
