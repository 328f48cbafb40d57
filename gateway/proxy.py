"""Forwarding a request to its model's instance group: pick a replica, retry elsewhere on failure before
any byte reached the client, then try the model's fallbacks; stream replies through unbuffered."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from tenacity import AsyncRetrying, retry_if_exception, retry_if_exception_type, stop_after_attempt, wait_exponential

from gateway.metrics import GatewayMetrics
from model_pool.pool import InstanceGroup, ModelPool
from model_pool.replica import Replica
from model_pool.schema import ModelSpec
from runtimes.server.errors import APIError, error_payload

log = structlog.get_logger(__name__)

# endpoint -> (path on a replica, model types that serve it)
ENDPOINTS: dict[str, tuple[str, frozenset[str]]] = {
    "chat": ("/v1/chat/completions", frozenset({"chat"})),
    "completions": ("/v1/completions", frozenset({"chat", "completion"})),
    "embeddings": ("/v1/embeddings", frozenset({"embedding"})),
}
_FITS = {"chat": "/v1/chat/completions or /v1/completions", "completion": "/v1/completions",
         "embedding": "/v1/embeddings"}


@dataclass(frozen=True)
class ProxySettings:
    max_attempts: int = 3  # per model: replicas tried before moving on to its fallbacks
    backoff_s: float = 0.05
    backoff_max_s: float = 0.5
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0


class ReplicaFailure(Exception):
    def __init__(self, replica: Replica, cause: str, timeout: bool = False) -> None:
        super().__init__(f"{replica.replica_id}: {cause}")
        self.timeout = timeout


class NoReplica(Exception):
    pass


class Forwarder:
    def __init__(
        self,
        pool: ModelPool,
        resolve: Callable[[str], ModelSpec | None],
        known_models: Callable[[], list[str]],
        http: httpx.AsyncClient,
        metrics: GatewayMetrics,
        settings: ProxySettings | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.pool, self.resolve, self.known_models = pool, resolve, known_models
        self.http, self.metrics = http, metrics
        self.settings = settings or ProxySettings()
        self.sleep, self.clock = sleep, clock

    async def forward(self, request: Request, endpoint: str) -> Response:
        start = self.clock()
        payload, body = await _read_json(request)
        spec = self._target(request, payload, endpoint)
        stream = payload.get("stream") is True
        state = request.scope.setdefault("state", {})
        state.setdefault("log", {})["model"] = spec.name
        status = "error"
        try:
            response = await self._forward_chain(request, spec, endpoint, payload, body, stream, start)
            status = str(response.status_code)
            return response
        except APIError as err:
            status = str(err.status)
            raise
        finally:
            self.metrics.requests.labels(spec.name, endpoint, status).inc()
            if not stream:
                self.metrics.e2e.labels(spec.name).observe(self.clock() - start)

    def _target(self, request: Request, payload: dict[str, Any], endpoint: str) -> ModelSpec:
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, "model: a model name is required", param="model")
        allowed = request.scope.get("state", {}).get("allowed_models")
        spec = self.resolve(model)
        if spec is None or (allowed is not None and spec.name not in allowed):
            names = [n for n in self.known_models() if allowed is None or n in allowed]
            raise APIError(404, f"model {model!r} does not exist or you do not have access to it; "
                                f"available: {', '.join(names) or 'none'}", param="model", code="model_not_found")
        if spec.type not in ENDPOINTS[endpoint][1]:
            raise APIError(400, f"model {spec.name!r} is a {spec.type} model; use {_FITS[spec.type]}",
                           param="model", code="wrong_endpoint")
        return spec

    async def _forward_chain(self, request: Request, spec: ModelSpec, endpoint: str, payload: dict[str, Any],
                             body: bytes, stream: bool, start: float) -> Response:
        chain = [spec] + [s for s in (self.resolve(f) for f in spec.fallbacks) if s is not None]
        timed_out = False
        for target in chain:
            group = self.pool.group(target.name)
            if group is None or target.type not in ENDPOINTS[endpoint][1]:
                continue
            content = body if target.name == payload["model"] else json.dumps({**payload, "model": target.name}
                                                                               ).encode()
            try:
                response = await self._try_group(request, group, endpoint, content, stream, start, spec.name)
            except ReplicaFailure as failure:
                timed_out = failure.timeout
                continue
            except NoReplica:
                continue
            if target is not spec:
                self.metrics.failovers.labels(spec.name, target.name).inc()
            return response
        if timed_out:
            raise APIError(504, f"model {spec.name!r}: the replica did not answer within "
                                f"{self.settings.request_timeout_s:g} s", code="upstream_timeout")
        raise APIError(503, f"model {spec.name!r} has no ready replica (fallbacks tried: "
                            f"{', '.join(spec.fallbacks) or 'none'})", code="no_ready_replica", retry_after_s=1)

    async def _try_group(self, request: Request, group: InstanceGroup, endpoint: str, content: bytes, stream: bool,
                         start: float, model: str) -> Response:
        tried: set[str] = set()
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.settings.max_attempts),
            wait=wait_exponential(multiplier=self.settings.backoff_s, max=self.settings.backoff_max_s),
            # Retry only while an untried replica is left: otherwise the last failure is reraised, so the chain
            # can tell a timeout (504) from a failure (503), and no backoff or retry is counted for nothing.
            retry=retry_if_exception_type(ReplicaFailure)
            & retry_if_exception(lambda _: any(r.routable() and r.replica_id not in tried for r in group.replicas)),
            sleep=self.sleep, reraise=True,
            before_sleep=lambda _: self.metrics.retries.labels(model).inc(),
        )
        async for attempt in retrying:
            with attempt:
                replica = self.pool.choose(group, tried)
                if replica is None:
                    raise NoReplica(group.spec.name)
                tried.add(replica.replica_id)
                request.scope["state"]["log"]["replica"] = replica.replica_id
                return await self._send(request, replica, endpoint, content, stream, start, model)
        raise AssertionError("unreachable: tenacity reraises the last failure")

    async def _send(self, request: Request, replica: Replica, endpoint: str, content: bytes, stream: bool,
                    start: float, model: str) -> Response:
        headers = {"content-type": "application/json",
                   "x-request-id": request.scope.get("state", {}).get("request_id", "")}
        if "x-priority" in request.headers:  # the replica classifies the request's lane (policies/classify.py)
            headers["x-priority"] = request.headers["x-priority"]
        timeout = httpx.Timeout(self.settings.request_timeout_s, connect=self.settings.connect_timeout_s)
        upstream = self.http.build_request("POST", replica.base_url + ENDPOINTS[endpoint][0], content=content,
                                           headers=headers, timeout=timeout)
        replica.outstanding += 1
        replica.breaker.on_dispatch()
        handed_over = False
        try:
            response = await self._open(upstream, replica)
            if not stream or response.status_code != 200:
                data = await self._read_all(response, replica)
                replica.breaker.record_success()
                return Response(data, status_code=response.status_code,
                                media_type=response.headers.get("content-type", "application/json"))
            chunks = response.aiter_raw()
            try:
                first = await anext(chunks, b"")
            except httpx.HTTPError as err:
                await response.aclose()
                raise self._fail(replica, f"stream broke before the first byte: {err!r}") from err
            handed_over = True
            return StreamingResponse(self._relay(first, chunks, response, replica, start, model),
                                     media_type="text/event-stream", headers={"cache-control": "no-cache"})
        finally:
            if not handed_over:
                replica.outstanding -= 1

    async def _open(self, upstream: httpx.Request, replica: Replica) -> httpx.Response:
        try:
            response = await self.http.send(upstream, stream=True)
        except httpx.TimeoutException as err:
            raise self._fail(replica, f"timed out: {err!r}", timeout=True) from err
        except httpx.HTTPError as err:
            raise self._fail(replica, f"connection failed: {err!r}") from err
        if response.status_code >= 500:
            await response.aclose()
            raise self._fail(replica, f"answered {response.status_code}")
        return response

    async def _read_all(self, response: httpx.Response, replica: Replica) -> bytes:
        try:
            return await response.aread()
        except httpx.HTTPError as err:
            raise self._fail(replica, f"reply broke: {err!r}") from err
        finally:
            await response.aclose()

    def _fail(self, replica: Replica, cause: str, timeout: bool = False) -> ReplicaFailure:
        replica.breaker.record_failure()
        log.warning("replica_request_failed", replica=replica.replica_id, cause=cause)
        return ReplicaFailure(replica, cause, timeout)

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], response: httpx.Response, replica: Replica,
                     start: float, model: str) -> AsyncIterator[bytes]:
        """Pass the replica's SSE bytes through as they come; a break midway ends with an error event."""
        try:
            self.metrics.ttft.labels(model).observe(self.clock() - start)
            yield first
            async for chunk in chunks:
                yield chunk
            replica.breaker.record_success()
        except httpx.HTTPError as err:
            self._fail(replica, f"stream broke midway: {err!r}")
            failure = APIError(503, f"model {model!r}: the replica failed while streaming; the reply is incomplete",
                               code="stream_interrupted")
            yield f"data: {json.dumps(error_payload(failure))}\n\ndata: [DONE]\n\n".encode()
        finally:
            replica.outstanding -= 1
            await response.aclose()
            self.metrics.e2e.labels(model).observe(self.clock() - start)


async def _read_json(request: Request) -> tuple[dict[str, Any], bytes]:
    body = await request.body()
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from err
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return payload, body
