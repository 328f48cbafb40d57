"""`multiserve worker`: load one model, wrap it in the per-replica app, serve it with uvicorn.

The pool launches one such process per replica (model_pool/launcher.py) with `--type` (the registry's model
type) and `--engine-json` holding the registry's `engine:` section. For chat and completion models those are
EngineConfig fields, plus `kv_cache_gib` as the registry spells the KV budget; for embedding models,
EmbeddingConfig fields, with the registry's `max_num_seqs` as the batch cap (`max_batch_size`), its
paged-KV options dropped (an encoder keeps no KV cache) and `scheduling` only `fcfs`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any, Protocol

import structlog
from starlette.applications import Starlette

from runtimes.embedding.config import EmbeddingConfig
from runtimes.engine_driver import StepGate
from runtimes.llm.config import EngineConfig
from runtimes.server.http_guard import guarded_config
from runtimes.server.replica_auth import ReplicaTokenMiddleware

_GIB = 1 << 30
MODEL_TYPES = ("chat", "completion", "embedding")
HTTP_SWITCH_INTERVAL_S = 0.0005
# The registry's engine options that only a paged-KV decoder has; an embedding worker drops them.
_KV_ONLY_OPTIONS = frozenset({"block_size", "max_num_batched_tokens", "kv_cache_gib", "kv_cache_bytes",
                              "enable_prefix_caching"})


def engine_config(options: Mapping[str, Any], device: str | None = None) -> EngineConfig:
    """An EngineConfig from registry-style options; unknown keys are refused by name.

    `kv_cache_gib` (GiB, may be fractional) becomes `kv_cache_bytes`; `device`, when given, must agree
    with any `device` in `options`.
    """
    data = dict(options)
    if "kv_cache_gib" in data:
        if data.get("kv_cache_bytes") is not None:
            raise ValueError("give kv_cache_gib or kv_cache_bytes, not both")
        data["kv_cache_bytes"] = int(float(data.pop("kv_cache_gib")) * _GIB)
    return _build(EngineConfig, data, device, aliases=("kv_cache_gib",))


def embedding_config(options: Mapping[str, Any], device: str | None = None) -> EmbeddingConfig:
    """An EmbeddingConfig from registry-style options: `max_num_seqs` is the batch cap (`max_batch_size`),
    paged-KV options are dropped, other unknown keys are refused by name."""
    data = {key: value for key, value in options.items() if key not in _KV_ONLY_OPTIONS}
    scheduling = data.pop("scheduling", "fcfs")
    if scheduling != "fcfs":  # no priority lanes: a batch takes the oldest inputs
        raise ValueError(f"an embedding engine batches first come, first served: scheduling must be 'fcfs', "
                         f"got {scheduling!r}")
    if "max_num_seqs" in data:
        if "max_batch_size" in data:
            raise ValueError("give max_num_seqs or max_batch_size, not both")
        data["max_batch_size"] = data.pop("max_num_seqs")
    return _build(EmbeddingConfig, data, device, aliases=("max_num_seqs", "scheduling", *sorted(_KV_ONLY_OPTIONS)))


def _build(config_type: Any, data: dict[str, Any], device: str | None, aliases: Sequence[str]) -> Any:
    """`config_type(**data)` once `device` agrees and every key is a field; errors become ValueError."""
    if device is not None and data.setdefault("device", device) != device:
        raise ValueError(f"--device {device!r} disagrees with engine option device={data['device']!r}")
    known = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known | set(aliases))}")
    try:
        return config_type(**data)
    except TypeError as err:  # e.g. "16" for block_size: comparisons in the config's checks fail
        raise ValueError(f"engine options of the wrong type: {err}") from err


def parse_engine_json(text: str | None, device: str | None = None, model_type: str = "chat"
                      ) -> EngineConfig | EmbeddingConfig:
    """`--engine-json` (a JSON object, or empty) as the config of a `model_type` engine."""
    options = json.loads(text) if text else {}
    if not isinstance(options, dict):
        raise ValueError(f"--engine-json must be a JSON object, got {type(options).__name__}")
    if model_type == "embedding":
        return embedding_config(options, device)
    return engine_config(options, device)


def configure_logging(level: int = logging.INFO) -> None:
    """JSON lines on stderr (a worker's stdout/stderr go to the pool's log file)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


class _EngineLoop(Protocol):
    def run_forever(self) -> None: ...

    def shutdown(self, timeout_s: float = 5.0) -> None: ...


def _load_llm(source: str, name: str, aliases: Sequence[str], config: EngineConfig,
              step_gate: StepGate | None = None) -> tuple[_EngineLoop, Starlette]:
    from runtimes.llm.async_engine import AsyncLLMEngine
    from runtimes.llm.engine import LLMEngine
    from runtimes.server.app import build_app

    engine = AsyncLLMEngine(LLMEngine.from_source(source, config), start_thread=False, step_gate=step_gate)
    kv = engine.engine.kv
    structlog.get_logger(__name__).info("model loaded", model=engine.engine.model_name,
                                        max_model_len=engine.engine.max_model_len, kv_blocks=kv.num_blocks,
                                        block_size=kv.block_size)
    return engine, build_app(engine, name, aliases)


def _load_embedding(source: str, name: str, aliases: Sequence[str], config: EmbeddingConfig,
                    step_gate: StepGate | None = None) -> tuple[_EngineLoop, Starlette]:
    from runtimes.embedding.async_engine import AsyncEmbeddingEngine
    from runtimes.embedding.engine import EmbeddingEngine
    from runtimes.server.embedding_app import build_embedding_app

    engine = AsyncEmbeddingEngine(EmbeddingEngine.from_source(source, config), start_thread=False,
                                  step_gate=step_gate)
    core = engine.engine
    structlog.get_logger(__name__).info("model loaded", model=core.model_name, max_model_len=core.max_model_len,
                                        dimensions=core.hidden_size, max_batch_size=config.max_batch_size)
    return engine, build_embedding_app(engine, name, aliases)


def _load(model_type: str, source: str, name: str, aliases: Sequence[str],
          config: EngineConfig | EmbeddingConfig | None, step_gate: StepGate | None = None,
          memory_fraction: float | None = None) -> tuple[_EngineLoop, Starlette]:
    """The engine (not yet running) and its app, for a model of `model_type`."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model type {model_type!r}; known: {', '.join(MODEL_TYPES)}")
    expected = EmbeddingConfig if model_type == "embedding" else EngineConfig
    config = config if config is not None else expected()
    if not isinstance(config, expected):
        raise TypeError(f"a {model_type} worker takes a {expected.__name__}, got a {type(config).__name__}")
    if memory_fraction is not None:
        limit_cuda_memory(memory_fraction, config.resolve_device())
    if isinstance(config, EmbeddingConfig):
        return _load_embedding(source, name, aliases, config, step_gate)
    return _load_llm(source, name, aliases, config, step_gate)


def limit_cuda_memory(fraction: float, device: Any) -> bool:
    """Cap this process's CUDA allocations at `fraction` of the device (the partitioner's plan); the KV cache
    sizes itself inside that cap. No-op off CUDA (a CPU replica has no device memory to share). True if set."""
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    if device.type != "cuda":
        return False
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return True


def run_worker(
    source: str,
    name: str,
    aliases: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 8000,
    config: EngineConfig | EmbeddingConfig | None = None,
    log_level: str = "warning",
    graceful_timeout_s: int = 30,
    model_type: str = "chat",
    step_gate: StepGate | None = None,
    memory_fraction: float | None = None,
    replica_token: str | None = None,
    stall_timeout_s: float = 60.0,
) -> None:
    """Load `source` as a `model_type` model, serve it as `name` (and `aliases`) on host:port until SIGTERM/SIGINT.

    `step_gate`: taken around every engine step (the device's time-slice arbiter, when it is shared);
    `memory_fraction`: of the CUDA device, for this process (the partitioner's plan); `replica_token`: the
    secret every request but /health and /ready must carry (runtimes/server/replica_auth.py); `stall_timeout_s`:
    an engine loop without progress this long makes the replica unready (runtimes/server/replica.py).
    """
    import uvicorn

    configure_logging()
    # The engine loop (main thread) and the HTTP thread share the GIL. By default a thread waiting for it gets
    # it only after 5 ms, so under load every hop of a request through the HTTP thread (parse, submit, deliver
    # the first token) could wait that long; 0.5 ms keeps interactive TTFT near its idle value.
    sys.setswitchinterval(HTTP_SWITCH_INTERVAL_S)
    log = structlog.get_logger(__name__)
    log.info("loading model", source=source, name=name, aliases=list(aliases), model_type=model_type)
    # The engine loop runs on this (main) thread, where PyTorch's CPU thread pool stays warm; HTTP is served
    # from another thread (see runtimes/llm/async_engine.py for the measurement).
    engine, app = _load(model_type, source, name, aliases, config, step_gate, memory_fraction)
    app.state.replica.stall_timeout_s = stall_timeout_s
    served: Any = app if replica_token is None else ReplicaTokenMiddleware(app, replica_token)
    # The gateway is a replica's one client, but anything on the host can connect: the same read deadlines apply.
    server = uvicorn.Server(guarded_config(served, host=host, port=port, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=graceful_timeout_s))

    def serve_http() -> None:
        try:
            server.run()  # off the main thread uvicorn installs no signal handlers: ours below stop it
        finally:
            engine.shutdown()  # in-flight requests have finished: now stop the engine loop

    def request_exit(signum: int, frame: FrameType | None) -> None:
        server.should_exit = True  # graceful: stop accepting, let in-flight requests finish

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, request_exit)
    http_thread = threading.Thread(target=serve_http, name="http", daemon=True)
    http_thread.start()
    try:
        engine.run_forever()
    finally:
        server.should_exit = True
        http_thread.join(graceful_timeout_s + 5)
        log.info("worker stopped", name=name)
