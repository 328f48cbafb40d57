"""What a request can run into, whichever engine serves it: refused as asked (`InvalidRequestError`, a 400 that
names the field), too big for the context (`ContextLengthError`), not now (`OverloadedError`, a 429), failed by the
engine while it was served (`RequestFailedError`, a 500 that is the request's own), or a replica whose engine loop
has died (`EngineDeadError`, a 503). foundation/http/errors.py maps them to HTTP; the engines raise them, and the
gateway, which loads no engine, maps them without importing one."""

from __future__ import annotations

import uuid

import structlog

log = structlog.get_logger(__name__)


class InvalidRequestError(ValueError):
    """A request that can never be served as asked; the message names the field and the limit."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt, or prompt plus max_tokens, does not fit the model's context window (OpenAI's
    `context_length_exceeded`: a gateway may send the request to a model with a longer one)."""


class RequestFailedError(Exception):
    """The engine failed while serving this one request (a fault it alone triggered, or a bug it ran into).

    The request was stopped and its KV blocks freed; every other request continues. `error_id` ties the
    client's 500 to the traceback in the replica's log.
    """

    def __init__(self, message: str, error_id: str) -> None:
        super().__init__(message)
        self.error_id = error_id


def request_failed(error_id: str) -> RequestFailedError:
    """What the caller of a request the engine failed to serve is told (the traceback is logged under the id)."""
    return RequestFailedError(f"the engine failed while serving this request (error id {error_id}); other "
                              "requests were not affected", error_id)


def record_failure(event: str, request_id: str, error: BaseException) -> str:
    """Log `error`'s traceback under a fresh error id and return the id (the one its caller is told)."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    log.error(event, request_id=request_id, error_id=error_id, exc_info=error)
    return error_id


class OverloadedError(Exception):
    """The engine is too busy to take (or to start) this request now; try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(RuntimeError):
    """The engine loop has ended on an error: this replica cannot serve anything until it is restarted."""
