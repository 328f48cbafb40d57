"""Admin API: edit the registry live (persisted to the YAML, comments kept), scale, drain, status.

Every call needs `Authorization: Bearer <token>` with the token from the environment variable the
registry names (`gateway.admin_token_env`); without it set, the admin API answers 401 to everyone.

The store parses and validates a whole registry per edit (seconds for a large file) and waits for a reload in
progress, so every call into it runs in a worker thread, never on the event loop. Values are checked by the
registry schema alone: an edit it refuses is a 400 carrying the schema's message, naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from foundation.http.disconnect import read_body
from foundation.http.errors import APIError
from gateway.auth_keys import bearer_token, token_matches
from gateway.request_body import parse_json_object
from registry.errors import ModelNotFound
from registry.store import RegistryDiff, RegistryError


def _state(request: Request) -> Any:
    state = request.app.state.gateway
    token = state.admin_token
    given = bearer_token(request.headers.get("authorization", ""))
    if not token_matches(given, token):
        hint = "" if token else " (the admin API is disabled: its token environment variable is not set)"
        raise APIError(401, f"admin endpoints need `Authorization: Bearer <admin token>`{hint}",
                       code="invalid_admin_token")
    return state


async def _json_body(request: Request, param: str | None = None) -> dict[str, Any]:
    """The body as a JSON object, by the same rules as every body the gateway reads; a 400 names `param`."""
    try:
        return parse_json_object(await read_body(request))
    except APIError as err:
        raise APIError(400, err.message, param=param, code=err.code) from None


async def _apply(state: Any, edit: Callable[[], RegistryDiff], param: str | None = None) -> JSONResponse:
    """Run one registry edit (validated whole, persisted by the store) in a worker thread, then bring the pool in
    line. `param`: the request field a rejection is about, when the endpoint takes just one."""
    try:
        diff = await anyio.to_thread.run_sync(edit)
    except ModelNotFound as err:
        raise APIError(404, f"model {err.name!r} is not in the registry", param="name", code="model_not_found") from err
    except RegistryError as err:
        raise APIError(400, f"registry edit rejected, nothing changed: {err}", param=param,
                       code="registry_rejected") from err
    await state.apply_change(diff)
    return JSONResponse({"applied": True, "version": state.store.version, "diff": diff.as_dict()})


def _model_or_404(state: Any, name: str) -> Any:
    spec = next((m for m in state.store.registry.models if m.name == name), None)
    if spec is None:
        raise APIError(404, f"model {name!r} is not in the registry", param="name", code="model_not_found")
    return spec


async def list_models(request: Request) -> JSONResponse:
    state = _state(request)
    return JSONResponse({"models": [m.model_dump(mode="json") for m in state.store.registry.models],
                         "version": state.store.version})


async def get_model(request: Request) -> JSONResponse:
    state = _state(request)
    return JSONResponse(_model_or_404(state, request.path_params["name"]).model_dump(mode="json"))


async def put_model(request: Request) -> JSONResponse:
    state = _state(request)
    name = request.path_params["name"]
    body = await _json_body(request)  # the model's YAML entry as JSON
    if body.setdefault("name", name) != name:
        raise APIError(400, f"name: the body names {body['name']!r} but the URL names {name!r}", param="name")
    return await _apply(state, lambda: state.store.put_model(body))


async def delete_model(request: Request) -> JSONResponse:
    state = _state(request)
    name = request.path_params["name"]
    _model_or_404(state, name)
    return await _apply(state, lambda: state.store.delete_model(name))


async def scale_model(request: Request) -> JSONResponse:
    state = _state(request)
    name = request.path_params["name"]
    _model_or_404(state, name)
    replicas = (await _json_body(request, "replicas")).get("replicas")  # the schema checks its value
    return await _apply(state, lambda: state.store.scale(name, replicas), param="replicas")


def _pin_action(pinned: bool):
    async def endpoint(request: Request) -> JSONResponse:
        """pin: a model started on demand is kept resident (`scaling.pinned`: one replica at least, never unloaded
        nor evicted), persisted to the registry; unpin: it may go idle again."""
        state = _state(request)
        name = request.path_params["name"]
        _model_or_404(state, name)
        return await _apply(state, lambda: state.store.pin(name, pinned), param="scaling.pinned")

    return endpoint


def _replica_action(drain: bool):
    async def endpoint(request: Request) -> JSONResponse:
        """drain: no new requests from now on; with `{"migrate": true}` (the body is optional) its streams that can
        go on elsewhere move to other replicas at once, so it empties in about a step instead of after its longest
        request; if no other replica of the model is ready they finish where they are, and move once one is. The
        answer says how many moved and how many requests stay in flight there. undrain: takes requests again."""
        state = _state(request)
        replica_id = request.path_params["replica_id"]
        migrate = False
        if drain and await read_body(request):
            migrate = (await _json_body(request, "migrate")).get("migrate", False)
            if not isinstance(migrate, bool):
                raise APIError(400, f"migrate must be true or false, got {migrate!r}", param="migrate")
        answer: dict[str, Any] | None
        if drain:
            drained = state.pool.drain(replica_id, migrate)
            answer = None if drained is None else {**drained.replica.snapshot(),
                                                   "migrated_streams": drained.migrated_streams,
                                                   "finishing_in_place": drained.finishing_in_place}
        else:
            replica = state.pool.undrain(replica_id)
            answer = None if replica is None else replica.snapshot()
        if answer is None:
            raise APIError(404, f"replica {replica_id!r} does not exist", param="replica_id")
        return JSONResponse(answer)

    return endpoint


async def registry_status(request: Request) -> JSONResponse:
    state = _state(request)
    return JSONResponse(await anyio.to_thread.run_sync(state.store.status))  # it waits for a reload in progress


def admin_routes() -> list[Route]:
    return [
        Route("/admin/models", list_models, methods=["GET"]),
        Route("/admin/models/{name}", get_model, methods=["GET"]),
        Route("/admin/models/{name}", put_model, methods=["PUT"]),
        Route("/admin/models/{name}", delete_model, methods=["DELETE"]),
        Route("/admin/models/{name}/scale", scale_model, methods=["POST"]),
        Route("/admin/models/{name}/pin", _pin_action(pinned=True), methods=["POST"]),
        Route("/admin/models/{name}/unpin", _pin_action(pinned=False), methods=["POST"]),
        Route("/admin/replicas/{replica_id:path}/drain", _replica_action(drain=True), methods=["POST"]),
        Route("/admin/replicas/{replica_id:path}/undrain", _replica_action(drain=False), methods=["POST"]),
        Route("/admin/registry/status", registry_status, methods=["GET"]),
    ]
