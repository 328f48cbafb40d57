"""Doing work for a client that may leave: run it while watching for `http.disconnect`, cancel it if one comes.

The replica apps use it around a whole non-streamed generation and around waiting for a stream's first token;
the gateway around forwarding, until a stream's first byte. Cancelling the work is how the client's departure
travels on: the engine iterator closes (the request is aborted, its KV blocks freed), or the gateway closes its
connection to the replica, which sees its own client leave. Once a streamed response has started, Starlette's
StreamingResponse watches for the disconnect itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import structlog
from starlette.requests import Request

log = structlog.get_logger(__name__)
T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run `work()`; cancel it (None) if the client disconnects first. What `work()` raises is raised as is.

    The body must have been read: the next ASGI message is then `http.disconnect`, which servers send when the
    client closes the connection (uvicorn) or once the response is complete (test transports).
    """
    result: T | None = None
    error: Exception | None = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            log.info("client disconnected; aborting", path=request.url.path)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result = await work()
        except Exception as exc:  # raised as itself below, not wrapped in the task group's ExceptionGroup
            error = exc
        group.cancel_scope.cancel()
    if error is not None:
        raise error
    return result
