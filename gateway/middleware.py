"""Gateway middleware, one concern each, as plain ASGI callables.

Order (outermost first): RequestId -> AccessLog -> BodySizeLimit -> ApiKeys. Errors they raise
themselves are answered in OpenAI's shape through the shared error mapping.
"""

from __future__ import annotations

import hmac
import json
import re
import time
import uuid
from collections.abc import Callable, Mapping

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.request_body import parse_json_object
from gateway.traffic import ReplyTap
from policies.classify import parse_lane
from policies.ratelimit import KeyLimits, KeyRateLimiter, Refusal, TokenEstimate, estimate_tokens
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
    return APIError(413, f"request body exceeds the gateway limit of {limit} bytes", code="body_too_large")


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
    """When keys are configured, `/v1/*` needs `Authorization: Bearer <key>`, and `OPERATOR_PATHS` (metrics, per
    replica health) need a key or the admin token. The key's allowed models go to `scope["state"]["allowed_models"]`,
    its default lane and tenant to `key_priority` and `tenant`, for the router; its requests/min and tokens/min
    limits are enforced here (429 with Retry-After). A request's tokens are reserved before it runs (its prompt
    plus max_tokens, estimated from the body) and settled from its reply's usage as it passes.

    `keys()` and `admin_token()` are read per request: a registry edit may change them while the gateway runs.
    """

    def __init__(self, app: ASGIApp, keys: Callable[[], Mapping[str, ApiKey]],
                 admin_token: Callable[[], str | None] = lambda: None, limiter: KeyRateLimiter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.keys, self.admin_token = keys, admin_token
        self.limiter = limiter or KeyRateLimiter()
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.keys() if scope["type"] == "http" else None
        path = scope.get("path", "")
        if not keys or not (path.startswith("/v1/") or path in OPERATOR_PATHS):
            await self.app(scope, receive, send)
            return
        key = bearer_token(Headers(scope=scope).get("authorization", ""))
        spec = keys.get(key)
        if path in OPERATOR_PATHS and (spec is not None or self._is_admin(key)):
            await self.app(scope, receive, send)
            return
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
        await self._run_limited(key, limits, scope, receive, send)

    def _is_admin(self, key: str) -> bool:
        token = self.admin_token()
        return token is not None and token != "" and hmac.compare_digest(key.encode(), token.encode())

    async def _run_limited(self, key: str, limits: KeyLimits, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = LIMITED_ENDPOINTS.get(scope["path"])
        estimate, body = None, b""
        if limits.tokens_per_minute is not None and endpoint is not None:
            body, receive = await _buffered(receive)
            try:
                estimate = estimate_tokens(endpoint, parse_json_object(body))
            except APIError as error:  # not JSON: the request fails here exactly as it would further in
                await error_response(error)(scope, receive, send)
                return
        reserved = 0 if estimate is None else estimate.total
        refusal = self.limiter.admit(key, limits, self.clock(), reserved)
        if refusal is not None:
            await error_response(_rate_limited(refusal))(scope, receive, send)
            return
        if estimate is None:
            await self.app(scope, receive, send)
            return
        tap = ReplyTap()
        try:
            await self.app(scope, receive, tap.wrap(send))
        finally:
            self.limiter.settle(key, limits, self.clock(), reserved, _tokens_used(tap, estimate))


OPERATOR_PATHS = frozenset({"/metrics", "/health/models"})
LIMITED_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}


def _rate_limited(refusal: Refusal) -> APIError:
    if refusal.needed is not None:
        return APIError(429, f"rate limit: this request needs an estimated {refusal.needed} tokens (its prompt and "
                             f"max_tokens), more than this API key's {refusal.limit}={refusal.value}",
                        code="rate_limit_exceeded", retry_after_s=refusal.retry_after_s)
    return APIError(429, f"rate limit: this API key is over its {refusal.limit}={refusal.value}",
                    code="rate_limit_exceeded", retry_after_s=refusal.retry_after_s)


def _tokens_used(tap: ReplyTap, estimate: TokenEstimate) -> int:
    """What a finished request cost: its reply's usage; for a stream without one, its prompt as the replica
    counted it (or as estimated) plus its content events; nothing for a refusal."""
    prompt, output, source = tap.counts()
    if source == "none":
        return 0 if tap.status >= 400 or tap.status == 0 else estimate.total
    return (estimate.prompt if prompt is None else prompt) + (output or 0)


async def _buffered(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a `receive` that hands it to the app again before any later message."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body, replayed = b"".join(parts), False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


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
