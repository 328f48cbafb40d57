"""Forwarding a request to its model's instance group: pick a replica, retry elsewhere on failure before
any byte reached the client, then try the model's fallbacks; stream replies through unbuffered."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from foundation.http.disconnect import CLIENT_CLOSED_REQUEST, read_body, until_disconnect
from foundation.http.errors import APIError, error_payload
from foundation.http.wire import ERROR_SCOPE_HEADER, PROMPT_TOKENS_HEADER, RESUMABLE_HEADER, RESUME_FIELD
from gateway.context import request_context
from gateway.framing import MAX_FRAME_BYTES, UpstreamMalformed
from gateway.lanes import choose_lane
from gateway.metrics import GatewayMetrics
from gateway.request_body import request_payload
from gateway.resume import Moved, ProgressTracker, Pump, ResumeBudget, Stalled, StreamTracker
from gateway.upstream import MAX_REPLY_BYTES, Timeouts, Upstream, UpstreamError, UpstreamReply, UpstreamTimeout
from model_pool.pool import ColdStartFailed, InstanceGroup, ModelPool
from model_pool.replica import Lease, Replica, ReplicaState
from policies.retry import Backoff
from registry.schema import ModelSpec

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
    resume_wait_s: float = 30.0  # how long a broken stream waits for a ready replica to go on on
    # a resumable stream silent this long mid-way goes on elsewhere (a hung replica is found sooner by its probes,
    # which move its streams as soon as it is marked unhealthy)
    stream_stall_s: float | None = 300.0
    # a broken generation goes on elsewhere at most this many times (one that made no progress counts twice), and
    # its continuations wait for a replica `resume_wait_s` in all, not each
    max_resumes: int = 3
    max_reply_bytes: int = MAX_REPLY_BYTES  # of a whole reply sent as progress (one read whole: the HTTP client's)
    max_event_bytes: int = MAX_FRAME_BYTES  # of one stream event or progress line of a replica's


class ReplicaFailure(Exception):
    def __init__(self, replica: Replica, cause: str, timeout: bool = False) -> None:
        super().__init__(f"{replica.replica_id}: {cause}")
        self.timeout = timeout


class NoReplica(Exception):
    pass


class ReplicaOverloaded(Exception):
    """A replica answered 429: it is healthy but its queue is full. Another replica or a fallback may take it."""

    def __init__(self, replica: Replica, retry_after_s: float) -> None:
        super().__init__(f"{replica.replica_id}: overloaded, retry after {retry_after_s:g} s")
        self.retry_after_s = retry_after_s


@dataclass
class _Outcome:
    """Why the replicas of a model chain did not answer, for the one error the client gets."""

    retry_after_s: list[float]
    timed_out: bool = False
    cold_start: ColdStartFailed | None = None  # the first model on demand that could not be started

    def error(self, spec: ModelSpec, timeout_s: float) -> APIError:
        fallbacks = ", ".join(spec.fallbacks) or "none"
        if self.cold_start is not None:
            code = "memory_budget_full" if self.cold_start.budget else "cold_start_failed"
            return APIError(503, f"model {spec.name!r} could not be started on demand: {self.cold_start} "
                                 f"(fallbacks tried: {fallbacks})", code=code,
                            retry_after_s=self.cold_start.retry_after_s)
        if self.retry_after_s:
            return APIError(429, f"model {spec.name!r} is overloaded: every replica's queue is full (fallbacks "
                                 f"tried: {fallbacks})", code="overloaded", retry_after_s=min(self.retry_after_s))
        if self.timed_out:
            return APIError(504, f"model {spec.name!r}: the replica did not answer within {timeout_s:g} s",
                            code="upstream_timeout")
        return APIError(503, f"model {spec.name!r} has no ready replica (fallbacks tried: {fallbacks})",
                        code="no_ready_replica", retry_after_s=1)


class Forwarder:
    def __init__(
        self,
        pool: ModelPool,
        resolve: Callable[[str], ModelSpec | None],
        known_models: Callable[[], list[str]],
        upstream: Upstream,
        metrics: GatewayMetrics,
        settings: ProxySettings | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.pool, self.resolve, self.known_models = pool, resolve, known_models
        self.upstream, self.metrics = upstream, metrics
        self.settings = settings or ProxySettings()
        self.timeouts = Timeouts(self.settings.connect_timeout_s, self.settings.request_timeout_s)
        self.sleep, self.clock = sleep, clock

    async def forward(self, request: Request, endpoint: str) -> Response:
        start = self.clock()
        body = await read_body(request)
        payload = request_payload(request.scope, body)
        if RESUME_FIELD in payload:
            raise APIError(400, f"{RESUME_FIELD} is for the gateway's own continuations, not for clients",
                           param=RESUME_FIELD)
        context = request_context(request.scope)
        choice = choose_lane(payload.get("priority"), request.headers.get("x-priority"), context.key)
        if choice.rewrite_priority:  # the replica reads the body's priority first: it must be the lane allowed
            payload["priority"] = choice.lane  # (the context's payload too, which the traffic log reads)
            body = json.dumps(payload).encode()
        context.lane = choice.lane
        spec = self._target(request, payload, endpoint)
        stream = payload.get("stream") is True
        context.model = spec.name
        status = "error"
        timeout_s = spec.policy.request_timeout_s

        async def call() -> Response:
            forwarding = self._forward_with_context_fallbacks(request, spec, endpoint, payload, body, stream, start)
            if timeout_s is None:
                return await forwarding
            # The whole request: queueing, retries and (for streams) the first byte. A timeout scope, not wait_for:
            # on Python 3.11 wait_for drops a cancellation that comes as its awaitable finishes (the client's
            # departure then went unnoticed, and the reply was read to its end for nobody).
            try:
                async with asyncio.timeout(timeout_s):
                    return await forwarding
            except TimeoutError:
                raise _timeout(spec.name, timeout_s) from None

        try:
            # A client that leaves before the reply (or a stream's first byte) cancels the call: the connection to
            # the replica closes and the replica aborts the request. A started stream is watched by Starlette.
            response = await until_disconnect(request, call)
            if response is None:
                status = str(CLIENT_CLOSED_REQUEST)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
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
        context = request_context(request.scope)
        allowed = context.allowed_models
        spec = self.resolve(model)
        if spec is None or (allowed is not None and spec.name not in allowed):
            names = [n for n in self.known_models() if allowed is None or n in allowed]
            raise APIError(404, f"model {model!r} does not exist or you do not have access to it; "
                                f"available: {', '.join(names) or 'none'}", param="model", code="model_not_found")
        if spec.type not in ENDPOINTS[endpoint][1]:
            raise APIError(400, f"model {spec.name!r} is a {spec.type} model; use {_FITS[spec.type]}",
                           param="model", code="wrong_endpoint")
        tenant = context.tenant
        variant = self.resolve(spec.variants[tenant]) if tenant in spec.variants else None
        return variant if variant is not None else spec

    async def _forward_with_context_fallbacks(self, request: Request, spec: ModelSpec, endpoint: str,
                                              payload: dict[str, Any], body: bytes, stream: bool,
                                              start: float) -> Response:
        """The model chain; when its replica says the request exceeds its context window, the same request on
        each of `context_window_fallbacks` in turn (models with a longer one)."""
        response = await self._forward_chain(request, spec, endpoint, payload, body, stream, start)
        for name in spec.context_window_fallbacks:
            target = self.resolve(name)
            if target is None or not _context_exceeded(response):
                break
            response = await self._forward_chain(request, target, endpoint, payload, body, stream, start)
            self.metrics.failovers.labels(spec.name, target.name).inc()
        return response

    async def _forward_chain(self, request: Request, spec: ModelSpec, endpoint: str, payload: dict[str, Any],
                             body: bytes, stream: bool, start: float) -> Response:
        chain = [spec] + [s for s in (self.resolve(f) for f in spec.fallbacks) if s is not None]
        outcome = _Outcome([])
        deadline = None if spec.policy.request_timeout_s is None else start + spec.policy.request_timeout_s
        # Every non-streamed generation is asked for as progress: its tokens are counted as they come, so one cut
        # short (a timeout, a client gone) is charged what it made; only those in `resume` can go on elsewhere.
        progress = endpoint != "embeddings" and not stream
        for target in chain:
            group = self.pool.group(target.name)
            if group is None or target.type not in ENDPOINTS[endpoint][1]:
                continue
            # the name its replicas answer to (a command replica's server may have its own; replies get ours back)
            served = target.served_name
            content = body if served == payload["model"] else json.dumps({**payload, "model": served}).encode()
            key = routing_key(target, request, payload)
            resume = None
            # A whole reply with logprobs cannot be continued: the first replica's are not in its progress.
            if endpoint != "embeddings" and payload.get("n", 1) == 1 and (stream or _no_logprobs(payload)):
                options = payload.get("stream_options")
                include_usage = isinstance(options, dict) and options.get("include_usage") is True
                resume = _Resume(group, ENDPOINTS[endpoint][0], {**payload, "model": served}, include_usage)
            try:
                call = _Call(start, spec.name, key, deadline, resume, progress,
                             None if served == target.name else _Rename(served, target.name))
                response = await self._try_group(request, group, endpoint, content, stream, call)
            except ReplicaFailure as failure:
                outcome.timed_out = failure.timeout
                continue
            except ReplicaOverloaded as overloaded:
                outcome.retry_after_s.append(overloaded.retry_after_s)
                continue
            except NoReplica:
                continue
            except ColdStartFailed as failed:
                outcome.cold_start = outcome.cold_start or failed
                continue
            if target is not spec:
                self.metrics.failovers.labels(spec.name, target.name).inc()
            return response
        raise outcome.error(spec, self.settings.request_timeout_s)

    async def _try_group(self, request: Request, group: InstanceGroup, endpoint: str, content: bytes, stream: bool,
                         call: _Call) -> Response:
        # A plain loop with a pure backoff, not a retry library's wrapper: tenacity's AsyncRetrying cost ~40 µs per
        # request (its per-attempt action wrapping), a twentieth of the gateway's whole budget.
        tried: set[str] = set()
        for attempt in itertools.count(1):
            replica = self.pool.choose(group, tried, call.key)
            if replica is None and attempt == 1 and group.spec.on_demand:
                replica = await self._cold_start(request, group)
            if replica is None:
                raise NoReplica(group.spec.name)
            tried.add(replica.replica_id)
            request_context(request.scope).replica = replica.replica_id
            try:
                return await self._send(request, replica, endpoint, content, stream, call)
            except (ReplicaFailure, ReplicaOverloaded) as err:
                # Retry only while an untried replica is left: otherwise the last failure is reraised, so the chain
                # can tell overload (429) or a timeout (504) from a failure (503), and no retry is counted for nothing.
                untried = any(r.routable() and r.replica_id not in tried for r in group.replicas)
                if attempt >= self.settings.max_attempts or not untried:
                    raise
                self.metrics.retries.labels(call.model).inc()
                if isinstance(err, ReplicaFailure):  # a full queue elsewhere is no reason to wait; a fault is
                    await self.sleep(Backoff(self.settings.backoff_s, self.settings.backoff_max_s).delay_s(attempt))
        raise AssertionError("unreachable: itertools.count() does not end")

    async def _cold_start(self, request: Request, group: InstanceGroup) -> Replica | None:
        """The replica a model on demand starts for this request (or another's start it shares): how long it
        waited is the request's (its log line, `cold_start_wait_seconds`). Raises `ColdStartFailed`."""
        started = self.clock()
        try:
            replica = await self.pool.cold_start(group)
        finally:
            waited = self.clock() - started
            request_context(request.scope).cold_start_s = waited
            self.metrics.cold_start_wait.labels(group.spec.name).observe(waited)
        return replica if replica.routable() else None

    async def _start_for_continuation(self, group: InstanceGroup, give_up: float) -> Replica | None:
        """A replica started on demand for a continuation that found none (its own was evicted or drained), within
        what is left of its wait; None when the start fails or takes longer (the continuation then gives up as it
        would have)."""
        try:
            replica = await asyncio.wait_for(self.pool.cold_start(group), max(0.0, give_up - self.clock()))
        except (ColdStartFailed, asyncio.TimeoutError):
            return None
        return replica if replica.routable() else None

    async def _send(self, request: Request, replica: Replica, endpoint: str, content: bytes, stream: bool,
                    call: _Call) -> Response:
        context = request_context(request.scope)
        headers = {"content-type": "application/json", "x-request-id": context.request_id, **replica.auth_headers()}
        # the replica classifies the request's lane (policies/classify.py): the body's priority, else this
        # header: the lane its API key allows (gateway/lanes.py), else the client's own
        lane = request.headers.get("x-priority") if context.lane is None else str(context.lane)
        if lane:
            headers["x-priority"] = lane
        resumable = call.resume is not None
        asks_ids = resumable or call.progress  # token ids: to go on elsewhere, or to count what a reply made
        if asks_ids:
            headers[RESUMABLE_HEADER] = "1"
        lease = self.pool.lease(replica)
        handed_over = False
        try:
            response = await self._open(replica.base_url + ENDPOINTS[endpoint][0], content, headers, lease)
            if (not stream and asks_ids and response.status_code == 200
                    and response.headers.get(RESUMABLE_HEADER) == "1"):
                chunks, first = await self._first_bytes(response, lease)
                handed_over = True
                leg = _Leg(replica, response, lease, self._pump(chunks, resumable), first, resumable)
                return await self._whole_reply(request, leg, call, headers)
            if not stream or response.status_code != 200:
                data = await self._read_all(response, lease)
                lease.succeeded()
                return Response(_renamed(data, call.rename), status_code=response.status_code,
                                media_type=response.headers.get("content-type", "application/json"))
            chunks, first = await self._first_bytes(response, lease)
            handed_over = True
            prompt_tokens = response.headers.get(PROMPT_TOKENS_HEADER, "")
            if prompt_tokens.isdigit() and len(prompt_tokens) < 12:  # for the key's token limit and the traffic log
                context.prompt_tokens = int(prompt_tokens)
            resume = call.resume if resumable and response.headers.get(RESUMABLE_HEADER) == "1" else None
            leg = _Leg(replica, response, lease, self._pump(chunks, resume is not None), first, resume is not None)
            return _Relayed(self._relay(request, leg, call, resume, headers), leg)
        finally:
            if not handed_over:
                lease.release()

    def _pump(self, chunks: AsyncIterator[bytes], resumable: bool) -> Pump:
        """A resumable stream's pump watches for a stall (it then goes on elsewhere); any other reads on."""
        return Pump(chunks, stall_s=self.settings.stream_stall_s if resumable else None)

    async def _first_bytes(self, response: UpstreamReply, lease: Lease) -> tuple[AsyncIterator[bytes], bytes]:
        chunks = response.aiter_raw()
        try:
            return chunks, await anext(chunks, b"")
        except UpstreamError as err:
            await response.aclose()
            raise self._fail(lease, f"stream broke before the first byte: {err!r}") from err

    async def _open(self, url: str, content: bytes, headers: dict[str, str], lease: Lease) -> UpstreamReply:
        try:
            response = await self.upstream.post(url, content, headers, self.timeouts)
        except UpstreamTimeout as err:
            raise self._fail(lease, f"timed out: {err!r}", timeout=True) from err
        except UpstreamError as err:
            raise self._fail(lease, f"connection failed: {err!r}") from err
        if response.status_code >= 500 and response.headers.get(ERROR_SCOPE_HEADER) != "request":
            await response.aclose()
            raise self._fail(lease, f"answered {response.status_code}")
        if response.status_code == 429:
            await response.aclose()
            lease.succeeded()  # it answered, and sanely: a full queue is not a fault
            raise ReplicaOverloaded(lease.replica, _retry_after_s(response))
        return response

    async def _read_all(self, response: UpstreamReply, lease: Lease) -> bytes:
        try:
            return await response.aread()
        except UpstreamError as err:
            raise self._fail(lease, f"reply broke: {err!r}", timeout=isinstance(err, UpstreamTimeout)) from err
        finally:
            await response.aclose()

    def _fail(self, lease: Lease, cause: str, timeout: bool = False) -> ReplicaFailure:
        lease.failed()
        log.warning("replica_request_failed", replica=lease.replica.replica_id, cause=cause)
        return ReplicaFailure(lease.replica, cause, timeout)

    async def _relay(self, request: Request, leg: _Leg, call: _Call, resume: _Resume | None,
                     headers: dict[str, str]) -> AsyncGenerator[bytes, None]:
        """Pass the replica's SSE bytes through as they come. A resumable stream (`resume`) that breaks off midway
        (the replica fails or stalls, or is drained with migration) goes on on another replica of the model, on the
        same connection (gateway/resume.py); any other break, or the request's deadline, ends the stream with an
        error event (closing the upstream connection aborts the request on the replica)."""
        model = call.model
        tracker = None if resume is None else StreamTracker(resume.include_usage, self.settings.max_event_bytes)
        tried = {leg.replica.replica_id}
        budget = self._budget()
        try:
            self.metrics.ttft.labels(model).observe(self.clock() - call.start)
            if request_context(request.scope).cold_start_s is not None:
                self.metrics.cold_ttft.labels(model).observe(self.clock() - call.start)
            while True:
                num_before = 0 if tracker is None else len(tracker.token_ids)
                try:
                    chunk: bytes | None = leg.first
                    while chunk is not None:
                        yield _renamed(chunk if tracker is None else tracker.feed(chunk), call.rename)
                        chunk = await self._next(leg, call)
                    leg.lease.succeeded()
                    return
                except UpstreamMalformed as err:  # a misbehaving replica: its answer ends here, whatever it was
                    await self._let_go(leg, err)
                    yield err.before + _error_event(_malformed(model, err))
                    return
                except (UpstreamError, Moved) as err:
                    await self._let_go(leg, err)
                    if tracker is None or resume is None or not (tracker.resumable or tracker.finished):
                        if not (tracker is not None and (tracker.done or tracker.failed)):
                            yield _error_event(_interrupted(model))
                        return
                    if tracker.finished:  # only the usage chunk and [DONE] were missing
                        yield tracker.ending(request_context(request.scope).prompt_tokens)
                        return
                    next_leg = await self._resume(request, leg, err, resume, tracker.continuation(resume.payload),
                                                  len(tracker.token_ids), call, headers, tried, budget,
                                                  progressed=len(tracker.token_ids) > num_before)
                    if next_leg is None:
                        yield _error_event(_interrupted(model))
                        return
                    leg = next_leg
        except TimeoutError:
            assert call.deadline is not None
            yield _error_event(_timeout(model, call.deadline - call.start))
        finally:
            await leg.close()
            self.metrics.e2e.labels(model).observe(self.clock() - call.start)

    async def _whole_reply(self, request: Request, leg: _Leg, call: _Call, headers: dict[str, str]) -> Response:
        """A non-streamed generation, read as progress (foundation/http/wire.py PROGRESS_MEDIA_TYPE). When its replica
        fails, stalls, answers 503 (its engine died) or is drained with migration before the reply line has come, a
        resumable one (`call.resume`) is generated on to its end on another replica, within the resumption budget,
        and the client gets the one whole reply that ends it; any other is retried from the start elsewhere, as a
        reply read whole would be. A malformed or oversized reply is a 502. The tokens every leg reported go to the
        request's context, for what a reply cut short is charged."""
        progress = ProgressTracker(self.settings.max_reply_bytes, self.settings.max_event_bytes)
        tried = {leg.replica.replica_id}
        budget = self._budget()
        try:
            while True:
                num_before = len(progress.token_ids)
                try:
                    chunk: bytes | None = leg.first
                    while chunk is not None:
                        progress.feed(chunk)
                        chunk = await self._next(leg, call)
                    if progress.reply is None or progress.reply[0] == 503:
                        raise UpstreamError("the reply ended before its last line" if progress.reply is None
                                            else "answered 503 midway")
                    status, body = progress.reply_json()
                    leg.lease.succeeded()
                    return Response(_renamed(body, call.rename), status_code=status, media_type="application/json")
                except UpstreamMalformed as err:
                    await self._let_go(leg, err)
                    raise _malformed(call.model, err) from err
                except (UpstreamError, Moved) as err:
                    await self._let_go(leg, err)
                    if call.resume is None:  # cannot go on elsewhere: try it afresh on another replica
                        raise ReplicaFailure(leg.replica, f"reply broke: {err!r}",
                                             timeout=isinstance(err, UpstreamTimeout)) from err
                    next_leg = await self._resume(request, leg, err, call.resume,
                                                  progress.continuation(call.resume.payload), len(progress.token_ids),
                                                  call, headers, tried, budget,
                                                  progressed=len(progress.token_ids) > num_before)
                    if next_leg is None:
                        raise APIError(503, f"model {call.model!r}: the replica failed midway and no other could "
                                            f"finish the reply", code="reply_interrupted") from err
                    leg = next_leg
        finally:
            request_context(request.scope).generated_tokens += len(progress.token_ids)
            await leg.close()

    def _budget(self) -> ResumeBudget:
        return ResumeBudget(self.settings.max_resumes, self.settings.resume_wait_s)

    async def _let_go(self, leg: _Leg, err: Exception) -> None:
        """Close a leg that broke off midway; held against its replica unless it was moved or went quiet (it may just
        be busy)."""
        if isinstance(err, (Moved, Stalled)):
            leg.lease.succeeded()
        else:
            self._fail(leg.lease, f"reply broke midway: {err!r}")
        await leg.close()

    async def _resume(self, request: Request, leg: _Leg, err: Exception, resume: _Resume, body: bytes, num_tokens: int,
                      call: _Call, headers: dict[str, str], tried: set[str], budget: ResumeBudget,
                      progressed: bool) -> _Leg | None:
        """The continuation (`body`: after `num_tokens` generated) of what broke off on `leg`, opened on another
        replica of the model (`_continuation`), counted and logged; None if the request's resumption budget is spent
        (`progressed`: whether the broken leg made new tokens) or no replica could take it."""
        if not budget.spend(progressed):
            return None
        next_leg = await self._continuation(request, resume, body, call, headers, tried, budget)
        if next_leg is None:
            return None
        cause = _cause(err, leg.replica)
        self.metrics.migrations.labels(call.model, cause).inc()
        self.metrics.resumed_tokens.labels(call.model).inc(num_tokens)
        log.info("generation_resumed", model=call.model, cause=cause, replica=next_leg.replica.replica_id,
                 from_replica=leg.replica.replica_id, tokens_generated=num_tokens)
        return next_leg

    async def _next(self, leg: _Leg, call: _Call) -> bytes | None:
        """The next chunk (None at the end); TimeoutError at the request's deadline. (A timeout scope: wait_for
        would drop a cancellation that comes as a chunk does, the client's departure among them.)"""
        if call.deadline is None:
            return await leg.pump.get()
        async with asyncio.timeout(max(call.deadline - self.clock(), 0.0)):
            return await leg.pump.get()

    async def _continuation(self, request: Request, resume: _Resume, body: bytes, call: _Call,
                            headers: dict[str, str], tried: set[str], budget: ResumeBudget) -> _Leg | None:
        """Open the rest of a broken generation (`body`) on another ready replica of the model, waiting (with backoff,
        within the request's deadline and what is left of its `resume_wait_s`) for one to be ready; None if none
        could take it."""
        started = self.clock()
        give_up = started + budget.wait_left_s
        if call.deadline is not None:
            give_up = min(give_up, call.deadline)
        try:
            return await self._open_continuation(resume, body, call, headers, tried, give_up)
        finally:
            budget.waited(self.clock() - started)

    async def _open_continuation(self, resume: _Resume, body: bytes, call: _Call, headers: dict[str, str],
                                 tried: set[str], give_up: float) -> _Leg | None:
        for attempt in itertools.count(1):
            replica = self.pool.choose(resume.group, tried, call.key)
            if replica is None:  # none untried: any ready one will do (a restarted replica is a fresh process)
                replica = self.pool.choose(resume.group, set(), call.key)
            if replica is None and resume.group.spec.on_demand:  # none at all: a model on demand starts one
                replica = await self._start_for_continuation(resume.group, give_up)
            if replica is not None:
                tried.add(replica.replica_id)
                own = {k: v for k, v in headers.items() if k != "authorization"}  # the first replica's token stays
                leg = await self._open_leg(replica, resume.path, body, {**own, **replica.auth_headers()})
                if leg is not None:
                    return leg
            if self.clock() >= give_up:
                return None
            await self.sleep(Backoff(self.settings.backoff_s, self.settings.backoff_max_s).delay_s(attempt))
        raise AssertionError("unreachable: itertools.count() does not end")

    async def _open_leg(self, replica: Replica, path: str, body: bytes, headers: dict[str, str]) -> _Leg | None:
        """The continuation's reply from `replica`, or None if it did not take it. Whatever ends the wait (the
        client leaving included) lets go of the lease and the reply unless they were handed over."""
        lease = self.pool.lease(replica)
        response: UpstreamReply | None = None
        leg: _Leg | None = None
        try:
            response = await self._open(replica.base_url + path, body, headers, lease)
            if response.status_code != 200 or response.headers.get(RESUMABLE_HEADER) != "1":
                return None
            chunks, first = await self._first_bytes(response, lease)
            leg = _Leg(replica, response, lease, self._pump(chunks, True), first)
            return leg
        except (ReplicaFailure, ReplicaOverloaded):
            return None
        finally:
            if leg is None:
                lease.release()
                if response is not None:
                    with anyio.CancelScope(shield=True):
                        await response.aclose()


class _Relayed(StreamingResponse):
    """The relayed stream. However the response ends, the relay is closed, and so is its first leg: a client gone
    before the first body byte never starts the relay, whose own cleanup would then never run (the replica would go
    on generating for nobody)."""

    def __init__(self, relay: AsyncGenerator[bytes, None], first_leg: _Leg) -> None:
        super().__init__(relay, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._relay, self._first_leg = relay, first_leg

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._relay.aclose()
                await self._first_leg.close()  # (idempotent: the relay closes its legs when it ran)


@dataclass
class _Leg:
    """One replica's part of a relayed stream: its reply, the lease on it, the pump that reads it and the first bytes
    it sent. A movable leg's pump stops (the relay goes on elsewhere) when the replica is drained with migration or
    found unhealthy."""

    replica: Replica
    response: UpstreamReply
    lease: Lease
    pump: Pump
    first: bytes
    movable: bool = True

    def __post_init__(self) -> None:
        if self.movable:
            self.lease.movable(self.pump.stop)

    async def close(self) -> None:
        """Let go of the replica; closing a reply before its end aborts the request there. Shielded: this runs when
        the client left too, inside a cancelled scope, where any wait would be cut short and the replica would go on
        generating for nobody."""
        self.lease.release()
        self.pump.cancel()
        with anyio.CancelScope(shield=True):
            await self.response.aclose()


@dataclass(frozen=True)
class _Resume:
    """What a resumable stream needs to go on elsewhere: the model's group, the replica path, the request's body
    (as sent to the first replica) and whether it asked for a usage chunk."""

    group: InstanceGroup
    path: str
    payload: dict[str, Any]
    include_usage: bool


def _no_logprobs(payload: dict[str, Any]) -> bool:
    """Whether a generation request asks for no logprobs (completions: null; chat: false or absent; 0 asks)."""
    logprobs = payload.get("logprobs")
    return logprobs is None or logprobs is False


def _cause(err: Exception, replica: Replica) -> str:
    """Why a stream moved, for the migrations metric."""
    if isinstance(err, Moved):
        return "drained" if replica.state == ReplicaState.DRAINING else "replica_unhealthy"
    return "stalled" if isinstance(err, Stalled) else "replica_failed"


def _malformed(model: str, err: UpstreamMalformed) -> APIError:
    return APIError(502, f"model {model!r}: the replica's reply was malformed ({err}); it was cut off",
                    code="bad_upstream_reply")


def _interrupted(model: str) -> APIError:
    return APIError(503, f"model {model!r}: the replica failed while streaming; the reply is incomplete",
                    code="stream_interrupted")


@dataclass(frozen=True)
class _Call:
    """One client request as it is tried on replicas: when it started, for which model, its routing key and
    the deadline (on the forwarder's clock) of its `request_timeout_s`."""

    start: float
    model: str
    key: str | None
    deadline: float | None
    resume: _Resume | None = None  # set for a generation of one choice that can go on elsewhere
    progress: bool = False  # a non-streamed generation: asked for as progress, its tokens counted as they come
    rename: _Rename | None = None  # its replicas answer to another name than the model's


class _Rename:
    """A reply's `"model"` field as the replica's server names it, back to the registry's name. Byte replacement is
    safe: inside a JSON string value the quotes around such a pair would be escaped, so it matches only the field."""

    def __init__(self, served: str, name: str) -> None:
        old, new = json.dumps(served).encode(), json.dumps(name).encode()
        self.pairs = [(b'"model":' + old, b'"model":' + new), (b'"model": ' + old, b'"model": ' + new)]

    def apply(self, data: bytes) -> bytes:
        for old, new in self.pairs:
            data = data.replace(old, new)
        return data


def _renamed(data: bytes, rename: _Rename | None) -> bytes:
    return data if rename is None else rename.apply(data)


def routing_key(spec: ModelSpec, request: Request, payload: dict[str, Any]) -> str | None:
    """What keyed routing hashes: the session header (`session`), or the head of the prompt
    (`prefix_affinity`: requests that share a long prefix land where its KV blocks are cached)."""
    policy = spec.policy
    if policy.routing == "session":
        return request.headers.get(policy.session_header) or None
    if policy.routing != "prefix_affinity":
        return None
    head = _prompt_head(payload, policy.prefix_chars)
    return head or None


def _prompt_head(payload: dict[str, Any], num_chars: int) -> str:
    """The first `num_chars` characters of a completion prompt or of the chat messages in order."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], (str, list)) else prompt
        prompt = " ".join(map(str, prompt)) if isinstance(prompt, list) else prompt
    if isinstance(prompt, str):
        return prompt[:num_chars]
    parts: list[str] = []
    size = 0
    for message in payload.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # content parts: their text
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        text = f"{message.get('role')}:{content}\n" if isinstance(content, str) else ""
        parts.append(text)
        size += len(text)
        if size >= num_chars:
            break
    return "".join(parts)[:num_chars]


def _context_exceeded(response: Response) -> bool:
    if response.status_code != 400 or isinstance(response, StreamingResponse):
        return False
    try:
        error = json.loads(bytes(response.body)).get("error") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "context_length_exceeded"


def _retry_after_s(response: UpstreamReply) -> float:
    """A replica's Retry-After in seconds (1 when missing or given as a date)."""
    try:
        return max(float(response.headers.get("retry-after", "1")), 0.0)
    except ValueError:
        return 1.0


def _timeout(model: str, timeout_s: float) -> APIError:
    return APIError(504, f"model {model!r}: the request did not finish within its request_timeout_s="
                         f"{timeout_s:g} s and was aborted", code="request_timeout")


def _error_event(error: APIError) -> bytes:
    return f"data: {json.dumps(error_payload(error))}\n\ndata: [DONE]\n\n".encode()
