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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.traffic import ReplyTap
from policies.classify import parse_lane
from policies.ratelimit import KeyLimits, KeyRateLimiter
from runtimes.server.errors import APIError, error_response

log = structlog.get_logger("multiserve.access")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _state(scope: Scope) -> dict:
    return scope.setdefault("state", {})


def bearer_token(authorization: str) -> str:
    """The token of an `Authorization: Bearer <token>` header value ("" for any other value)."""
    return authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""


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
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(self._too_big())(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_big()
            return message

        await self.app(scope, counting_receive, send)

    def _too_big(self) -> APIError:  # built only when needed: not on every request's path
        return APIError(413, f"request body exceeds the gateway limit of {self.max_bytes} bytes",
                        code="body_too_large")


class ApiKey(BaseModel):
    """What one API key may do: its models (None: all), default lane, tenant class and rate limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    models: frozenset[str] | None = None
    priority: int | str | None = None  # the lane of its requests unless they say otherwise (policies/classify.py)
    tenant: str | None = None  # picks a model's `variants` entry
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)

    @field_validator("priority")
    @classmethod
    def _lane(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            parse_lane(value)  # ValueError naming the lanes
        return value

    @property
    def limits(self) -> KeyLimits:
        return KeyLimits(self.requests_per_minute, self.tokens_per_minute)


class ApiKeyMiddleware:
    """When keys are configured, `/v1/*` needs `Authorization: Bearer <key>`. The key's allowed models go to
    `scope["state"]["allowed_models"]`, its default lane and tenant to `key_priority` and `tenant`, for the
    router; its requests/min and tokens/min limits are enforced here (429 with Retry-After), tokens charged
    from each reply's usage as it passes."""

    def __init__(self, app: ASGIApp, keys: Mapping[str, ApiKey], limiter: KeyRateLimiter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.keys = dict(keys)
        self.limiter = limiter or KeyRateLimiter()
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        key = bearer_token(Headers(scope=scope).get("authorization", ""))
        spec = self.keys.get(key)
        if spec is None:
            error = APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                             code="invalid_api_key")
            await error_response(error)(scope, receive, send)
            return
        state = _state(scope)
        state["allowed_models"], state["key_priority"], state["tenant"] = spec.models, spec.priority, spec.tenant
        limits = spec.limits
        if not limits.any or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        refusal = self.limiter.admit(key, limits, self.clock())
        if refusal is not None:
            error = APIError(429, f"rate limit: this API key is over its {refusal.limit}={refusal.value}",
                             code="rate_limit_exceeded", retry_after_s=refusal.retry_after_s)
            await error_response(error)(scope, receive, send)
            return
        await self._run_charged(key, limits, scope, receive, send)

    async def _run_charged(self, key: str, limits: KeyLimits, scope: Scope, receive: Receive, send: Send) -> None:
        if limits.tokens_per_minute is None:
            await self.app(scope, receive, send)
            return
        tap = ReplyTap()

        try:
            await self.app(scope, receive, tap.wrap(send))
        finally:
            prompt, output, _ = tap.counts()
            self.limiter.charge_tokens(key, limits, self.clock(), (prompt or 0) + (output or 0))


def parse_api_keys(raw: str | None) -> dict[str, ApiKey]:
    """API keys as JSON (from the environment variable the registry names): key -> `"*"` (every model),
    a list of models, or an object with `models`, `priority`, `tenant`, `requests_per_minute`,
    `tokens_per_minute`. Errors name the key and the field."""
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"API keys must be a JSON object of key -> \"*\", [models] or {{...}}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError("API keys must be a JSON object of key -> \"*\", [models] or {...}")
    keys = {}
    for index, (key, value) in enumerate(data.items()):
        spec = {"models": None if value == "*" else value} if isinstance(value, (str, list)) else value
        if isinstance(spec, dict) and spec.get("models") == "*":
            spec = {**spec, "models": None}
        try:
            keys[str(key)] = ApiKey.model_validate(spec)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(map(str, first["loc"])) or "(value)"
            raise ValueError(f"API key #{index + 1}: {field}: {first['msg']}") from None
    return keys
