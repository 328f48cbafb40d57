"""`multiserve worker`: load one model, wrap it in the per-replica app, serve it with uvicorn.

The pool launches one such process per replica (model_pool/launcher.py) with its `registry.launch.ReplicaLaunch`:
the model's registry entry as validated there (source, type, `engine:` section, the engine's side of its policy)
and its placement. `engine_config` and `embedding_config` turn it into the runtime config of the engine its type
runs; nothing is validated a second time here.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any, Protocol

import structlog
from starlette.applications import Starlette

from foundation.http.guard import guarded_config
from foundation.http.replica_auth import ReplicaTokenMiddleware
from foundation.logs import configure_logging
from registry.engine import EmbeddingEngineSpec, EngineSpec
from registry.launch import ReplicaLaunch
from runtimes.cuda_memory import limit_process_memory
from runtimes.embedding.config import EmbeddingConfig
from runtimes.engine_driver import StepGate, return_freed_heap
from runtimes.llm.config import EngineConfig

HTTP_SWITCH_INTERVAL_S = 0.0005


def engine_config(launch: ReplicaLaunch) -> EngineConfig:
    """The LLM engine's config of a chat or completion model's launch: its engine and queue options as they are, its
    device, and the KV budget the launch decided."""
    if not isinstance(launch.engine, EngineSpec):
        raise TypeError(f"a {launch.type} model's launch carries embedding engine options")
    return EngineConfig.of(launch.engine, launch.queue, kv_cache_bytes=launch.kv_cache_bytes, device=launch.device)


def embedding_config(launch: ReplicaLaunch) -> EmbeddingConfig:
    """The encoder engine's config of an embedding model's launch; options it leaves unset keep the engine's
    defaults. The registry's `max_num_seqs` is the batch cap."""
    engine = launch.engine
    if not isinstance(engine, EmbeddingEngineSpec):
        raise TypeError("an embedding model's launch carries LLM engine options")
    options: dict[str, Any] = {"max_batch_size": engine.max_num_seqs, "max_model_len": engine.max_model_len,
                               "batch_window_s": engine.batch_window_s, "max_batch_tokens": engine.max_batch_tokens,
                               "max_request_tokens": engine.max_request_tokens}
    return EmbeddingConfig(device=launch.device, **{k: v for k, v in options.items() if v is not None})


class _EngineLoop(Protocol):
    def run_forever(self) -> None: ...

    def shutdown(self, timeout_s: float = 5.0) -> None: ...


def _load_llm(launch: ReplicaLaunch, config: EngineConfig, step_gate: StepGate | None) -> tuple[_EngineLoop, Starlette]:
    from runtimes.llm.async_engine import AsyncLLMEngine
    from runtimes.llm.engine import LLMEngine
    from runtimes.server.app import build_app

    engine = AsyncLLMEngine(LLMEngine.from_source(launch.source, config, draft_source=launch.draft_source,
                                                  draft_weights=launch.draft_weights),
                            start_thread=False,
                            step_gate=step_gate)
    kv = engine.engine.kv
    structlog.get_logger(__name__).info("model loaded", model=engine.engine.model_name,
                                        max_model_len=engine.engine.max_model_len, kv_blocks=kv.num_blocks,
                                        block_size=kv.block_size)
    return engine, build_app(engine, launch.model, launch.aliases, tool_parser=launch.chat.tool_parser,
                             reasoning_parser=launch.chat.reasoning_parser)


def _load_embedding(launch: ReplicaLaunch, config: EmbeddingConfig,
                    step_gate: StepGate | None) -> tuple[_EngineLoop, Starlette]:
    from runtimes.embedding.async_engine import AsyncEmbeddingEngine
    from runtimes.embedding.engine import EmbeddingEngine
    from runtimes.server.embedding_app import build_embedding_app

    engine = AsyncEmbeddingEngine(EmbeddingEngine.from_source(launch.source, config), start_thread=False,
                                  step_gate=step_gate)
    core = engine.engine
    structlog.get_logger(__name__).info("model loaded", model=core.model_name, max_model_len=core.max_model_len,
                                        dimensions=core.hidden_size, max_batch_size=config.max_batch_size)
    return engine, build_embedding_app(engine, launch.model, launch.aliases)


def preload() -> None:
    """Import what loading and serving any model takes (torch, both engines, their apps, uvicorn): the larger part
    of a worker's start (docs/on-demand.md), done by a standby worker before it has a model."""
    import uvicorn  # noqa: F401

    from runtimes.embedding.async_engine import AsyncEmbeddingEngine  # noqa: F401
    from runtimes.embedding.engine import EmbeddingEngine  # noqa: F401
    from runtimes.llm.async_engine import AsyncLLMEngine  # noqa: F401
    from runtimes.llm.engine import LLMEngine  # noqa: F401
    from runtimes.server.app import build_app  # noqa: F401
    from runtimes.server.embedding_app import build_embedding_app  # noqa: F401


def _load(launch: ReplicaLaunch, step_gate: StepGate | None = None) -> tuple[_EngineLoop, Starlette]:
    """The engine (not yet running) and its app, for the launch's model type, inside its memory share."""
    config = embedding_config(launch) if launch.type == "embedding" else engine_config(launch)
    fraction = launch.placement.memory_fraction
    if fraction is not None:
        limit_process_memory(fraction, config.resolve_device())
    loaded = (_load_embedding(launch, config, step_gate) if isinstance(config, EmbeddingConfig)
              else _load_llm(launch, config, step_gate))
    return_freed_heap()  # the checkpoint's metadata, repacking temporaries (~4 MiB for SmolLM2)
    return loaded


def run_worker(
    launch: ReplicaLaunch,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    graceful_timeout_s: int = 30,
    step_gate: StepGate | None = None,
    replica_token: str | None = None,
    stall_timeout_s: float = 60.0,
) -> None:
    """Load the launch's model, serve it as its name (and aliases) on host:port until SIGTERM/SIGINT.

    `step_gate`: taken around every engine step (the device's time-slice arbiter, when it is shared);
    `replica_token`: the secret every request but /health and /ready must carry (foundation/http/replica_auth.py);
    `stall_timeout_s`: an engine loop without progress this long makes the replica unready
    (runtimes/server/replica.py).
    """
    import uvicorn

    configure_logging()
    # The engine loop (main thread) and the HTTP thread share the GIL. By default a thread waiting for it gets
    # it only after 5 ms, so under load every hop of a request through the HTTP thread (parse, submit, deliver
    # the first token) could wait that long; 0.5 ms keeps interactive TTFT near its idle value.
    sys.setswitchinterval(HTTP_SWITCH_INTERVAL_S)
    log = structlog.get_logger(__name__)
    log.info("loading model", source=launch.source, name=launch.model, aliases=list(launch.aliases),
             model_type=launch.type, replica=launch.replica_id)
    # The engine loop runs on this (main) thread, where PyTorch's CPU thread pool stays warm; HTTP is served
    # from another thread (see runtimes/llm/async_engine.py for the measurement).
    engine, app = _load(launch, step_gate)
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
        log.info("worker stopped", name=launch.model)
