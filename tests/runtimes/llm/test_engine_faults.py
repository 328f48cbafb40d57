"""A fault that one request causes fails that request only: the rest of its step runs, token for token as if it
had never been there, its blocks are freed, and the engine checks itself before carrying on."""

from __future__ import annotations

import pytest

from foundation.request_errors import InvalidRequestError
from runtimes.fault_isolation import EngineFaultError
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import run_to_completion
from tests.runtimes.llm.test_engine import GREEDY, KV_PER_TOKEN, SEEDED, _mixed_requests, _prompt


@pytest.fixture
def engine(tiny_loaded) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=2048 * KV_PER_TOKEN, block_size=4, max_num_batched_tokens=64,
                          max_num_seqs=32)
    return LLMEngine(tiny_loaded(seed=0), config)


def _poison(engine: LLMEngine, should_fail) -> list[set[str]]:
    """Make the model runner raise for any batch `should_fail(request ids)` picks; returns the batches it saw."""
    execute = engine.runner.execute
    batches: list[set[str]] = []

    def faulty(plan, block_tables, interrupt=None):
        ids = {item.request.request_id for item in plan.scheduled}
        batches.append(ids)
        if should_fail(ids):
            raise RuntimeError(f"injected fault for {sorted(ids)}")
        return execute(plan, block_tables, interrupt)

    engine.runner.execute = faulty  # type: ignore[method-assign]
    return batches


def _assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.kv.block_tables


def _workload() -> dict[str, tuple[list[int], SamplingParams]]:
    return {**_mixed_requests(12), "g": (_prompt(99, 17), GREEDY), "s": (_prompt(99, 17), SEEDED)}


def test_a_request_that_faults_fails_alone_and_the_others_are_untouched(tiny_loaded, engine):
    undisturbed = run_to_completion(LLMEngine(tiny_loaded(seed=0), engine.config), _workload())
    batches = _poison(engine, lambda ids: "bad" in ids)
    bad = {"bad": (_prompt(5, 30), SamplingParams(temperature=0.0, max_tokens=8))}
    results = run_to_completion(engine, {**_workload(), **bad})
    assert results["bad"].finish_reason == "error"
    for request_id, expected in undisturbed.items():  # greedy and seeded alike: the same tokens, every one
        assert results[request_id].token_ids == expected.token_ids, request_id
        assert results[request_id].finish_reason == expected.finish_reason
    assert engine.num_request_faults == 1
    assert results["self-check-1"].finish_reason == "length"  # the engine checked itself and carried on
    assert any("bad" in ids and len(ids) > 1 for ids in batches)  # it was isolated from a shared batch
    _assert_no_leak(engine)


def test_the_error_output_carries_an_id_and_ends_every_sample(engine):
    _poison(engine, lambda ids: any(i.startswith("bad") for i in ids))
    engine.add_request("ok", _prompt(1, 9), GREEDY)
    engine.add_request("bad", _prompt(2, 9), SamplingParams(n=3, temperature=0.7, max_tokens=5))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    errors = [out for out in outputs if out.request_id == "bad"]
    assert errors and all(out.finished and out.finish_reason == "error" for out in errors)
    assert len({out.error_id for out in errors}) == 1 and errors[0].error_id.startswith("err-")
    assert sum(len(out.new_token_ids) for out in outputs if out.request_id == "ok") == GREEDY.max_tokens
    _assert_no_leak(engine)


def test_two_offenders_in_one_batch_are_both_found(engine):
    _poison(engine, lambda ids: bool(ids & {"bad1", "bad2"}))
    bad = {f"bad{i}": (_prompt(i, 11), GREEDY) for i in (1, 2)}
    results = run_to_completion(engine, {**_mixed_requests(10), **bad})
    assert [results[r].finish_reason for r in bad] == ["error", "error"]
    assert all(results[f"r{i}"].finish_reason == "length" for i in range(10))
    _assert_no_leak(engine)


def test_a_fault_of_the_whole_batch_fails_nobody(tiny_loaded, engine):
    undisturbed = run_to_completion(LLMEngine(tiny_loaded(seed=0), engine.config), _workload())
    _poison(engine, lambda ids: len(ids) > 4)  # e.g. a batch too big for the device
    results = run_to_completion(engine, _workload())
    assert {r: c.token_ids for r, c in results.items()} == {r: c.token_ids for r, c in undisturbed.items()}
    assert engine.num_request_faults == 0
    _assert_no_leak(engine)


def test_a_fault_while_detokenizing_fails_that_request_only(engine):
    engine.add_request("ok", _prompt(1, 9), GREEDY)
    engine.add_request("bad", _prompt(2, 9), GREEDY)
    engine.step()  # both are admitted; now make one request's detokenizer break

    def broken(token: int) -> str:
        raise UnicodeError("injected")

    seq = engine.sequences.get("bad")
    assert seq is not None
    seq.detokenizer.add = broken  # type: ignore[method-assign]
    results = run_to_completion(engine, {})
    assert results["bad"].finish_reason == "error" and results["ok"].finish_reason == "length"
    _assert_no_leak(engine)


def test_an_engine_that_fails_everything_fails_its_self_check(engine):
    _poison(engine, lambda ids: True)  # e.g. a device that has gone bad
    engine.add_request("r", _prompt(1, 9), GREEDY)
    outputs = engine.step()
    assert [out.finish_reason for out in outputs] == ["error"]
    with pytest.raises(EngineFaultError, match="self-check"):
        engine.step()


@pytest.mark.parametrize(("params", "param"), [
    (SamplingParams(stop_token_ids=(999_999_999,)), "stop_token_ids"),
    (SamplingParams(logit_bias=((-1, 5.0),)), "logit_bias"),
    (SamplingParams(min_tokens=40, max_tokens=None), "min_tokens"),
])
def test_the_engine_refuses_what_the_protocol_layer_should_have(engine, params, param):
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("x", [5] * 480, params)  # max_tokens None leaves 32 tokens of a 512 context
    assert info.value.param == param
    assert not engine.has_unfinished_requests()


def test_seed_outside_64_bits_is_refused():
    with pytest.raises(InvalidRequestError, match="64-bit") as info:
        SamplingParams(seed=2**64)
    assert info.value.param == "seed"
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
