"""Gateway middleware, one concern each, as plain ASGI callables.

Order (outermost first): RequestId -> AccessLog -> BodySizeLimit -> ApiKeys. Errors they raise
themselves are answered in OpenAI's shape through the shared error mapping.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Mapping

import structlog
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtimes.server.errors import APIError, error_response

log = structlog.get_logger("multiserve.access")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _state(scope: Scope) -> dict:
    return scope.setdefault("state", {})


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
        _state(scope)["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            await self.app(scope, receive, send_with_id)


class AccessLogMiddleware:
    """One structured line per request: method, path, status, latency, and what the handler noted
    in `scope["state"]["log"]` (model, replica, tokens)."""

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
            extra = _state(scope).get("log", {})
            log.info("request", method=scope["method"], path=scope["path"], status=status["code"],
                     latency_ms=round((self.clock() - start) * 1000, 2), **extra)


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes`, by Content-Length up front or by counting a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = APIError(413, f"request body exceeds the gateway limit of {self.max_bytes} bytes",
                           code="body_too_large")
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(too_big)(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_big
            return message

        await self.app(scope, counting_receive, send)


class ApiKeyMiddleware:
    """When keys are configured, `/v1/*` needs `Authorization: Bearer <key>`; the key's allowed models
    (None: all) go to `scope["state"]["allowed_models"]` for the router to enforce."""

    def __init__(self, app: ASGIApp, keys: Mapping[str, frozenset[str] | None]) -> None:
        self.app = app
        self.keys = dict(keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        auth = Headers(scope=scope).get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if key not in self.keys:
            error = APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                             code="invalid_api_key")
            await error_response(error)(scope, receive, send)
            return
        _state(scope)["allowed_models"] = self.keys[key]
        await self.app(scope, receive, send)


def parse_api_keys(raw: str | None) -> dict[str, frozenset[str] | None]:
    """`{"key": ["model", ...] | "*"}` as JSON (from the environment variable the registry names)."""
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"API keys must be a JSON object of key -> [models] or \"*\": {err}") from err
    if not isinstance(data, dict):
        raise ValueError("API keys must be a JSON object of key -> [models] or \"*\"")
    return {str(k): None if v == "*" else frozenset(map(str, v)) for k, v in data.items()}
