"""Fakes at the gateway's narrow seams: replicas behind an httpx mock transport, a launcher that starts
nothing, and a clock and sleep that move only when told. No processes, no sockets, no waiting.

A fake replica lives at `http://fake-<model>-<index>:80` (what `FakeLauncher` hands out) and behaves as its
current behaviour says; tests switch behaviours at runtime by replica id (`"alpha/0"`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import GatewayState, build_gateway
from gateway.auth_keys import ApiKey
from gateway.metrics import GatewayMetrics
from gateway.proxy import Forwarder, ProxySettings
from gateway.server import make_state
from gateway.upstream import HttpxUpstream
from model_pool.launcher import UrlLauncher
from model_pool.pool import ModelPool, PoolSettings
from model_pool.residency import FootprintFor
from registry.launch import ReplicaLaunch
from registry.store import RegistryStore

BEHAVIOURS = frozenset({"ok", "down", "error500", "error400", "hang", "break_midstream", "break_at_start", "not_ready",
                        "overloaded", "slow", "stall_midstream", "context", "request_fault", "timeout_midbody",
                        "break_before_done"})
SLOW_S = 30.0  # how long a "slow" replica takes (real time: the gateway's deadline must cut it short)
NUM_STREAM_CHUNKS = 4  # content chunks a streaming reply carries before `data: [DONE]`
ADMIN_TOKEN = "admin-secret"

REGISTRY = """\
# Gateway test registry: keep this comment.
gateway: {host: 127.0.0.1, port: 0, model_roots: [/], max_body_bytes: 2048}

models:
  # the main chat model
  - name: alpha
    aliases: [a]
    type: chat
    source: {path: /models/alpha.gguf}
    replicas: 2
    fallbacks: [beta]

  - name: beta   # alpha's fallback
    type: chat
    source: {path: /models/beta.gguf}
    replicas: 1

  - name: emb
    type: embedding
    source: {path: /models/emb.safetensors}
    replicas: 1

  - name: comp
    type: completion
    source: {path: /models/comp.gguf}
    replicas: 1
"""


def host_for(replica_id: str) -> str:
    model, index = replica_id.rsplit("/", 1)
    return f"fake-{model}-{index}"


# ------------------------------------------------------------------------------------ time


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeSleep:
    """Records each delay and moves the fake clock by it instead of waiting (yields once to the loop)."""

    def __init__(self, clock: FakeClock, on_sleep: Callable[[float], None] | None = None) -> None:
        self.clock = clock
        self.on_sleep = on_sleep
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        self.clock.advance(seconds)
        if self.on_sleep is not None:
            self.on_sleep(seconds)
        await asyncio.sleep(0)


# ------------------------------------------------------------------------------------ replicas


class ChunkStream(httpx.AsyncByteStream):
    """An async response body: the given chunks one by one, then `error` raised from the iterator if set."""

    def __init__(self, chunks: list[bytes], error: httpx.HTTPError | None = None, stall_after: int | None = None
                 ) -> None:
        self.chunks = chunks
        self.error = error
        self.stall_after = stall_after  # chunks sent before the stream goes silent for SLOW_S
        self.closed = False
        self.sent = 0  # chunks handed out so far

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(self.chunks):
            await asyncio.sleep(SLOW_S if i == self.stall_after else 0)
            self.sent += 1
            yield chunk
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed = True


@dataclass(frozen=True)
class Received:
    host: str
    path: str
    body: dict[str, Any]
    headers: Mapping[str, str]


class FakeReplicas:
    """An `httpx.MockTransport` handler standing in for every replica worker, keyed by URL host."""

    def __init__(self) -> None:
        self.behaviours: dict[str, str] = {}  # host -> behaviour; absent means "ok"
        self.requests: Counter[str] = Counter()  # host -> POSTs received (whatever the behaviour)
        self.probes: Counter[str] = Counter()  # host -> GET /ready received
        self.probe_auth: list[str | None] = []  # the Authorization header of each probe
        self.probe_paths: dict[str, str] = {}  # host -> the path of its last probe
        self.received: list[Received] = []
        self.streams: list[ChunkStream] = []
        self.on_request: Callable[[Received], None] | None = None  # called as each POST arrives
        self.cancelled: Counter[str] = Counter()  # host -> "slow" requests the gateway gave up on
        # host -> what answers its POSTs instead of a behaviour (a replica misbehaving in a way of the test's own)
        self.scripts: dict[str, Callable[[Received], httpx.Response]] = {}

    def set(self, replica_id: str, behaviour: str) -> None:
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"unknown behaviour {behaviour!r}; known: {sorted(BEHAVIOURS)}")
        self.behaviours[host_for(replica_id)] = behaviour

    def set_all(self, replica_ids: tuple[str, ...] | list[str], behaviour: str) -> None:
        for replica_id in replica_ids:
            self.set(replica_id, behaviour)

    def script(self, replica_ids: tuple[str, ...] | list[str], respond: Callable[[Received], httpx.Response]) -> None:
        """POSTs to these replicas are answered by `respond` (probes stay sane)."""
        for replica_id in replica_ids:
            self.scripts[host_for(replica_id)] = respond

    def count(self, replica_id: str) -> int:
        return self.requests[host_for(replica_id)]

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        behaviour = self.behaviours.get(host, "ok")
        if request.method == "GET":  # a probe: /ready, or a command replica's health path
            self.probe_paths[host] = request.url.path
            self.probes[host] += 1
            self.probe_auth.append(request.headers.get("authorization"))
            return self._refuse(request, behaviour) or httpx.Response(200, json={"status": "ready"})
        self.requests[host] += 1
        body = json.loads(request.content)
        received = Received(host, request.url.path, body, dict(request.headers))
        self.received.append(received)
        if self.on_request is not None:
            self.on_request(received)
        if host in self.scripts:
            scripted = self.scripts[host](received)
            if isinstance(scripted.stream, ChunkStream):
                self.streams.append(scripted.stream)
            return scripted
        refused = self._refuse(request, behaviour)
        if refused is not None:
            return refused
        if behaviour == "slow":
            try:
                await asyncio.sleep(SLOW_S)
            except asyncio.CancelledError:
                self.cancelled[host] += 1
                raise
        resumable = request.headers.get("x-multiserve-resumable") == "1"
        if body.get("stream") is True:
            return self._stream(host, body, behaviour, resumable)
        if resumable:
            return self._progress(host, request.url.path, body, behaviour)
        return httpx.Response(200, json=_reply(host, request.url.path, body))

    def _refuse(self, request: httpx.Request, behaviour: str) -> httpx.Response | None:
        host = request.url.host
        if behaviour == "down":
            raise httpx.ConnectError(f"{host}: connection refused", request=request)
        if behaviour == "hang":
            raise httpx.ReadTimeout(f"{host}: no answer", request=request)
        if behaviour == "error500":
            return httpx.Response(500, json={"error": {"message": f"{host} broke", "type": "internal_server_error",
                                                       "param": None, "code": None}})
        if behaviour == "not_ready":
            return httpx.Response(503, json={"status": "loading"})
        if behaviour == "request_fault" and request.method != "GET":  # one request's fault, marked so
            return httpx.Response(500, headers={"x-multiserve-error-scope": "request"}, json={"error": {
                "message": "the engine failed while serving this request (error id err-1)",
                "type": "internal_server_error", "param": None, "code": "request_failed"}})
        if behaviour == "timeout_midbody" and request.method != "GET":  # the head came, the body stalls
            return httpx.Response(200, headers={"content-type": "application/json"}, stream=ChunkStream(
                [b'{"id": "chatcmpl-fake", '], httpx.ReadTimeout(f"{host}: body stalled", request=request)))
        if behaviour == "overloaded" and request.method != "GET":
            return httpx.Response(429, headers={"retry-after": "7"}, json={"error": {
                "message": "the replica is overloaded", "type": "rate_limit_error", "param": None,
                "code": "overloaded"}})
        if behaviour == "context" and request.method != "GET":
            return httpx.Response(400, json={"error": {
                "message": "this model's maximum context length is 512 tokens", "type": "invalid_request_error",
                "param": "prompt", "code": "context_length_exceeded"}})
        if behaviour == "error400" and request.method != "GET":  # the request's fault, not the replica's
            return httpx.Response(400, json={"error": {"message": "max_tokens: too large", "param": "max_tokens",
                                                       "type": "invalid_request_error", "code": None}})
        return None

    def _stream(self, host: str, body: dict[str, Any], behaviour: str, resumable: bool = False) -> httpx.Response:
        if resumable:
            return self._resumable_stream(host, body, behaviour)
        chunks = [sse({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": body.get("model"),
                       "replica": host, "choices": [{"index": 0, "delta": {"content": f"tok{i}"}}]})
                  for i in range(NUM_STREAM_CHUNKS)] + [b"data: [DONE]\n\n"]
        return self._send_stream(host, chunks, behaviour)

    def _resumable_stream(self, host: str, body: dict[str, Any], behaviour: str) -> httpx.Response:
        """A stream as a replica sends it to a gateway that may resume it: token `i` is id 100 + i with text
        `tok<i>`, each event after a comment line with its id; a continuation (`multiserve_resume`) goes on after
        the tokens it names, with its id."""
        resume = body.get("multiserve_resume") or {}
        start = len(resume.get("token_ids", ()))
        stream_id = resume.get("id", f"chatcmpl-{host}")
        chunks = []
        for i in range(start, NUM_STREAM_CHUNKS):
            last = i == NUM_STREAM_CHUNKS - 1
            chunk = {"id": stream_id, "object": "chat.completion.chunk", "created": 7, "model": body.get("model"),
                     "replica": host, "choices": [{"index": 0, "delta": {"content": f"tok{i}"},
                                                   "finish_reason": "length" if last else None}]}
            chunks.append(f": multiserve-tokens {100 + i}\n".encode() + sse(chunk))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "completion_tokens": NUM_STREAM_CHUNKS, "total_tokens": 3 + NUM_STREAM_CHUNKS}
            chunks.append(sse({"id": stream_id, "object": "chat.completion.chunk", "created": 7,
                               "model": body.get("model"), "choices": [], "usage": usage}))
        return self._send_stream(host, [*chunks, b"data: [DONE]\n\n"], behaviour, {"x-multiserve-resumable": "1"})

    def _progress(self, host: str, path: str, body: dict[str, Any], behaviour: str) -> httpx.Response:
        """A whole reply as a replica sends it to a gateway that may continue it: the ids of tokens 100 + i (all but
        the last), then the reply line and the reply, whose text is every token's `tok<i>` (a continuation's too)."""
        resume = body.get("multiserve_resume") or {}
        chunks = [f": multiserve-tokens {100 + i}\n".encode()
                  for i in range(len(resume.get("token_ids", ())), NUM_STREAM_CHUNKS - 1)]
        reply = _reply(host, path, body)
        text = "".join(f"tok{i}" for i in range(NUM_STREAM_CHUNKS))
        if path == "/v1/completions":
            reply["choices"][0]["text"] = text
        else:
            reply["choices"][0]["message"]["content"] = text
        reply["usage"] = {"prompt_tokens": 3, "completion_tokens": NUM_STREAM_CHUNKS, "total_tokens": 7}
        chunks.append(b": multiserve-reply 200\n" + json.dumps(reply).encode())
        return self._send_stream(host, chunks, behaviour, {"content-type": "application/x-multiserve-progress",
                                                           "x-multiserve-resumable": "1"})

    def _send_stream(self, host: str, chunks: list[bytes], behaviour: str,
                     headers: dict[str, str] | None = None) -> httpx.Response:
        error = None
        if behaviour == "break_midstream":
            chunks, error = chunks[:2], httpx.ReadError(f"{host}: connection reset mid-stream")
        elif behaviour == "break_at_start":
            chunks, error = [], httpx.ReadError(f"{host}: connection reset before the first byte")
        elif behaviour == "break_before_done":
            chunks, error = chunks[:-1], httpx.ReadError(f"{host}: connection reset before [DONE]")
        stream = ChunkStream(chunks, error, stall_after=2 if behaviour == "stall_midstream" else None)
        self.streams.append(stream)
        return httpx.Response(200, headers={"content-type": "text/event-stream", "x-multiserve-prompt-tokens": "3",
                                            **(headers or {})}, stream=stream)


def raw_reply(chunks: list[bytes], progress: bool, error: httpx.HTTPError | None = None,
              stall_after: int | None = None) -> httpx.Response:
    """A reply whose body is `chunks` as given (then `error`, if set): a whole reply sent as progress, or a resumable
    SSE stream; for scripts of replicas that misbehave."""
    media = "application/x-multiserve-progress" if progress else "text/event-stream"
    return httpx.Response(200, headers={"content-type": media, "x-multiserve-resumable": "1",
                                        "x-multiserve-prompt-tokens": "3"},
                          stream=ChunkStream(chunks, error, stall_after))


def sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _reply(host: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    model = body.get("model")
    if path == "/v1/embeddings":
        return {"object": "list", "model": model, "replica": host,
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                "usage": {"prompt_tokens": 2, "total_tokens": 2}}
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    if path == "/v1/completions":
        return {"id": "cmpl-fake", "object": "text_completion", "model": model, "replica": host,
                "choices": [{"index": 0, "text": f"hello from {host}", "finish_reason": "stop"}], "usage": usage}
    return {"id": "chatcmpl-fake", "object": "chat.completion", "model": model, "replica": host,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"hello from {host}"},
                         "finish_reason": "stop"}], "usage": usage}


def chat(model: str = "alpha", **extra: Any) -> dict[str, Any]:
    """A chat completion request body."""
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a response, checking the shape on the way."""
    body = response.json()
    assert list(body) == ["error"], body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# ------------------------------------------------------------------------------------ launcher


@dataclass(eq=False)  # compared by identity: a restart is a new handle even with the same URL
class FakeHandle:
    base_url: str
    request: ReplicaLaunch = field(repr=False)
    pid: int | None = None  # a made-up process id, distinct per start
    exit: int | None = None  # set it to simulate a crash
    token: str | None = None  # what requests to it carry (FakeLauncher gives each start its own)
    stop_timeouts: list[float] = field(default_factory=list)

    @property
    def stopped(self) -> bool:
        return bool(self.stop_timeouts)

    def exit_code(self) -> int | None:
        return self.exit

    def output_tail(self) -> str:
        return f"output of pid {self.pid}\n"

    def crash(self, code: int = 1) -> None:
        self.exit = code

    async def stop(self, timeout_s: float) -> None:
        self.stop_timeouts.append(timeout_s)
        if self.exit is None:
            self.exit = -15  # as a SIGTERMed process reports


class FakeLauncher:
    """The `Launcher` protocol without processes: every start() is recorded and returns a `FakeHandle`."""

    def __init__(self) -> None:
        self.handles: list[FakeHandle] = []

    async def start(self, request: ReplicaLaunch) -> FakeHandle:
        handle = FakeHandle(f"http://fake-{request.model}-{request.index}:80", request, pid=40000 + len(self.handles),
                            token=f"token-{len(self.handles)}")
        self.handles.append(handle)
        return handle

    def handles_of(self, replica_id: str) -> list[FakeHandle]:
        model, index = replica_id.rsplit("/", 1)
        return [h for h in self.handles if h.request.model == model and h.request.index == int(index)]

    def latest(self, replica_id: str) -> FakeHandle:
        handles = self.handles_of(replica_id)
        assert handles, f"{replica_id} was never launched"
        return handles[-1]

    def running(self, model: str | None = None) -> list[FakeHandle]:
        return [h for h in self.handles if not h.stopped and (model is None or h.request.model == model)]


# ------------------------------------------------------------------------------------ the whole gateway


@dataclass
class FakeGateway:
    state: GatewayState
    client: httpx.AsyncClient  # talks to the app in-process (ASGI)
    replicas: FakeReplicas
    launcher: FakeLauncher
    clock: FakeClock
    pool_sleep: FakeSleep
    proxy_sleep: FakeSleep
    path: Path  # the registry YAML

    @property
    def pool(self) -> ModelPool:
        return self.state.pool

    @property
    def store(self) -> RegistryStore:
        return self.state.store

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of the gateway's metrics (0.0 when absent)."""
        text = self.state.metrics.render().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0

    def outstanding(self) -> dict[str, int]:
        return {r.replica_id: r.outstanding for g in self.pool.groups.values() for r in g.replicas}


@asynccontextmanager
async def open_gateway(
    tmp_path: Path,
    registry_text: str = REGISTRY,
    pool_settings: PoolSettings | None = None,
    proxy_settings: ProxySettings | None = None,
    api_keys: Mapping[str, ApiKey] | None = None,
    admin_token: str | None = ADMIN_TOKEN,
    ready: bool = True,
    footprint_for: FootprintFor | None = None,
) -> AsyncIterator[FakeGateway]:
    """A gateway wired as `gateway.server.make_state` wires it, with the fakes at its seams.

    `make_state` supplies the name resolution and the secrets from `env`; the pool and forwarder are rebuilt over
    the mock transport, the fake launcher, a fake clock and recording sleeps. With `ready`, every replica is
    launched and probed once, so all are READY.
    """
    path = tmp_path / "registry.yaml"
    path.write_text(registry_text)
    clock = FakeClock()
    store = RegistryStore(path, clock=clock)
    env = {} if admin_token is None else {store.registry.gateway.admin_token_env: admin_token}
    base = make_state(store, pool_settings, proxy_settings, env=env)
    await base.forwarder.upstream.aclose()  # its real clients are replaced by the mock transport below
    replicas, launcher = FakeReplicas(), FakeLauncher()
    pool_sleep, proxy_sleep = FakeSleep(clock), FakeSleep(clock)
    http = httpx.AsyncClient(transport=httpx.MockTransport(replicas.handler))
    pool = ModelPool({"local": launcher, "url": UrlLauncher(), "command": launcher}, http, pool_settings, clock=clock,
                     sleep=pool_sleep, footprint_for=footprint_for)
    metrics = GatewayMetrics(pool)
    forwarder = Forwarder(pool, base.forwarder.resolve, base.forwarder.known_models, HttpxUpstream(http), metrics,
                          proxy_settings, sleep=proxy_sleep, clock=clock)
    state = dataclasses.replace(base, pool=pool, forwarder=forwarder, metrics=metrics, api_keys=dict(api_keys or {}))
    app = build_gateway(state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        gateway = FakeGateway(state, client, replicas, launcher, clock, pool_sleep, proxy_sleep, path)
        if ready:
            await pool.apply(store.registry)
            await pool.tick()
        try:
            yield gateway
        finally:
            await pool.shutdown()
            await http.aclose()


Scenario = Callable[[FakeGateway], Awaitable[None]]
