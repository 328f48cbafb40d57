"""HTTP error mapping in one place: exceptions become OpenAI's `{"error": {message, type, param, code}}`.

Both the per-replica server and the gateway install these handlers, so a client sees one error shape
whichever hop refused its request. The message always names the field or limit at fault.

A 500 that one request caused (an engine fault isolated to it, or a bug its handling ran into) carries
`X-Multiserve-Error-Scope: request`: the replica is fine, so the gateway neither retries it elsewhere nor counts
it against the replica's circuit breaker. A replica that cannot serve at all answers 503 instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import structlog
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from foundation.field_paths import format_loc
from foundation.http.wire import ERROR_SCOPE_HEADER
from foundation.request_errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
    RequestFailedError,
)

log = structlog.get_logger(__name__)

# OpenAI's `type` for each status; APIError may override it.
_DEFAULT_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error a client should see as-is: HTTP status plus OpenAI's error fields.

    `retry_after_s` (429 and 503) becomes a `Retry-After` header.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        request_scoped: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _DEFAULT_TYPES.get(status, "api_error")
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.request_scoped = request_scoped

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {ERROR_SCOPE_HEADER: "request"} if self.request_scoped else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return headers


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first field at fault, e.g. "temperature: Input should be greater than or equal to 0"."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")
    param = format_loc(first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    message = f"{param}: {message}" if param else f"request body: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param, code="invalid_value")


def to_api_error(exc: Exception) -> APIError:
    """Map any exception to the APIError a client should see; unknown ones become an opaque 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, json.JSONDecodeError):
        return APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                        code="invalid_json")
    if isinstance(exc, InvalidRequestError):
        code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else "invalid_value"
        return APIError(400, str(exc), param=exc.param, code=code)
    if isinstance(exc, OverloadedError):
        return APIError(429, str(exc), code="overloaded", retry_after_s=exc.retry_after_s)
    if isinstance(exc, HTTPException):
        return APIError(exc.status_code, str(exc.detail))
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), code="request_failed", request_scoped=True)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"this replica cannot serve: {exc}", code="engine_dead", retry_after_s=1)
    # a bug this one request ran into while being handled: the server itself carries on
    return APIError(500, "internal server error; see the server log", code="internal_error", request_scoped=True)


# Failures logged, with their traceback, where they happened (a request's fault under the id its client is told;
# the engine loop's death): whoever turns one into a reply does not log it again.
LOGGED_WHERE_RAISED = (RequestFailedError, EngineDeadError)


def error_payload(exc: Exception) -> dict[str, Any]:
    """The JSON body for `exc` (also sent as a final SSE event when a stream fails midway)."""
    return to_api_error(exc).payload()


def error_response(exc: Exception) -> JSONResponse:
    """OpenAI-shaped JSON response for `exc`, with its status and any Retry-After header."""
    error = to_api_error(exc)
    if error.status >= 500 and not isinstance(exc, (APIError, *LOGGED_WHERE_RAISED)):
        log.error("unhandled error", exc_info=exc)
    return JSONResponse(error.payload(), status_code=error.status, headers=error.headers())


async def _handle(request: Request, exc: Exception) -> Response:
    return error_response(exc)


def exception_handlers() -> Mapping[Any, Any]:
    """Starlette `exception_handlers=` mapping that sends every error in OpenAI's shape."""
    return {
        APIError: _handle,
        ValidationError: _handle,
        json.JSONDecodeError: _handle,
        InvalidRequestError: _handle,
        OverloadedError: _handle,
        RequestFailedError: _handle,
        HTTPException: _handle,
        Exception: _handle,  # Starlette's ServerErrorMiddleware: logs via error_response, then re-raises
    }
