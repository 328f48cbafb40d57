"""What every replica app has, whatever its engine (LLM or embedding): the names it answers to, readiness,
GET /health, /ready, /metrics and /v1/models, the 503 while it cannot take work, and the app assembly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from foundation.http.body_limit import BodySizeLimitMiddleware
from foundation.http.disconnect import read_body
from foundation.http.errors import APIError, exception_handlers
from runtimes.server.intake import check_model
from runtimes.server.metrics import ReplicaMetrics
from runtimes.server.replica import EngineLiveness, Readiness, run_startup_probe

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a request body a replica reads (the gateway's own limit is lower by default)


class NamedRequest(Protocol):
    """A pydantic request body that names its model."""

    model: str

    @classmethod
    def model_validate_json(cls: type[BodyT], json_data: bytes, /) -> BodyT: ...


BodyT = TypeVar("BodyT", bound=NamedRequest)


class ReplicaEndpoints:
    """State and endpoints shared by both replica apps; each app's own endpoints live in a subclass."""

    def __init__(self, engine: EngineLiveness, served_name: str, aliases: Sequence[str], model_name: str,
                 max_model_len: int, metrics: ReplicaMetrics, clock: Callable[[], float],
                 wall_clock: Callable[[], float], max_body_bytes: int, probe_timeout_s: float) -> None:
        self.liveness = engine
        self.served_name = served_name
        self.names = (served_name, *(a for a in aliases if a != served_name))
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.clock = clock
        self.wall_clock = wall_clock
        self.max_body_bytes = max_body_bytes
        self.probe_timeout_s = probe_timeout_s
        self.replica = Readiness()

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Probe the engine once it serves (the replica is ready when the probe passes); at shutdown, `settle`."""
        probe = asyncio.create_task(run_startup_probe(self.probe, self.replica, self.probe_timeout_s,
                                                      self.model_name))
        yield
        probe.cancel()
        await asyncio.wait([probe])
        await self.settle()

    async def probe(self) -> None:
        """Serve one known-good input; raise ProbeFailed (or anything) if the engine cannot."""
        raise NotImplementedError

    async def settle(self) -> None:
        """What shutdown waits for once the server stopped taking requests (nothing by default)."""

    def check_available(self) -> None:
        """503 (with Retry-After) while draining or broken; a replica still warming up accepts work."""
        refusal = self.replica.refusal(self.liveness)
        if refusal is not None:
            raise APIError(503, f"replica of {self.served_name!r} is unavailable: {refusal}", retry_after_s=1)

    async def parse_body(self, request: Request, model: type[BodyT]) -> BodyT:
        """The body as `model`, once the replica can take work; 404 unless it names a model served here."""
        self.check_available()
        body = model.model_validate_json(await read_body(request))  # size limited by BodySizeLimitMiddleware
        check_model(body.model, self.names)
        return body

    async def health(self, request: Request) -> Response:
        if self.liveness.dead_error is not None:
            return JSONResponse({"status": "dead", "reason": self.replica.unready_reason(self.liveness)}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        reason = self.replica.unready_reason(self.liveness)
        if reason is not None:
            return JSONResponse({"status": "unavailable", "model": self.served_name, "reason": reason}, 503)
        return JSONResponse({"status": "ready", "model": self.served_name})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: Request) -> Response:
        created = int(self.wall_clock())
        data = [{"id": name, "object": "model", "created": created, "owned_by": "multiserve",
                 "root": self.served_name, "parent": None, "max_model_len": self.max_model_len}
                for name in self.names]
        return JSONResponse({"object": "list", "data": data})

    def common_routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]


def assemble_app(server: ReplicaEndpoints, routes: Sequence[BaseRoute], engine: Any) -> Starlette:
    """`routes` plus the common ones, the body size limit, OpenAI-shaped errors, and `app.state.engine` /
    `replica` / `metrics`."""
    app = Starlette(routes=[*routes, *server.common_routes()], exception_handlers=exception_handlers(),
                    middleware=[Middleware(BodySizeLimitMiddleware, max_bytes=lambda: server.max_body_bytes)],
                    lifespan=server.lifespan)
    app.state.engine = engine
    app.state.replica = server.replica
    app.state.metrics = server.metrics
    return app

