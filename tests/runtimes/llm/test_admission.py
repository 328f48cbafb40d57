"""Overload control inside the engine: a queue-length limit refuses at submission, a queue-wait limit
refuses requests that never started; accepted work is never dropped and no block leaks."""

from __future__ import annotations

import pytest

from foundation.request_errors import OverloadedError
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import run_to_completion

LONG = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_engine(tiny_loaded):
    loaded = tiny_loaded(seed=0)

    def make(clock: Clock | None = None, **overrides: object) -> LLMEngine:
        config = EngineConfig(**{"kv_cache_bytes": 1 << 20, "block_size": 4, "max_num_seqs": 2,
                                 "max_num_batched_tokens": 64, **overrides})
        return LLMEngine(loaded, config, clock=clock or Clock())

    return make


def test_queue_length_limit_refuses_at_submission(make_engine):
    engine = make_engine(max_queue_len=3)
    for i in range(3):
        engine.add_request(f"r{i}", [5, 6, 7 + i], LONG)
    with pytest.raises(OverloadedError, match="max_queue_len=3") as refused:
        engine.add_request("r3", [5, 6, 9], LONG)
    assert refused.value.retry_after_s >= 1
    engine.step()  # two start running: the queue has room again
    engine.add_request("r3", [5, 6, 9], LONG)
    outputs = run_to_completion(engine, {})
    assert sorted(outputs) == ["r0", "r1", "r2", "r3"]
    assert all(out.finish_reason == "length" for out in outputs.values())  # every accepted one ran in full
    assert len(outputs["r3"].token_ids) == 30
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_with_multilevel_a_background_flood_does_not_fill_the_interactive_queue(make_engine):
    engine = make_engine(max_queue_len=2, scheduling="multilevel")
    for i in range(2):
        engine.add_request(f"bg{i}", [5, 6, 7 + i], LONG, priority=2)
    with pytest.raises(OverloadedError):
        engine.add_request("bg2", [5, 6, 9], LONG, priority=2)
    engine.add_request("chat0", [5, 6, 10], LONG, priority=0)  # 0 interactive requests ahead of it
    engine.add_request("chat1", [5, 6, 11], LONG, priority=0)
    with pytest.raises(OverloadedError, match="2 requests are waiting ahead"):
        engine.add_request("chat2", [5, 6, 12], LONG, priority=0)
    with pytest.raises(OverloadedError, match="2 requests are waiting ahead"):
        engine.add_request("n", [5, 6, 12], LONG, priority=1)  # normal queues behind the 2 interactive ones


def test_retry_after_follows_the_recent_finish_rate(make_engine):
    clock = Clock()
    engine = make_engine(clock, max_queue_len=4)
    assert engine.retry_after_s() == 1.0  # nothing finished yet: no rate known, the floor
    for i in range(4):
        engine.add_request(f"r{i}", [5, 6, 7 + i], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        clock.now += 0.5
        engine.step()
    for i in range(4):
        engine.add_request(f"s{i}", [5, 6, 7 + i], LONG)
    # 4 finished within ~2 s at a 10 s horizon: ~0.4/s, so 4 waiting requests need ~10 s
    assert 5 < engine.retry_after_s() < 15


def test_queue_wait_limit_rejects_requests_that_never_started(make_engine):
    clock = Clock()
    engine = make_engine(clock, max_queue_wait_s=2.0)
    engine.add_request("a", [5, 6, 7], LONG)
    engine.add_request("b", [5, 6, 8], LONG)
    engine.add_request("late", [5, 6, 9], SamplingParams(temperature=0.0, max_tokens=3, n=2))
    engine.step()  # a and b run (max_num_seqs=2); late waits
    clock.now += 2.5
    outputs = engine.step()
    rejected = [o for o in outputs if o.finish_reason == "rejected"]
    assert [(o.request_id, o.index) for o in rejected] == [("late", 0), ("late", 1)]
    assert all(o.finished and not o.new_token_ids for o in rejected)
    assert engine.is_finished("late")
    rest = run_to_completion(engine, {})  # a and b waited too, but they had started: they finish in full
    assert {k: v.finish_reason for k, v in rest.items()} == {"a": "length", "b": "length"}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_preempted_request_is_not_rejected_for_waiting(make_engine):
    clock = Clock()
    # 12 blocks of 4 tokens: two 3+30-token requests (9 blocks each) cannot both finish: one is preempted
    engine = make_engine(clock, kv_cache_bytes=12 * 4 * 2 * 2 * 2 * 16 * 4, max_queue_wait_s=1.0)
    engine.add_request("a", [5, 6, 7], LONG)
    engine.add_request("b", [5, 6, 8], LONG)
    outputs: dict[str, int] = {}
    while engine.has_unfinished_requests():
        clock.now += 0.3  # each step "takes" 0.3 s: a preempted request waits far past the limit
        for out in engine.step():
            outputs[out.request_id] = outputs.get(out.request_id, 0) + len(out.new_token_ids)
            assert out.finish_reason != "rejected"
    assert engine.scheduler.num_preemptions >= 1
    assert outputs == {"a": 30, "b": 30}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("bad, match", [({"max_queue_len": 0}, "max_queue_len"),
                                        ({"max_queue_wait_s": 0.0}, "max_queue_wait_s"),
                                        ({"multilevel": {"aging_s": 1.0}}, "only used with scheduling"),
                                        ({"scheduling": "multilevel", "multilevel": {"agin_s": 1.0}}, "agin_s")])
def test_limits_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)
