"""The one limit on a request body's size, for the gateway and for every replica: 413 naming the limit."""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from foundation.http.errors import APIError, error_response


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes()` (read per request: a registry edit may change it), by Content-Length up
    front or by counting a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: Callable[[], int]) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes()
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await error_response(_too_big(limit))(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _too_big(limit)
            return message

        await self.app(scope, counting_receive, send)


def _too_big(limit: int) -> APIError:  # built only when needed: not on every request's path
    return APIError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
