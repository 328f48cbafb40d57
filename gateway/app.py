"""The gateway's Starlette app: OpenAI endpoints routed by model, health and readiness, metrics, admin.

`GatewayState` holds the live pieces (registry store, pool, forwarder); the app only wires routes and
middleware to them, so tests can build one around a pool of fake or in-process replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from foundation.http.body_limit import BodySizeLimitMiddleware
from foundation.http.errors import exception_handlers
from gateway.admin import admin_routes
from gateway.auth import AuthMiddleware
from gateway.auth_keys import ApiKey, parse_api_keys
from gateway.context import request_context
from gateway.limits import RateLimitMiddleware
from gateway.metrics import GatewayMetrics
from gateway.middleware import AccessLogMiddleware, RequestIdMiddleware
from gateway.proxy import Forwarder
from gateway.traffic import TrafficMiddleware, TrafficRecorder
from model_pool.pool import ModelPool
from model_pool.replica import ReplicaState
from policies.classify import LaneThresholds
from registry.errors import Problem
from registry.schema import GatewayConfig
from registry.store import RegistryDiff, RegistryStore

log = structlog.get_logger(__name__)


@dataclass
class GatewayState:
    store: RegistryStore
    pool: ModelPool
    forwarder: Forwarder
    metrics: GatewayMetrics
    started_at: float
    # from the registry's `gateway:` section, set by `apply_gateway_config`
    admin_token: str | None = None  # None: admin API disabled (every call 401)
    api_keys: dict[str, ApiKey] = field(default_factory=dict)
    traffic: TrafficRecorder | None = None  # the traffic profile (gateway.traffic.path); None: off
    env: Mapping[str, str] = field(default_factory=dict)  # where the secrets' variables are read (a snapshot)
    max_body_bytes: int = 4 << 20

    async def apply_change(self, diff: RegistryDiff) -> None:
        """Bring the running gateway in line with the store after a change it applied, whichever way it came (the
        admin API or the file): the gateway's own section, then the pool's replicas."""
        log.info("registry_applied", version=self.store.version, diff=diff.as_dict())
        registry = self.store.registry
        if diff.gateway_changed:
            self.apply_gateway_config(registry.gateway)
        await self.pool.apply(registry)

    def apply_gateway_config(self, config: GatewayConfig) -> None:
        """Take a registry's `gateway:` section live: secrets from their (possibly renamed) variables, the body
        limit. `gateway_config_problems` has refused every change that needs a restart before it got here."""
        self.admin_token = self.env.get(config.admin_token_env) or None
        self.api_keys = parse_api_keys(self.env.get(config.api_keys_env)) if config.api_keys_env else {}
        self.max_body_bytes = config.max_body_bytes


# `gateway:` fields a running gateway cannot change: its socket, the limits it serves it with, its traffic log.
RESTART_FIELDS = ("host", "port", "traffic", "http", "ray")


def gateway_config_problems(running: GatewayConfig, new: GatewayConfig, env: Mapping[str, str]) -> list[Problem]:
    """Why `new` cannot be applied to a gateway running with `running`: fields that need a restart (reported, never
    silently ignored), and API keys that do not parse."""
    problems = [Problem(f"gateway.{name}", f"needs restart: changed from {getattr(running, name)!r} to "
                                           f"{getattr(new, name)!r}; restart `multiserve serve` to apply it")
                for name in RESTART_FIELDS if getattr(running, name) != getattr(new, name)]
    if new.api_keys_env:
        try:
            parse_api_keys(env.get(new.api_keys_env))
        except ValueError as err:
            problems.append(Problem("gateway.api_keys_env", f"${new.api_keys_env}: {err}"))
    return problems


def secret_env_names(config: GatewayConfig) -> set[str]:
    """The variables that hold the gateway's own secrets: never passed on to the workers it launches."""
    return {config.admin_token_env} | ({config.api_keys_env} if config.api_keys_env else set())


def _endpoint(name: str) -> Callable[[Request], Any]:
    async def handler(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        return await state.forwarder.forward(request, name)

    return handler


async def list_models(request: Request) -> JSONResponse:
    state: GatewayState = request.app.state.gateway
    allowed = request_context(request.scope).allowed_models
    data = []
    for spec in state.store.registry.models:
        if not spec.enabled or (allowed is not None and spec.name not in allowed):
            continue
        for model_id in (spec.name, *spec.aliases):
            data.append({"id": model_id, "object": "model", "created": int(state.started_at),
                         "owned_by": "multiserve", "root": spec.name, "type": spec.type})
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


def readiness(state: GatewayState) -> tuple[bool, dict[str, Any]]:
    """Ready when every enabled model with replicas wanted has at least one ready replica, or can start one on
    demand: a model with `replicas: {min: 0, ...}` and none running is cold, not failing (`"on_demand": true`)."""
    detail: dict[str, Any] = {}
    ok = True
    for spec in state.store.registry.models:
        if not spec.enabled or spec.max_replicas == 0:
            continue
        group = state.pool.group(spec.name)
        replicas = [] if group is None else group.replicas
        ready = sum(r.state == ReplicaState.READY for r in replicas)
        detail[spec.name] = {"ready_replicas": ready, "replicas": len(replicas),
                             "states": [r.state.value for r in replicas]}
        if spec.on_demand:
            detail[spec.name]["on_demand"] = True
        cold_ok = spec.on_demand and spec.resident_replicas == 0 and not any(
            r.state == ReplicaState.FAILED for r in replicas)
        ok = ok and (ready > 0 or cold_ok)
    return ok, detail


async def ready(request: Request) -> JSONResponse:
    ok, detail = readiness(request.app.state.gateway)
    return JSONResponse({"status": "ready" if ok else "not_ready", "models": detail}, status_code=200 if ok else 503)


async def health_models(request: Request) -> JSONResponse:
    state: GatewayState = request.app.state.gateway
    return JSONResponse({"models": state.pool.health(), "memory": state.pool.memory()})


async def metrics(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _lane_thresholds(state: GatewayState, model: str) -> LaneThresholds | None:
    """A model's lane length thresholds as its replicas classify with them (None: the defaults)."""
    spec = state.store.registry.resolve(model)
    return LaneThresholds(**spec.policy.lanes) if spec is not None and spec.policy.lanes else None


def build_gateway(state: GatewayState, lifespan: Any = None) -> Starlette:
    """The app over `state` (its request body limit is the state's, which a registry edit may change)."""
    routes = [
        Route("/v1/chat/completions", _endpoint("chat"), methods=["POST"]),
        Route("/v1/completions", _endpoint("completions"), methods=["POST"]),
        Route("/v1/embeddings", _endpoint("embeddings"), methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/health/models", health_models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *admin_routes(),
    ]
    middleware = [
        Middleware(RequestIdMiddleware),
        Middleware(AccessLogMiddleware),
        Middleware(BodySizeLimitMiddleware, max_bytes=lambda: state.max_body_bytes),
        Middleware(AuthMiddleware, keys=lambda: state.api_keys, admin_token=lambda: state.admin_token),
        Middleware(RateLimitMiddleware),
    ]
    if state.traffic is not None:  # innermost: it sees the model the proxy resolved, and only admitted requests
        middleware.append(Middleware(TrafficMiddleware, recorder=state.traffic,
                                     thresholds_for=lambda model: _lane_thresholds(state, model)))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers=exception_handlers())
    app.state.gateway = state
    state.started_at = state.started_at or time.time()
    return app
