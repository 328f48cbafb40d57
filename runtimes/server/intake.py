"""What every replica endpoint does before its own logic, for the LLM and the embedding apps alike: check the
model name, refuse an endpoint this replica's model type cannot serve (400 naming the one that fits). The body's
size is limited before that (foundation/http/body_limit.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response

from foundation.http.errors import APIError


def check_model(model: str, names: Sequence[str]) -> None:
    """404 unless `model` is one of the names this replica answers to."""
    if model not in names:
        served = ", ".join(repr(n) for n in names)
        raise APIError(404, f"the model {model!r} does not exist on this replica (it serves {served})",
                       param="model", code="model_not_found")


def wrong_endpoint(served_name: str, kind: str, fits: str) -> Callable[[Request], Awaitable[Response]]:
    """An endpoint that always answers 400: `served_name` is a `kind` model, and `fits` is where to send it."""

    async def refuse(request: Request) -> Response:
        raise APIError(400, f"model {served_name!r} is {kind} model; use {fits}", param="model",
                       code="wrong_endpoint")

    return refuse
