"""Per-key rate limits at the gateway: requests per minute, and tokens per minute reserved before a request runs
(its prompt plus max_tokens, estimated from the body) and settled from its reply's usage as it passes
(policies/ratelimit.py holds the buckets and the arithmetic). 429 with Retry-After, naming the limit."""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from foundation.http.errors import APIError, error_response
from gateway.context import RequestContext, request_context
from gateway.reply_tap import ReplyTap
from gateway.request_body import request_payload
from policies.ratelimit import KeyLimits, KeyRateLimiter, Refusal, TokenEstimate, estimate_tokens

LIMITED_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}


class RateLimitMiddleware:
    """Enforces the limits of the key AuthMiddleware put in the request's context (none without keys)."""

    def __init__(self, app: ASGIApp, limiter: KeyRateLimiter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.limiter = limiter or KeyRateLimiter()
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = request_context(scope) if scope["type"] == "http" else None
        key = None if context is None else context.key
        if key is None or not key.limits.any or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        assert context is not None
        await self._run_limited(context, key.limits, scope, receive, send)

    async def _run_limited(self, context: RequestContext, limits: KeyLimits, scope: Scope, receive: Receive,
                           send: Send) -> None:
        token = context.key_token
        assert token is not None
        endpoint = LIMITED_ENDPOINTS.get(scope["path"])
        estimate = None
        if limits.tokens_per_minute is not None and endpoint is not None:
            body, receive = await _buffered(receive)
            try:
                estimate = estimate_tokens(endpoint, request_payload(scope, body))
            except APIError as error:  # not JSON: the request fails here exactly as it would further in
                await error_response(error)(scope, receive, send)
                return
        reserved = 0 if estimate is None else estimate.total
        refusal = self.limiter.admit(token, limits, self.clock(), reserved)
        if refusal is not None:
            await error_response(_rate_limited(refusal))(scope, receive, send)
            return
        if estimate is None:
            await self.app(scope, receive, send)
            return
        tap, send = context.tap_reply(send)
        try:
            await self.app(scope, receive, send)
        finally:
            self.limiter.settle(token, limits, self.clock(), reserved, _tokens_used(tap, estimate, context))


def _rate_limited(refusal: Refusal) -> APIError:
    if refusal.needed is not None:
        return APIError(429, f"rate limit: this request needs an estimated {refusal.needed} tokens (its prompt and "
                             f"max_tokens), more than this API key's {refusal.limit}={refusal.value}",
                        code="rate_limit_exceeded", retry_after_s=refusal.retry_after_s)
    return APIError(429, f"rate limit: this API key is over its {refusal.limit}={refusal.value}",
                    code="rate_limit_exceeded", retry_after_s=refusal.retry_after_s)


def _tokens_used(tap: ReplyTap, estimate: TokenEstimate, context: RequestContext) -> int:
    """What a finished request cost: its reply's usage; for a stream without one, its prompt as the replica
    counted it (or as estimated) plus its content events; for a whole reply cut short (504, 499), its prompt as
    estimated plus the tokens its replicas reported generating; nothing for a refusal."""
    prompt, output, source = tap.counts(context.prompt_tokens, context.generated_tokens)
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
