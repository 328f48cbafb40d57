"""The async face: concurrent callers share batches, a cancelled call aborts, errors reach only their caller."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from foundation.request_errors import InvalidRequestError
from runtimes.embedding.async_engine import AsyncEmbeddingEngine
from tests.runtimes.embedding.conftest import SENTENCES


@pytest.fixture
def make_async(make_engine) -> Iterator:
    engines: list[AsyncEmbeddingEngine] = []

    def make(**config: object) -> AsyncEmbeddingEngine:
        engines.append(AsyncEmbeddingEngine(make_engine(**config)))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


def test_concurrent_requests_share_one_batch(make_async):
    engine = make_async(batch_window_s=0.5)  # wide window: all eight arrive inside it
    ids = engine.engine.inputs.prepare(["same length text"] * 8).token_ids

    async def main() -> list:
        return await asyncio.gather(*(engine.embed(f"r{i}", [ids[i]]) for i in range(8)))

    outputs = asyncio.run(main())
    assert [out.request_id for out in outputs] == [f"r{i}" for i in range(8)]
    assert engine.engine.stats.num_batches == 1 and engine.engine.stats.num_inputs == 8
    np.testing.assert_allclose(outputs[3].embeddings, outputs[5].embeddings, atol=1e-6)


def test_cancelled_call_aborts_and_errors_reach_their_caller(make_async):
    engine = make_async(batch_window_s=0.3)
    ids = engine.engine.inputs.prepare(SENTENCES[:2]).token_ids

    async def main() -> None:
        doomed = asyncio.create_task(engine.embed("doomed", ids))
        await asyncio.sleep(0.05)
        doomed.cancel()
        with pytest.raises(InvalidRequestError, match="input must not be empty"):
            await engine.embed("bad", [])
        out = await engine.embed("ok", ids[:1])
        assert out.embeddings.shape == (1, 384)
        with pytest.raises(asyncio.CancelledError):
            await doomed

    asyncio.run(main())
    assert engine.engine.stats.num_inputs == 1  # the cancelled request's inputs were never encoded
    assert not engine.engine.has_unfinished_requests()


def test_a_small_request_sent_during_a_large_ones_pass_finishes_first(make_async):
    """The engine thread takes new requests between forward passes: a one-word request that arrives while a large
    request's first pass runs is answered before the large one."""
    engine = make_async(max_batch_size=2, batch_window_s=0.0)
    core = engine.engine
    large = core.inputs.prepare(SENTENCES[:4] * 2).token_ids
    small = core.inputs.prepare(["hi"]).token_ids
    started, release = threading.Event(), threading.Event()
    encode = core._encode

    def first_pass_waits(bucket):
        started.set()
        assert release.wait(timeout=30), "the test never released the first pass"
        return encode(bucket)

    core._encode = first_pass_waits

    async def main() -> list[str]:
        finished: list[str] = []

        async def run(name: str, ids) -> None:
            await engine.embed(name, ids)
            finished.append(name)

        large_task = asyncio.create_task(run("large", large))
        await asyncio.to_thread(started.wait, 30)  # the large request's first pass is running
        small_task = asyncio.create_task(run("small", small))
        await asyncio.sleep(0)  # its command is queued
        core._encode = encode
        release.set()
        await asyncio.gather(large_task, small_task)
        return finished

    assert asyncio.run(main()) == ["small", "large"]
