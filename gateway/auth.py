"""Who may call what. With API keys configured (`gateway.api_keys_env`), `/v1/*` needs `Authorization: Bearer <key>`
and `OPERATOR_PATHS` (metrics, per-replica health) need a key or the admin token; `/health` and `/ready` stay open.
The caller's key goes to the request's context, where the router reads its models, default lane and tenant, and
the rate limiter its limits. The admin API checks its own token (gateway/admin.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from foundation.http.errors import APIError, error_response
from gateway.auth_keys import ApiKey, bearer_token, token_matches
from gateway.context import request_context

OPERATOR_PATHS = frozenset({"/metrics", "/health/models"})


class AuthMiddleware:
    """401 for a missing or unknown key. `keys()` and `admin_token()` are read per request: a registry edit may
    change them while the gateway runs."""

    def __init__(self, app: ASGIApp, keys: Callable[[], Mapping[str, ApiKey]],
                 admin_token: Callable[[], str | None] = lambda: None) -> None:
        self.app = app
        self.keys, self.admin_token = keys, admin_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.keys() if scope["type"] == "http" else None
        path = scope.get("path", "")
        if not keys or not (path.startswith("/v1/") or path in OPERATOR_PATHS):
            await self.app(scope, receive, send)
            return
        token = bearer_token(Headers(scope=scope).get("authorization", ""))
        key = keys.get(token)
        if key is None and not (path in OPERATOR_PATHS and self._is_admin(token)):
            error = APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                             code="invalid_api_key")
            await error_response(error)(scope, receive, send)
            return
        if key is not None:
            context = request_context(scope)
            context.key, context.key_token = key, token
        await self.app(scope, receive, send)

    def _is_admin(self, token: str) -> bool:
        return token_matches(token, self.admin_token())
