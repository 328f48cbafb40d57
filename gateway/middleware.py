"""Gateway middleware, one concern each, as plain ASGI callables.

Order (outermost first): RequestId -> AccessLog -> BodySizeLimit (foundation/http/body_limit.py, shared with
the replicas) -> Auth (gateway/auth.py) -> RateLimit (gateway/limits.py) [-> Traffic (gateway/traffic.py)].
Errors they raise themselves are answered in OpenAI's shape through the shared error mapping; what they learn
about a request goes to its context (gateway/context.py).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable

import structlog
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.context import request_context

log = structlog.get_logger("multiserve.access")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestIdMiddleware:
    """Accept a sane `X-Request-ID` or make one; echo it on the response and bind it to log lines."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        request_context(scope).request_id = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            await self.app(scope, receive, send_with_id)


class AccessLogMiddleware:
    """One structured line per request: method, path, status, latency, and the model and replica that served
    it (the request's context)."""

    def __init__(self, app: ASGIApp, clock: Callable[[], float] = time.perf_counter) -> None:
        self.app = app
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = self.clock()
        status = {"code": 500}

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            extra = request_context(scope).log_fields()
            log.info("request", method=scope["method"], path=scope["path"], status=status["code"],
                     latency_ms=round((self.clock() - start) * 1000, 2), **extra)
