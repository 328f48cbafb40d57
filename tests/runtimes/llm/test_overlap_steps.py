"""Decode steps launched ahead (runtimes/llm/steps/ahead.py), through the CPU stand-in for CUDA graphs.

On the CPU every launch completes before it returns, so what is checked here is the bookkeeping, not the overlap in
time: a step planned before the previous one's tokens are applied, its input tokens read from that step's device
tensor, its slots allocated ahead, the tokens computed for requests that the step in flight finishes thrown away,
and the chain broken whenever the next plan is not certain. Every run is compared with the same engine stepping
eagerly, token for token, and must leave no KV block held.
"""

from __future__ import annotations

import pytest

from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import (
    assert_no_leak,
    assert_same_outputs,
    eager_and_graphed,
    random_prompt,
    record_launches,
    run_to_completion,
)
from tests.runtimes.llm.test_cuda_graphs import KV_PER_TOKEN


@pytest.fixture
def engines(tiny_loaded):
    """(eager engine, overlapping engine) factory over one tiny model with the C++ CPU attention."""
    loaded = tiny_loaded(seed=5)

    def make(**overrides: object) -> tuple[LLMEngine, LLMEngine]:
        config = {"kv_cache_bytes": 1024 * KV_PER_TOKEN, "block_size": 4, "max_num_batched_tokens": 64,
                  "max_num_seqs": 8, **overrides}
        eager, overlapping = eager_and_graphed(loaded, **config)
        assert overlapping.overlap_steps == config.get("overlap_steps", True) and not eager.overlap_steps
        return eager, overlapping

    return make


def _greedy(max_tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)  # type: ignore[arg-type]


def test_greedy_decoding_runs_ahead_and_gives_the_eager_tokens(engines):
    eager, overlapping = engines()
    requests = {f"g{i}": (random_prompt(i, 3 + 5 * i), _greedy(5 + 7 * i)) for i in range(6)}
    expected = run_to_completion(eager, requests)
    got = run_to_completion(overlapping, requests)
    assert_same_outputs(expected, got)
    # all six start together and finish at 5, 12, ..., 40 tokens: most decode steps are launched ahead
    assert overlapping.num_launched_steps > 25
    assert overlapping.num_steps == eager.num_steps
    assert_no_leak(overlapping)


def test_a_stop_token_ends_a_request_whose_next_token_was_already_launched(engines):
    """Stop tokens are found only when a step's tokens are read: by then the step after it is running for that
    request too. Its token there is thrown away, and its blocks (one allocated ahead) are freed."""
    eager, overlapping = engines()
    probe = run_to_completion(eager, {f"p{i}": (random_prompt(20 + i, 6), _greedy(30)) for i in range(5)})
    # each request stops at the token it would make 4 + i tokens in (and, if that comes earlier, there)
    requests = {f"s{i}": (random_prompt(20 + i, 6), _greedy(30, stop_token_ids=[probe[f"p{i}"].token_ids[4 + i]]))
                for i in range(5)}
    expected = run_to_completion(eager, requests)
    rows = record_launches(overlapping)
    got = run_to_completion(overlapping, requests)
    assert_same_outputs(expected, got)
    assert all(r.finish_reason == "stop" for r in got.values())
    # a row whose input is at position 6 - 1 + n makes token n + 1 of a request that stopped at n: thrown away
    wasted = [(rid, start) for rid, start in rows if start >= 6 - 1 + len(got[rid].token_ids)]
    assert wasted and len(wasted) <= len(requests)  # at most one per request
    assert_no_leak(overlapping)


def test_only_rows_sampled_from_their_logits_alone_are_launched_and_seeded_ones_reproduce(engines):
    """Greedy, seeded (top-p) and min-p rows may run ahead; a penalised row or one that asks for logprobs never does,
    and a row whose min_tokens still suppresses EOS only once it has them. Seeded noise is keyed by output position,
    so a seeded row launched ahead (its last token still on the device) draws what the eager engine draws."""
    eager, overlapping = engines()
    prompts = {name: random_prompt(seed, length) for name, seed, length in (
        ("greedy", 1, 7), ("seeded", 2, 9), ("min_p", 5, 4), ("penalised", 3, 5), ("logprobs", 6, 6),
        ("min_tokens", 4, 5))}
    requests = {
        "greedy": (prompts["greedy"], _greedy(40)),
        "seeded": (prompts["seeded"], SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=36,
                                                     ignore_eos=True)),
        "min_p": (prompts["min_p"], SamplingParams(temperature=1.1, min_p=0.05, seed=12, max_tokens=30,
                                                   ignore_eos=True)),
        "penalised": (prompts["penalised"], _greedy(12, repetition_penalty=1.3)),
        "logprobs": (prompts["logprobs"], _greedy(16, logprobs=2)),
        "min_tokens": (prompts["min_tokens"], SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20)),
    }
    expected = run_to_completion(eager, requests)
    rows = record_launches(overlapping)
    got = run_to_completion(overlapping, requests)
    for key in requests:
        assert got[key].token_ids == expected[key].token_ids, key
    launched = {rid for rid, _ in rows}
    assert {"greedy", "seeded", "min_p"} <= launched and not launched & {"penalised", "logprobs"}
    # outputs as of a launched row's input: start + 1 - prompt length, never short of min_tokens
    assert all(start + 1 - len(prompts[rid]) >= 20 for rid, start in rows if rid == "min_tokens")
    assert_no_leak(overlapping)


def test_an_arrival_or_an_abort_between_steps_breaks_the_chain_and_loses_nothing(engines):
    eager, overlapping = engines()
    first = {f"a{i}": (random_prompt(40 + i, 4 + i), _greedy(20)) for i in range(3)}
    late = {"late": (random_prompt(50, 11), _greedy(12))}
    results = {}
    for engine in (eager, overlapping):
        for request_id, (prompt, params) in first.items():
            engine.add_request(request_id, prompt, params)
        outputs = []
        for _ in range(6):  # prefill, then decode steps (launched ahead on the overlapping engine)
            outputs += engine.step()
        if engine is overlapping:
            assert engine.loop.ahead.inflight is not None
        outputs += engine.abort_request("a1")
        engine.add_request("late", *late["late"])
        while engine.has_unfinished_requests():
            outputs += engine.step()
        tokens: dict[str, list[int]] = {}
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        results[engine is overlapping] = tokens
    assert results[True] == results[False]
    assert len(results[True]["a0"]) == 20 and len(results[True]["late"]) == 12
    assert_no_leak(overlapping)


def test_slots_that_cannot_be_allocated_ahead_leave_the_step_to_the_scheduler(engines):
    """A tight KV cache: a step ahead whose slots do not fit is not launched; the ordinary step then preempts as
    usual. The tokens are the eager engine's."""
    eager, overlapping = engines(kv_cache_bytes=24 * 4 * KV_PER_TOKEN)  # 24 blocks of 4 tokens
    requests = {f"t{i}": (random_prompt(60 + i, 9), _greedy(26)) for i in range(4)}
    expected = run_to_completion(eager, requests)
    got = run_to_completion(overlapping, requests)
    assert_same_outputs(expected, got)
    assert overlapping.scheduler.num_preemptions > 0 and overlapping.num_launched_steps > 0
    assert_no_leak(overlapping)


def test_no_step_runs_ahead_under_a_time_slice_gate_or_when_turned_off(engines):
    _, overlapping = engines()

    class Gate:
        def acquire(self) -> None: ...
        def release(self, more: bool) -> None: ...

    AsyncLLMEngine(overlapping, start_thread=False, step_gate=Gate())
    assert not overlapping.overlap_steps
    _, off = engines(overlap_steps=False)
    run_to_completion(off, {"x": (random_prompt(70, 5), _greedy(10))})
    assert off.num_launched_steps == 0 and off.runner.graphs is not None and off.runner.graphs.replays > 0


def test_graph_and_launched_steps_are_counted_in_the_replica_metrics(engines):
    from runtimes.server.metrics import ServerMetrics

    _, overlapping = engines()
    run_to_completion(overlapping, {"m": (random_prompt(80, 5), _greedy(12))})
    text = ServerMetrics(overlapping, "tiny").render().decode()
    graph_steps = overlapping.runner.graphs.replays  # type: ignore[union-attr]
    assert graph_steps == overlapping.num_launched_steps == 11  # every decode step after the prefill
    assert f'multiserve_num_graph_steps_total{{model_name="tiny"}} {float(graph_steps)}' in text
    assert f'multiserve_num_launched_steps_total{{model_name="tiny"}} {float(overlapping.num_launched_steps)}' in text


def test_a_launch_that_fails_hands_its_tokens_back_to_the_ordinary_steps(engines):
    eager, overlapping = engines()
    requests = {f"f{i}": (random_prompt(90 + i, 6), _greedy(16)) for i in range(3)}
    expected = run_to_completion(eager, requests)
    launch, calls = overlapping.runner.launch, [0]

    def failing(plan, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:  # a step launched after one in flight
            raise RuntimeError("launch failed")
        return launch(plan, *args, **kwargs)

    overlapping.runner.launch = failing  # type: ignore[method-assign]
    got = run_to_completion(overlapping, requests)
    assert_same_outputs(expected, got)
    assert calls[0] == 4 and not overlapping.overlap_steps  # no more launches after the failure
    assert_no_leak(overlapping)
