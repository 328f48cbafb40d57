"""The async face: concurrent callers share batches, a cancelled call aborts, errors reach only their caller."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from runtimes.embedding.async_engine import AsyncEmbeddingEngine
from runtimes.request_errors import InvalidRequestError
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
