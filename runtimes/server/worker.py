"""`multiserve worker`: load one model, wrap it in the per-replica app, serve it with uvicorn.

The pool launches one such process per replica (model_pool/launcher.py) with `--engine-json` holding the
registry's `engine:` section: EngineConfig fields, plus `kv_cache_gib` as the registry spells the KV budget.
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
from typing import Any

import structlog

from runtimes.llm.config import EngineConfig

_GIB = 1 << 30


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
    if device is not None and data.setdefault("device", device) != device:
        raise ValueError(f"--device {device!r} disagrees with engine option device={data['device']!r}")
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known | {'kv_cache_gib'})}")
    try:
        return EngineConfig(**data)
    except TypeError as err:  # e.g. "16" for block_size: comparisons in EngineConfig's checks fail
        raise ValueError(f"engine options of the wrong type: {err}") from err


def parse_engine_json(text: str | None, device: str | None = None) -> EngineConfig:
    """`--engine-json` (a JSON object, or empty) as an EngineConfig."""
    options = json.loads(text) if text else {}
    if not isinstance(options, dict):
        raise ValueError(f"--engine-json must be a JSON object, got {type(options).__name__}")
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


def run_worker(
    source: str,
    name: str,
    aliases: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 8000,
    config: EngineConfig | None = None,
    log_level: str = "warning",
    graceful_timeout_s: int = 30,
) -> None:
    """Load `source`, serve it as `name` (and `aliases`) on host:port until SIGTERM/SIGINT."""
    import uvicorn

    from runtimes.llm.async_engine import AsyncLLMEngine
    from runtimes.llm.engine import LLMEngine
    from runtimes.server.app import build_app

    configure_logging()
    log = structlog.get_logger(__name__)
    log.info("loading model", source=source, name=name, aliases=list(aliases))
    # The engine loop runs on this (main) thread, where PyTorch's CPU thread pool stays warm; HTTP is served
    # from another thread (see runtimes/llm/async_engine.py for the measurement).
    engine = AsyncLLMEngine(LLMEngine.from_source(source, config or EngineConfig()), start_thread=False)
    kv = engine.engine.kv
    log.info("model loaded", model=engine.engine.model_name, max_model_len=engine.engine.max_model_len,
             kv_blocks=kv.num_blocks, block_size=kv.block_size)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, name, aliases), host=host, port=port,
                                           log_level=log_level, access_log=False,
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
