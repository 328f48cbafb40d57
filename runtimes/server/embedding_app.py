"""The OpenAI-compatible HTTP face of one embedding engine (one replica of a `type: embedding` model).

Endpoints: POST /v1/embeddings, GET /v1/models, GET /health, GET /ready (after a startup probe embedded one
text), GET /metrics. POST /v1/completions and /v1/chat/completions answer 400 naming /v1/embeddings.
Errors leave in OpenAI's shape via foundation.http.errors, like the LLM app's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

import anyio
import numpy as np
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from foundation.http.disconnect import CLIENT_CLOSED_REQUEST, until_disconnect
from foundation.http.errors import APIError
from runtimes.embedding.async_engine import AsyncEmbeddingEngine
from runtimes.fault_isolation import PROBE_TEXT
from runtimes.server.embedding_metrics import EmbeddingServerMetrics
from runtimes.server.embedding_protocol import EmbeddingRequest, embedding_body
from runtimes.server.intake import wrong_endpoint
from runtimes.server.replica import ProbeFailed
from runtimes.server.replica_app import DEFAULT_MAX_BODY_BYTES, ReplicaEndpoints, assemble_app

log = structlog.get_logger(__name__)


class _EmbeddingServer(ReplicaEndpoints):
    """State shared by the endpoints of one embedding app: the engine, names, metrics and readiness."""

    def __init__(self, engine: AsyncEmbeddingEngine, served_name: str, aliases: Sequence[str],
                 clock: Callable[[], float], wall_clock: Callable[[], float], max_body_bytes: int,
                 probe_timeout_s: float) -> None:
        metrics = EmbeddingServerMetrics(engine.engine, served_name)
        super().__init__(engine, served_name, aliases, engine.engine.model_name, engine.engine.max_model_len,
                         metrics, clock, wall_clock, max_body_bytes, probe_timeout_s)
        self.engine = engine
        self.metrics: EmbeddingServerMetrics = metrics

    async def probe(self) -> None:
        """Embed one text; the vector must have the model's width and be finite."""
        core = self.engine.engine
        out = await self.engine.embed(f"probe-{uuid.uuid4().hex}", [core.inputs.encode(PROBE_TEXT)])
        if out.embeddings.shape != (1, core.hidden_size) or not np.isfinite(out.embeddings).all():
            raise ProbeFailed(f"got a {out.embeddings.shape} vector with non-finite values or the wrong shape "
                              f"(expected (1, {core.hidden_size}))")

    async def embeddings(self, request: Request) -> Response:
        start = self.clock()
        body = await self.parse_body(request, EmbeddingRequest)
        core = self.engine.engine
        if body.dimensions is not None and body.dimensions != core.hidden_size:
            raise APIError(400, f"dimensions: this model returns {core.hidden_size}-dimensional embeddings and "
                                f"cannot shorten them; omit dimensions or set it to {core.hidden_size}",
                           param="dimensions", code="invalid_value")
        prepared = await anyio.to_thread.run_sync(core.inputs.prepare, body.input, body.truncate_prompt_tokens)
        request_id = f"embd-{uuid.uuid4().hex}"
        out = await until_disconnect(request, lambda: self.engine.embed(request_id, prepared.token_ids))
        if out is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        self.metrics.observe_request(self.clock() - start, out.num_prompt_tokens)
        return JSONResponse(embedding_body(out.embeddings, body.model, out.num_prompt_tokens, body.encoding_format))


def build_embedding_app(
    engine: AsyncEmbeddingEngine,
    served_name: str,
    aliases: Sequence[str] = (),
    clock: Callable[[], float] = time.monotonic,
    *,
    wall_clock: Callable[[], float] = time.time,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    probe_timeout_s: float = 300.0,
) -> Starlette:
    """The per-replica OpenAI-compatible app for an embedding `engine`, answering to `served_name` and `aliases`.

    As build_app: `app.state.replica` holds readiness (set `draining` to refuse new requests with 503),
    `app.state.metrics` the replica's metrics, `app.state.engine` the engine, which the caller owns and shuts down.
    """
    server = _EmbeddingServer(engine, served_name, aliases, clock, wall_clock, max_body_bytes, probe_timeout_s)
    refuse = wrong_endpoint(served_name, "an embedding", "/v1/embeddings")
    routes = [
        Route("/v1/embeddings", server.embeddings, methods=["POST"]),
        Route("/v1/completions", refuse, methods=["POST"]),
        Route("/v1/chat/completions", refuse, methods=["POST"]),
    ]
    return assemble_app(server, routes, engine)
