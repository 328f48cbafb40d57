"""The shared secret between a gateway and the replicas it launched.

A replica listens on loopback, where any process of the host could reach it and skip the gateway's API keys, rate
limits and lanes. So the gateway's launcher gives each worker it starts a fresh random token, in the environment
variable named by `foundation.http.wire.REPLICA_TOKEN_ENV` (never on the command line, which every user of the
host can read), and the worker refuses any request without `Authorization: Bearer <token>` with a 401, except
`GET /health` and `GET /ready`, which say nothing but whether it is up.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from foundation.http.errors import APIError, error_response

OPEN_PATHS = frozenset({"/health", "/ready"})


def bearer(token: str | None) -> dict[str, str]:
    """The header that carries `token` to a replica (none for a replica without one)."""
    return {} if not token else {"authorization": f"Bearer {token}"}


class ReplicaTokenMiddleware:
    """401 for any HTTP request but the open probes unless it carries the launch token."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        if not token:
            raise ValueError("a replica token must not be empty")
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "this replica only serves its gateway: the launch token is missing or wrong",
                         code="invalid_replica_token")
        await error_response(error)(scope, receive, send)
