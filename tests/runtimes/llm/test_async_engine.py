"""The async face: streaming outputs from the engine thread, aborts on close, errors to the caller."""

from __future__ import annotations

import asyncio

import pytest

from foundation.request_errors import InvalidRequestError
from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import run_to_completion


@pytest.fixture
def async_engine(tiny_loaded):
    engine = AsyncLLMEngine(LLMEngine(tiny_loaded(), EngineConfig(kv_cache_bytes=1 << 20, block_size=4)))
    yield engine
    engine.shutdown()
    assert engine._thread is not None and not engine._thread.is_alive()


async def _collect(engine: AsyncLLMEngine, request_id: str, prompt, params: SamplingParams):
    return [out async for out in engine.generate(request_id, prompt, params)]


def test_concurrent_streams_match_sync_results(async_engine, tiny_loaded):
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    prompts = {f"r{i}": [5 + i, 40, 77, 3 + i] for i in range(5)}

    async def main():
        return await asyncio.gather(*(_collect(async_engine, k, p, params) for k, p in prompts.items()))

    streams = asyncio.run(main())
    sync = LLMEngine(tiny_loaded(), EngineConfig(kv_cache_bytes=1 << 20, block_size=4))
    expected = run_to_completion(sync, {k: (p, params) for k, p in prompts.items()})
    for request_id, outs in zip(prompts, streams, strict=True):
        assert [o.request_id for o in outs] == [request_id] * 9
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert outs[0].first_token_time is not None and outs[-1].time >= outs[0].first_token_time
        assert [t for o in outs for t in o.new_token_ids] == expected[request_id].token_ids
    assert async_engine.engine.kv.num_free_blocks == async_engine.engine.kv.num_blocks


def test_closing_the_stream_aborts_and_frees_blocks(async_engine):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        stream = async_engine.generate("gone", [1, 2, 3, 4, 5], params)
        async for out in stream:
            if out.num_output_tokens >= 3:
                break
        await stream.aclose()  # what a server does when its client disconnects
        for _ in range(200):
            if async_engine.engine.is_finished("gone"):
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    kv = async_engine.engine.kv
    assert async_engine.engine.is_finished("gone")
    assert kv.num_free_blocks == kv.num_blocks


def test_invalid_request_raises_for_its_caller_only(async_engine):
    ok = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main():
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await _collect(async_engine, "bad", [1, 100000], ok)
        return await _collect(async_engine, "good", [1, 2, 3], ok)

    outs = asyncio.run(main())
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 4


def test_n_samples_stream_until_all_finish(async_engine):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    outs = asyncio.run(_collect(async_engine, "pair", [9, 8, 7, 6, 5], params))
    assert sorted({o.index for o in outs}) == [0, 1]
    assert sum(o.finished for o in outs) == 2


def test_run_forever_drives_the_engine_on_the_calling_thread(tiny_loaded):
    """A worker runs the engine loop on its main thread and serves HTTP from another."""
    import threading

    engine = AsyncLLMEngine(LLMEngine(tiny_loaded(), EngineConfig(kv_cache_bytes=1 << 20, block_size=4)),
                            start_thread=False)
    results = []

    def client() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        results.extend(asyncio.run(_collect(engine, "main-thread", [4, 5, 6], params)))
        engine.shutdown()

    thread = threading.Thread(target=client)
    thread.start()
    engine.run_forever()  # returns once the client thread calls shutdown()
    thread.join(10)
    assert results[-1].finished and sum(len(o.new_token_ids) for o in results) == 3


def test_an_interactive_arrival_stops_a_background_prefill_step_in_flight(tiny_loaded):
    """Through the command queue: the arrival is announced as it is queued, the step running a background prompt
    chunk stops, the arrival's step runs next, and both outputs are the undisturbed ones."""
    import threading

    from policies.multilevel import BACKGROUND, INTERACTIVE

    def engine() -> LLMEngine:
        return LLMEngine(tiny_loaded(), EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_batched_tokens=16,
                                                     scheduling="multilevel"))

    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    background, chat = list(range(5, 53)), [60, 61, 62]
    async_engine = AsyncLLMEngine(engine())
    execute = async_engine.engine.runner.execute
    in_second_step, calls = threading.Event(), []

    def announced_mid_step(plan, block_tables, interrupt=None):  # type: ignore[no-untyped-def]
        calls.append([item.request.request_id for item in plan.scheduled])
        if len(calls) == 2:  # bg's second chunk: hold it until the arrival has been announced
            in_second_step.set()
            assert async_engine.engine.loop.stopped.wanted.wait(10)
        return execute(plan, block_tables, interrupt)

    async_engine.engine.runner.execute = announced_mid_step  # type: ignore[method-assign]

    async def main():
        bg = asyncio.create_task(_collect_at(async_engine, "bg", background, greedy, BACKGROUND))
        await asyncio.to_thread(in_second_step.wait, 10)
        first = await _collect_at(async_engine, "chat", chat, greedy, INTERACTIVE)
        return first, await bg

    try:
        chat_outs, bg_outs = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert async_engine.engine.num_interrupted_steps == 1
    assert calls[1] == ["bg"] and calls[2] == ["chat"]  # stopped, then the arrival's step of its own
    expected = {name: run_to_completion(engine(), {name: (prompt, greedy)})[name].token_ids
                for name, prompt in (("bg", background), ("chat", chat))}
    assert [t for o in chat_outs for t in o.new_token_ids] == expected["chat"]
    assert [t for o in bg_outs for t in o.new_token_ids] == expected["bg"]
    assert async_engine.engine.kv.num_free_blocks == async_engine.engine.kv.num_blocks


async def _collect_at(engine: AsyncLLMEngine, request_id: str, prompt, params: SamplingParams, priority: int):
    return [out async for out in engine.generate(request_id, prompt, params, priority=priority)]


class _EndSampleOneEarly:
    """Sample 1 (seed 11) is made to stop (token STOP) at its second token, sample 0 never takes STOP: sample 1 starts a
    step after sample 0 (it waits for the prompt), so with max_tokens=3 both finish in the same step."""

    STOP = 7

    def wants(self, row) -> bool:  # type: ignore[no-untyped-def]
        return row.seed in (10, 11)

    def apply(self, logits, rows, batch) -> None:  # type: ignore[no-untyped-def]
        for i in rows:
            if batch[i].seed == 11 and len(batch[i].output_token_ids) >= 1:
                logits[i] = float("-inf")
                logits[i, self.STOP] = 0.0
            else:
                logits[i, self.STOP] = float("-inf")


def test_samples_that_finish_in_the_same_step_all_reach_their_caller(tiny_loaded):
    """Outputs of a step are delivered after the engine has forgotten a request whose last samples finished in it:
    every one must still reach the caller, or its stream waits for ever."""
    engine = LLMEngine(tiny_loaded(seed=1), EngineConfig(kv_cache_bytes=1 << 22, block_size=4),
                       logits_processors=[_EndSampleOneEarly()])
    async_engine = AsyncLLMEngine(engine)
    params = SamplingParams(n=2, temperature=0.0, seed=10, max_tokens=3, stop_token_ids=[_EndSampleOneEarly.STOP])

    async def main() -> list:
        return [out async for out in async_engine.generate("r", [5, 6, 7, 8, 9], params)]

    try:
        outputs = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        async_engine.shutdown()
    finished = {out.index: out for out in outputs if out.finished}
    assert {i: out.finish_reason for i, out in finished.items()} == {0: "length", 1: "stop"}
    assert finished[0].time == finished[1].time  # the case this is about: both in one step (one `now` per step)
