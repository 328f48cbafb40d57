"""Fixtures for the per-replica server tests: one tiny engine per module, an app factory, a ready client."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.server.app import build_app
from tests.runtimes.llm.tiny import loaded_tiny

SERVED_NAME = "tiny"
ALIAS = "tiny-alias"


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLMEngine]:
    """A tiny random model (vocab 259, context 512) with 512 KV blocks of 4 tokens, shared by a module."""
    engine = AsyncLLMEngine(LLMEngine(loaded_tiny(), EngineConfig(kv_cache_bytes=1 << 20, block_size=4)))
    yield engine
    engine.shutdown()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


def all_blocks_free(engine: AsyncLLMEngine) -> bool:
    core = engine.engine
    return not core.has_unfinished_requests() and core.kv.num_free_blocks == core.kv.num_blocks


@pytest.fixture
def make_app(engine: AsyncLLMEngine) -> Callable[..., Starlette]:
    """Factory: an app over the module's engine (keyword arguments go to build_app)."""

    def make(**kwargs: object) -> Starlette:
        return build_app(engine, SERVED_NAME, [ALIAS], **kwargs)  # type: ignore[arg-type]

    return make


@pytest.fixture
def client(engine: AsyncLLMEngine, make_app: Callable[..., Starlette]) -> Iterator[TestClient]:
    """A TestClient (lifespan run) whose replica passed its startup probe; checks no KV block leaked."""
    with TestClient(make_app()) as client:
        wait_until(lambda: client.get("/ready").status_code == 200, what="/ready")
        yield client
    wait_until(lambda: all_blocks_free(engine), what="every KV block free")
