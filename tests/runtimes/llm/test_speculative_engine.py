"""Speculative decoding in the engine: a greedy or seeded request gets the same tokens with any proposals as without
speculation (accepted in full, in part or not at all; batched, preempted, resumed, by graph replay, n > 1, stop
strings and stop tokens inside an accepted run, logprobs), no block is left behind, unseeded sampling keeps its
distribution; and the adaptive proposal length follows acceptance and the measured cost of a row."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from registry.engine import SpeculativeOptions
from runtimes.llm.config import EngineConfig
from runtimes.llm.draft import check_same_tokenizer
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
from runtimes.llm.speculative import (
    PRIOR_ROW_COST,
    PROBE_EVERY,
    Acceptance,
    Lookup,
    SequenceState,
    Speculation,
    StepCost,
)
from tests.runtimes.llm.engine_utils import (
    Collected,
    assert_no_leak,
    assert_same_outputs,
    eager_and_graphed,
    random_prompt,
    run_to_completion,
)
from tests.runtimes.llm.test_engine import KV_PER_TOKEN
from tests.runtimes.llm.test_speculative import chi2_p_value

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True, presence_penalty=0.3)
EAGER = SpeculativeOptions(k=5, adaptive=False)  # always proposes up to k: every path gets exercised


class Oracle:
    """Proposes what the plain engine produced after the tokens so far (`expected`: prompt + output sequences),
    each proposed token replaced by a random one with probability `noise`; random tokens where no sequence
    matches. So proposals are accepted whole, in part and not at all."""

    def index(self) -> None:
        return None

    key = None

    def lookup(self, token_ids: Sequence[int], index: object, limit: int | None = None) -> Lookup:
        return Lookup(self.propose(token_ids, limit), 0)

    def lookup_many(self, wanted: Sequence[tuple[Sequence[int], object, int]]) -> list[Lookup]:
        return [self.lookup(token_ids, index, limit) for token_ids, index, limit in wanted]

    def __init__(self, expected: Sequence[Sequence[int]], noise: float, seed: int = 0) -> None:
        self.expected = [list(s) for s in expected]
        self.noise = noise
        self.rng = random.Random(seed)
        self.calls = 0

    def propose(self, token_ids: Sequence[int], limit: int | None = None, index: object = None) -> list[int]:
        self.calls += 1
        count = 5 if limit is None else min(5, limit)
        tokens = list(token_ids)
        follow: list[int] = []
        for sequence in self.expected:
            if sequence[:len(tokens)] == tokens:
                follow = sequence[len(tokens):len(tokens) + count]
                break
        follow += [self.rng.randrange(3, 259) for _ in range(count - len(follow))]
        return [t if self.rng.random() >= self.noise else self.rng.randrange(3, 259) for t in follow]


@pytest.fixture
def engines(tiny_loaded):
    loaded = tiny_loaded(seed=0)

    def make(speculative: SpeculativeOptions | None = EAGER, **overrides: object) -> LLMEngine:
        config = {"kv_cache_bytes": 2048 * KV_PER_TOKEN, "block_size": 4, "max_num_batched_tokens": 64,
                  "max_num_seqs": 32, "speculative": speculative, **overrides}
        return LLMEngine(loaded, EngineConfig(**config))

    return make


def _requests(count: int) -> dict[str, tuple[list[int], SamplingParams]]:
    requests = {}
    for i in range(count):
        params = GREEDY if i % 2 else SamplingParams(temperature=0.8, seed=100 + i, max_tokens=5 + i % 13,
                                                     ignore_eos=True, min_tokens=2)
        requests[f"r{i}"] = (random_prompt(i, 3 + (i * 7) % 40), params)
    return requests


def _sequences(requests, results: dict[str, Collected]) -> list[list[int]]:
    return [[*requests[key.split("#")[0]][0], *got.token_ids] for key, got in results.items()]


@pytest.mark.parametrize("noise", [0.0, 0.15, 0.6, 1.0])
def test_any_proposal_leaves_greedy_and_seeded_tokens_unchanged(engines, noise):
    requests = _requests(12)
    plain = run_to_completion(engines(None), requests)
    engine = engines()
    engine.speculation.proposer = oracle = Oracle(_sequences(requests, plain), noise)
    assert_same_outputs(plain, run_to_completion(engine, requests))
    stats = engine.speculation.stats
    assert oracle.calls and stats.num_proposed > 0
    if noise == 0.0:
        assert stats.num_accepted == stats.num_proposed  # a proposal of what comes is kept whole
    if noise == 1.0:
        assert stats.acceptance_rate < 0.05
    if 0 < noise < 1:
        assert 0 < stats.num_accepted < stats.num_proposed
    assert_no_leak(engine)


def test_fewer_steps_when_proposals_are_right(engines):
    requests = {"g": (random_prompt(3, 9), GREEDY)}
    base = engines(None)
    plain = run_to_completion(base, requests)
    engine = engines()
    engine.speculation.proposer = Oracle(_sequences(requests, plain), 0.0)
    assert_same_outputs(plain, run_to_completion(engine, requests))
    # one prefill step, then 23 tokens at up to 6 a step (5 proposed, all kept, and the one after)
    assert base.num_steps == 24 and engine.num_steps == 1 + 4


def test_stop_strings_stop_tokens_and_max_tokens_inside_an_accepted_run(engines):
    prompt = random_prompt(5, 11)
    plain_engine = engines(None)
    free = run_to_completion(plain_engine, {"g": (prompt, GREEDY)})["g"]
    text, tokens = free.text, free.token_ids
    stop_text = text[len(text) // 2: len(text) // 2 + 2]
    requests = {
        "stop_string": (prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop_text])),
        "stop_token": (prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                              stop_token_ids=[tokens[9]])),
        "max_tokens": (prompt, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)),
        "logprobs": (prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)),
    }
    plain = run_to_completion(engines(None), requests)
    assert plain["stop_string"].finish_reason == "stop" and len(plain["stop_string"].token_ids) < 24
    engine = engines()
    engine.speculation.proposer = Oracle([[*prompt, *tokens]], 0.0)
    got = run_to_completion(engine, requests)
    assert_same_outputs(plain, got)
    assert got["stop_token"].stop_reason == tokens[9]
    # (the tiny model's dense fp32 matmuls round by batch shape: logprobs agree to float precision here; SmolLM2's
    # block kernels give the same bits, below)
    got_lp, plain_lp = got["logprobs"].logprobs, plain["logprobs"].logprobs
    assert [lp.token_id for lp in got_lp] == [lp.token_id for lp in plain_lp] and len(got_lp) == 24
    assert [lp.logprob for lp in got_lp] == pytest.approx([lp.logprob for lp in plain_lp], abs=1e-5)
    assert [[t for t, _ in lp.top] for lp in got_lp] == [[t for t, _ in lp.top] for lp in plain_lp]
    assert engine.speculation.stats.num_accepted > 0
    assert_no_leak(engine)


def test_preemption_n_samples_and_prefix_caching(engines):
    """A KV pool small enough that requests are preempted (and recomputed), n = 2 seeded samples sharing their
    prompt's blocks, and prompts sharing prefixes: the same tokens, no leak."""
    shared = random_prompt(8, 12)
    requests = {f"p{i}": ([*shared, *random_prompt(20 + i, 5)], GREEDY if i % 2 else SEEDED) for i in range(6)}
    requests["n"] = (random_prompt(9, 7), SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=20,
                                                         ignore_eos=True))
    small = {"kv_cache_bytes": 64 * KV_PER_TOKEN}
    plain = run_to_completion(engines(None, **small), requests)
    engine = engines(**small)
    engine.speculation.proposer = Oracle(_sequences(requests, plain), 0.2)
    assert_same_outputs(plain, run_to_completion(engine, requests))
    assert engine.scheduler.num_preemptions > 0 and engine.speculation.stats.num_accepted > 0
    assert_no_leak(engine)


def test_a_resumed_request_continues_exactly(engines):
    prompt = random_prompt(4, 10)
    for params in (GREEDY, SEEDED):
        whole = run_to_completion(engines(None), {"r": (prompt, params)})["r"].token_ids
        engine = engines()
        engine.speculation.proposer = Oracle([[*prompt, *whole]], 0.3)
        engine.add_request("r", prompt, params, resume_token_ids=whole[:7])
        rest = run_to_completion(engine, {})["r"].token_ids
        assert whole[:7] + rest == whole


def test_graph_replay_verifies_drafts(tiny_loaded):
    """Decode graphs (a CPU stand-in for CUDA graphs) replay a draft's rows like any decode rows."""
    eager, graphed = eager_and_graphed(tiny_loaded(seed=0), kv_cache_bytes=2048 * KV_PER_TOKEN, block_size=4,
                                       max_num_seqs=16, speculative=EAGER)
    requests = _requests(6)
    plain = run_to_completion(eager, requests)  # (speculating too: its tokens are the plain ones, tested above)
    graphed.speculation.proposer = Oracle(_sequences(requests, plain), 0.2)
    assert_same_outputs(plain, run_to_completion(graphed, requests))
    assert graphed.num_graph_steps > 0 and graphed.speculation.stats.num_accepted > 0
    assert graphed.num_launched_steps == 0  # no step is launched ahead with speculation


def test_unseeded_sampling_keeps_its_distribution(engines):
    """The first two sampled tokens (top_k=3: nine outcomes), 1,500 runs each: speculation (the greedy continuation
    proposed, so proposals are accepted and rejected) does not change their joint distribution."""
    prompt = random_prompt(6, 8)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=2, ignore_eos=True)
    greedy = run_to_completion(engines(None), {"g": (prompt, GREEDY)})["g"].token_ids

    def draws(engine: LLMEngine) -> list[tuple[int, int]]:
        out = []
        for batch in range(6):
            got = run_to_completion(engine, {f"{batch}-{i}": (prompt, params) for i in range(250)})
            out += [(r.token_ids[0], r.token_ids[1]) for r in got.values()]
        return out

    plain = draws(engines(None, max_num_seqs=256, max_num_batched_tokens=4096))
    engine = engines(max_num_seqs=256, max_num_batched_tokens=4096)
    engine.speculation.proposer = Oracle([[*prompt, *greedy]], 0.0)
    spec = draws(engine)
    assert engine.speculation.stats.num_accepted > 100 and engine.speculation.stats.acceptance_rate < 0.95
    outcomes = sorted(set(plain) | set(spec))
    counts = torch.tensor([[plain.count(o) for o in outcomes], [spec.count(o) for o in outcomes]], dtype=torch.float64)
    assert chi2_p_value(counts) > 0.001


def test_prompt_lookup_on_smollm2_is_exact_and_accepted(smollm2_quantized):
    """The real proposer on a real model: a prompt that asks to repeat a text; greedy and seeded tokens equal
    plain decoding's, alone and batched, and most proposals are accepted."""
    tokenizer = smollm2_quantized.tokenizer
    text = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
            "members agreed to increase funding for the library and to postpone the decision on the parking lot.")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                                           add_generation_prompt=True)
    other = tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}],
                                          add_generation_prompt=True)
    requests = {"copy": (prompt, SamplingParams(temperature=0.0, max_tokens=48)),
                "seeded": (prompt, SamplingParams(temperature=0.7, seed=5, max_tokens=48)),
                "chat": (other, SamplingParams(temperature=0.0, max_tokens=32, logprobs=2))}
    config = {"kv_cache_bytes": 64 << 20, "device": "cpu"}
    plain = run_to_completion(LLMEngine(smollm2_quantized, EngineConfig(**config)), requests)
    engine = LLMEngine(smollm2_quantized, EngineConfig(**config, speculative=SpeculativeOptions()))
    got = run_to_completion(engine, requests)
    assert_same_outputs(plain, got)
    assert got["chat"].logprobs == plain["chat"].logprobs  # the same bits: each row computed as in plain decoding
    alone = run_to_completion(engine, {"copy": requests["copy"]})
    assert alone["copy"].token_ids == plain["copy"].token_ids
    assert engine.speculation.stats.acceptance_rate > 0.5
    assert_no_leak(engine)


class _Scheduler:
    def __init__(self) -> None:
        self.requests: dict[str, object] = {}


def test_step_cost_by_row_count_with_a_fitted_line_between():
    cost = StepCost()
    assert cost.seconds(1) is None
    for _ in range(3):
        cost.record(1, 0.005)
    assert cost.seconds(1) == pytest.approx(0.005)
    assert cost.seconds(3) - cost.seconds(1) == pytest.approx(2 * PRIOR_ROW_COST * 0.005, rel=0.3)  # the prior slope
    for rows in [1, 3, 6, 9, 2, 5] * 20:
        cost.record(rows, 0.004 + 0.001 * rows + (0.0007 if rows == 2 else 0.0))  # a second row costs more
    a, b = cost.coefficients()
    assert a == pytest.approx(0.004, rel=0.1) and b == pytest.approx(0.001, rel=0.1)
    assert cost.seconds(2) == pytest.approx(0.0067, rel=0.01)  # measured, not the line
    assert cost.seconds(4) == pytest.approx(a + 4 * b)  # never measured: the line
    cost.record(2, 1.0)  # a stall (the machine busy elsewhere) counts as three times the prediction at most
    assert cost.seconds(2) < 0.0067 * 1.1


def _speculation(**options: object) -> Speculation:
    spec = Speculation(SpeculativeOptions(**options), _Scheduler())  # type: ignore[arg-type]
    for rows in range(1, 40):
        for _ in range(3):
            spec.cost.record(rows, 0.004 + 0.001 * rows)
    return spec


def test_adaptive_depth_follows_acceptance_and_batch():
    spec = _speculation(k=8)
    base, big = spec.cost.seconds(1), spec.cost.seconds(32)
    # an unknown kind of proposal (the prior rate) goes a little deep; one that keeps coming true, all it may
    state = SequenceState(spec.proposer.index())
    assert 1 <= spec.depth(spec.rate(state, 2), 8, 1, base, 1) <= 2
    assert spec.depth(0.95, 8, 1, base, 1) == 8 and spec.depth(0.95, 3, 1, base, 1) == 3
    assert spec.depth(0.05, 8, 1, base, 1) == 0
    assert spec.depth(0.7, 8, 1, base, 1) >= 3
    # a batch of 32: a row costs about what a token is worth, so only a request that is nearly always right proposes
    assert spec.depth(0.7, 8, 32, big, 32) == spec.depth(spec.rate(state, 2), 8, 32, big, 32) == 0
    assert spec.depth(0.95, 8, 1, None, 1) == 0  # nothing measured yet
    spec.proposal_cost = base  # a draft model as costly per token as the target: it never pays
    assert spec.depth(0.999, 8, 1, base, 1) == 0
    spec.proposal_cost = base / 50  # a small draft: nearly as deep as without its cost
    assert spec.depth(0.95, 8, 1, base, 1) >= 6
    spec.proposal_cost = 0.0
    # the replica learns per match length; a request's own record moves its rate, and fades when it stops proposing
    for _ in range(20):
        spec.shared.setdefault(4, Acceptance()).learn(8, 8, 0.98)
        spec.shared.setdefault(1, Acceptance()).learn(0, 1, 0.98)
    assert spec.rate(state, 4) > 0.9 and spec.rate(state, 1) < 0.15
    assert spec.depth(spec.rate(state, 4), 8, 1, base, 1) == 8 and spec.depth(spec.rate(state, 1), 8, 1, base, 1) == 0
    for _ in range(3):
        state.acceptance.learn(0, 1, 0.8)
    assert spec.rate(state, 4) < 0.6
    for _ in range(200):
        state.acceptance.learn(0, 0, 0.98)
    assert spec.rate(state, 4) > 0.9


def test_without_adaptation_every_decode_proposes_up_to_k(engines):
    engine = engines(SpeculativeOptions(k=3, adaptive=False, prompt_lookup_min=1))
    engine.speculation.proposer = Oracle([], 1.0)
    run_to_completion(engine, {"a": (random_prompt(1, 6), GREEDY)})
    stats = engine.speculation.stats
    # (random proposals, all rejected here:) a draft at outputs 1..22, 3 tokens but the last two: within max_tokens
    assert stats.num_accepted == 0 and stats.num_drafts == 22 and stats.num_proposed == 3 * 20 + 2 + 1


def test_a_rejected_tail_gives_its_blocks_back(engines):
    """After every step a running request holds no block past the one its next token goes in, though its
    proposals (random tokens: nearly all wrong) took slots up to k positions further."""
    engine = engines()
    engine.speculation.proposer = Oracle([], 1.0)
    for i in range(4):
        engine.add_request(f"r{i}", random_prompt(30 + i, 5 + 3 * i), GREEDY)
    trimmed: list[int] = []
    trim = engine.kv.trim
    engine.kv.trim = lambda request: trimmed.append(trim(request)) or trimmed[-1]  # type: ignore[method-assign]
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            table = engine.kv.block_tables[request.request_id]
            assert len(table) <= engine.kv.blocks_for(request.num_computed_tokens + 1)
    held_more = sum(trimmed) > 0
    assert engine.speculation.stats.num_proposed > 0 and engine.speculation.stats.acceptance_rate < 0.05 and held_more
    assert_no_leak(engine)


def test_a_step_with_a_draft_stopped_for_an_arrival_finishes_or_sheds_it_exactly(engines):
    """A step holding a draft (a decode) and a background prompt's chunk is stopped between layers for an
    interactive arrival, which (no seat left) displaces one of them out of the stopped step; the step then
    finishes, draft rows and all, and every request's tokens are the plain engine's."""
    from policies.classify import BACKGROUND, INTERACTIVE

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {"bg1": random_prompt(40, 4), "bg2": random_prompt(41, 10), "chat": random_prompt(42, 3)}
    plain = {name: run_to_completion(engines(None), {name: (prompt, greedy)})[name].token_ids
             for name, prompt in prompts.items()}
    for displaced in (False, True):
        config = {"max_num_batched_tokens": 16, "scheduling": "multilevel", "max_num_seqs": 2 if displaced else 4}
        engine = engines(**config)
        engine.speculation.proposer = Oracle([[*prompts[n], *plain[n]] for n in prompts], 0.2)
        tokens: dict[str, list[int]] = {}

        def step() -> None:
            for out in engine.step():  # noqa: B023 (each pass of the loop steps its own engine)
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)  # noqa: B023

        engine.add_request("bg1", prompts["bg1"], greedy, priority=BACKGROUND)
        step()  # bg1's prompt, then its decodes carry drafts
        engine.add_request("bg2", prompts["bg2"], greedy, priority=BACKGROUND)
        engine.request_yield(INTERACTIVE)
        assert engine.step() == []  # bg1's draft and bg2's prompt (room is left for the draft), stopped
        engine.clear_yield()
        suspended = engine.loop.stopped.suspended
        assert suspended is not None and any(item.draft for item in suspended.plan.scheduled)
        engine.add_request("chat", prompts["chat"], greedy, priority=INTERACTIVE)
        while engine.has_unfinished_requests():
            step()
        assert engine.num_interrupted_steps == 1 and engine.num_dropped_steps == 0
        assert (engine.scheduler.num_preemptions > 0) == displaced
        for name in prompts:
            assert tokens[name] == plain[name], (displaced, name)
        assert_no_leak(engine)


def test_graph_replay_after_a_trim_reads_the_blocks_the_request_holds(tiny_loaded):
    """Decode graphs keep each row's block table between steps, topping it up as the request's list grows; a
    rejected tail's blocks handed back (`trim`) and new ones taken later must reach the graph's table too. Wrong
    proposals every step, small blocks, and neighbours taking blocks, all by graph replay: the tokens stay plain."""
    eager, graphed = eager_and_graphed(tiny_loaded(seed=0), kv_cache_bytes=256 * KV_PER_TOKEN, block_size=2,
                                       max_num_seqs=16, speculative=SpeculativeOptions(k=5, adaptive=False))
    requests = {f"r{i}": (random_prompt(60 + i, 3 + 4 * i), GREEDY) for i in range(2)}
    plain = run_to_completion(eager, requests)
    graphed.speculation.proposer = Oracle([], 1.0)  # random tokens: nearly every proposal rejected
    trimmed: list[int] = []
    trim = graphed.kv.trim
    graphed.kv.trim = lambda request: trimmed.append(trim(request)) or trimmed[-1]  # type: ignore[method-assign]
    assert_same_outputs(plain, run_to_completion(graphed, requests))
    assert graphed.num_graph_steps > 10 and sum(trimmed) > 10


def test_a_stop_string_before_the_last_accepted_token_wins_over_max_tokens(engines):
    """One step brings tokens 8 to 10 of max_tokens 10 (all proposed right): a stop string that token 9 completes
    ends the output there, with finish_reason stop, as plain decoding does; not at 10 with length."""
    checked = 0
    for seed in range(30):
        prompt = random_prompt(300 + seed, 6)
        plain_engine = engines(None)
        free = run_to_completion(plain_engine, {"g": (prompt, GREEDY)})["g"]
        text_at = [plain_engine.tokenizer.decode(free.token_ids[:n]) for n in range(1, 11)]
        stop = text_at[8][-2:]  # completed by token 9 (index 8), not found before it
        if len(stop) < 2 or stop in text_at[7] or "\ufffd" in stop:
            continue
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop])
        plain = run_to_completion(engines(None), {"s": (prompt, params)})
        assert plain["s"].finish_reason == "stop" and len(plain["s"].token_ids) == 9
        engine = engines()
        engine.speculation.proposer = Oracle([[*prompt, *free.token_ids]], 0.0)
        got = run_to_completion(engine, {"s": (prompt, params)})
        assert_same_outputs(plain, got)
        assert got["s"].stop_reason == stop and engine.num_steps == 3  # prefill, tokens 2-7, tokens 8-10 cut at 9
        assert_no_leak(engine)
        checked += 1
    assert checked >= 3


def test_a_draft_model_proposes_and_the_target_keeps_its_tokens(tiny_loaded, engines):
    """A draft model of the same tokenizer (runtimes/llm/draft.py): a different random model (its proposals mostly
    wrong) and the target itself (its greedy proposals all right, so greedy requests take fewer steps): greedy and
    seeded tokens are the plain engine's either way, and neither engine leaks a block."""
    target = tiny_loaded(seed=0)
    requests = _requests(6)
    plain = run_to_completion(engines(None), requests)
    for draft, right in ((tiny_loaded(seed=3), False), (target, True)):
        config = EngineConfig(kv_cache_bytes=2048 * KV_PER_TOKEN, block_size=4, max_num_batched_tokens=64,
                              max_num_seqs=32, speculative=SpeculativeOptions(method="draft", draft_model="d", k=4,
                                                                              adaptive=False))
        engine = LLMEngine(target, config, draft=draft)
        assert_same_outputs(plain, run_to_completion(engine, requests))
        stats = engine.speculation.stats
        assert stats.num_proposed > 0
        if right:  # greedy proposals of the target itself: the greedy requests keep them all
            assert stats.acceptance_rate > 0.5
            lone = LLMEngine(target, config, draft=draft)
            run_to_completion(lone, {"g": (random_prompt(7, 9), GREEDY)})
            assert lone.num_steps == 1 + -(-23 // 5)  # the prefill, then 5 tokens a step
        else:
            assert stats.acceptance_rate < 0.5
        assert_no_leak(engine)
        draft_engine = engine.speculation.proposer.engine
        assert not draft_engine.has_unfinished_requests() and not draft_engine.kv.block_tables
        # the step's proposals are made in one batch of the draft's engine: k steps or fewer for all six requests
        # (one at a time, each would take its own k)
        assert draft_engine.num_steps <= 4 * engine.num_steps


def _self_drafting(tiny_loaded, engines):  # type: ignore[no-untyped-def]
    """Six requests, the plain engine's results for them, and an engine drafting with its own model (k 4, always
    proposed) with that draft's engine."""
    target = tiny_loaded(seed=0)
    requests = _requests(6)
    plain = run_to_completion(engines(None), requests)
    config = EngineConfig(kv_cache_bytes=2048 * KV_PER_TOKEN, block_size=4, max_num_batched_tokens=64,
                          max_num_seqs=32, speculative=SpeculativeOptions(method="draft", draft_model="d", k=4,
                                                                          adaptive=False))
    engine = LLMEngine(target, config, draft=target)
    return requests, plain, engine, engine.speculation.proposer.engine


def _assert_nothing_left(engine: LLMEngine, draft_engine: LLMEngine) -> None:
    assert_no_leak(engine)
    assert not draft_engine.has_unfinished_requests() and not draft_engine.kv.block_tables


def test_a_draft_that_fails_part_way_costs_only_its_proposals(tiny_loaded, engines):
    """The draft's engine raising in the middle of a batch of proposals: that step's requests decode without them,
    nothing of the batch stays in the draft's engine, and the tokens are the plain engine's."""
    requests, plain, engine, draft_engine = _self_drafting(tiny_loaded, engines)
    real_step, calls = draft_engine.step, [0]

    def flaky_step():
        calls[0] += 1
        if calls[0] % 7 == 3:  # now and then, part-way through a batch
            assert draft_engine.has_unfinished_requests()
            raise RuntimeError("draft step failed")
        return real_step()

    draft_engine.step = flaky_step
    assert_same_outputs(plain, run_to_completion(engine, requests))
    assert calls[0] > 7 and engine.speculation.stats.num_proposed > 0
    _assert_nothing_left(engine, draft_engine)


def test_a_sequence_the_draft_refuses_goes_without_and_the_rest_of_the_batch_keeps_theirs(tiny_loaded, engines):
    """The draft's engine refusing one sequence of a batch (say, longer than its pool holds): that one decodes
    without a proposal, the others of the batch get theirs, and nothing is left queued in the draft's engine."""
    from foundation.request_errors import InvalidRequestError

    requests, plain, engine, draft_engine = _self_drafting(tiny_loaded, engines)
    real_add, refused = draft_engine.add_request, [0]
    longest = max((prompt for prompt, _ in requests.values()), key=len)

    def picky_add(request_id, prompt, params):
        if prompt[:len(longest)] == longest:  # the longest request's sequence, at every proposal
            refused[0] += 1
            raise InvalidRequestError("the prompt needs more KV blocks than the pool has", param="prompt")
        return real_add(request_id, prompt, params)

    draft_engine.add_request = picky_add
    assert_same_outputs(plain, run_to_completion(engine, requests))
    stats = engine.speculation.stats
    assert refused[0] > 1 and stats.num_drafts > 10 and stats.num_accepted > 10  # the others' kept coming
    _assert_nothing_left(engine, draft_engine)


def test_a_draft_model_is_loaded_with_its_own_weights_choice(tmp_path):
    """`from_source` loads the draft as its registry entry holds it (`draft_weights`, the launch's copy of its
    `engine.weights`): here a float target and its draft quantized to q8; the target's tokens stay its own."""
    from runtimes.llm.quant.cpu import BlockWeight
    from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

    path = str(write_gguf(hf_model(TinySpec(), seed=4), tmp_path / "tiny.gguf"))  # float tensors
    config = EngineConfig(device="cpu", kv_cache_bytes=512 * KV_PER_TOKEN, block_size=4, weights="fp32",
                          speculative=SpeculativeOptions(method="draft", draft_model="d", k=4, adaptive=False))
    engine = LLMEngine.from_source(path, config, draft_source=path, draft_weights="q8")
    draft_engine = engine.speculation.proposer.engine
    blocks = [m for m in draft_engine.runner.model.modules() if isinstance(m, BlockWeight)]
    assert blocks and {m.fmt.name for m in blocks} == {"Q8_0"}
    assert not any(isinstance(m, BlockWeight) for m in engine.runner.model.modules())
    plain = LLMEngine.from_source(path, config.model_copy(update={"speculative": None}))
    requests = {"g": (list(range(3, 40)), GREEDY)}
    assert_same_outputs(run_to_completion(plain, requests), run_to_completion(engine, requests))
    assert engine.speculation.stats.num_proposed > 0


def test_a_proposal_that_completes_its_grammar_ends_the_output_where_plain_decoding_does(engines):
    """Grammars without a closing plan (a regex, a choice) are proposed to up to their last tokens: the token that
    completes the grammar is left out of a proposal (plain decoding ends the output there, sampling nothing after
    it), so no EOS is added and the finish reason is plain decoding's. A grammar failing while proposals are made
    costs only that request's proposals."""
    from runtimes.llm.sampling_params import StructuredOutput

    requests = {
        "regex": (random_prompt(80, 5), SamplingParams(temperature=0.0, max_tokens=60,
                                                       structured=StructuredOutput(regex="[a-z]{2,24}"))),
        "regex-seeded": (random_prompt(81, 5), SamplingParams(temperature=0.9, seed=3, max_tokens=60,
                                                              structured=StructuredOutput(regex="[a-z]{2,24}"))),
        "choice": (random_prompt(82, 5), SamplingParams(temperature=0.0, max_tokens=60, structured=StructuredOutput(
            choice=("abcdefghij", "abcdefxyzw")))),
        "g": (random_prompt(83, 5), GREEDY)}
    plain = run_to_completion(engines(None), requests)
    for key in ("regex", "choice"):
        assert plain[key].finish_reason == "stop" and len(plain[key].token_ids) < 30  # the grammar ended it
    engine = engines()
    engine.speculation.proposer = Oracle(_sequences(requests, plain), 0.0)
    assert_same_outputs(plain, run_to_completion(engine, requests))
    assert engine.speculation.stats.num_accepted > 20
    assert_no_leak(engine)
    failing = engines()  # and a grammar that fails while a proposal's masks are made
    failing.speculation.proposer = Oracle(_sequences(requests, plain), 0.0)
    add = failing.add_request

    def add_broken(request_id, prompt, params, *args, **kwargs):  # type: ignore[no-untyped-def]
        add(request_id, prompt, params, *args, **kwargs)
        for request in failing.scheduler.requests.values():
            if request.grammar is not None:
                request.grammar.masks_along = _raise  # type: ignore[method-assign]

    failing.add_request = add_broken  # type: ignore[method-assign]
    assert_same_outputs(plain, run_to_completion(failing, requests))
    assert_no_leak(failing)


def _raise(*args: object) -> None:
    raise RuntimeError("grammar matcher failed: a limit of its parser")


def test_a_draft_that_stopped_paying_probes_now_and_then():
    spec = _speculation(k=8)
    due = [spec._probe_due() for _ in range(3 * PROBE_EVERY)]
    assert sum(due) == 3 and due[PROBE_EVERY - 1] and not any(due[:PROBE_EVERY - 1])


def test_a_draft_may_pad_its_embedding_but_not_change_the_vocabulary(tiny_loaded):
    tokenizer = tiny_loaded(seed=0).tokenizer
    check_same_tokenizer(tokenizer, tokenizer, tokenizer.vocab_size + 64)  # padded rows: fine
    with pytest.raises(ValueError, match="embedding rows"):
        check_same_tokenizer(tokenizer, tokenizer, tokenizer.vocab_size - 1)


def test_a_draft_with_another_tokenizer_is_refused(tiny_loaded, smollm2_quantized):
    config = EngineConfig(kv_cache_bytes=2048 * KV_PER_TOKEN, block_size=4,
                          speculative=SpeculativeOptions(method="draft", draft_model="d"))
    with pytest.raises(ValueError, match=r"speculative\.draft_model: the draft model's tokenizer differs"):
        LLMEngine(tiny_loaded(seed=0), config, draft=smollm2_quantized)
    with pytest.raises(ValueError, match=r"speculative\.draft_model: a draft model is loaded exactly when"):
        LLMEngine(tiny_loaded(seed=0), config)  # method draft, no draft
    with pytest.raises(ValueError, match=r"speculative\.draft_model: a draft model is loaded exactly when"):
        LLMEngine(tiny_loaded(seed=0), config.model_copy(update={"speculative": SpeculativeOptions()}),
                  draft=tiny_loaded(seed=1))  # prompt lookup, and a draft


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_a_structured_request_is_proposed_to_and_keeps_its_tokens(engines, noise):
    """Structured outputs under speculation: a JSON-schema request beside plain ones is given proposals, cut before
    the first token its grammar refuses, each verified position sampled under the grammar's mask there; its tokens
    are plain decoding's (greedy and seeded), and proposals stop where fewer than the closing window's tokens of its
    budget are left."""
    import json

    from runtimes.llm.grammar.closing import CLOSE_WINDOW
    from runtimes.llm.sampling_params import StructuredOutput

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["ok", "n", "tags"], "additionalProperties": False}
    structured = StructuredOutput(json_schema=json.dumps(schema))
    budget = CLOSE_WINDOW + 40
    requests = {"json": (random_prompt(70, 6), SamplingParams(temperature=0.0, max_tokens=budget,
                                                              structured=structured)),
                "json-seeded": (random_prompt(72, 6), SamplingParams(temperature=0.8, seed=5, max_tokens=budget,
                                                                     structured=structured)),
                **{f"g{i}": (random_prompt(71 + i, 5), GREEDY) for i in range(2)}}
    plain = run_to_completion(engines(None), requests)
    engine = engines()
    engine.speculation.proposer = Oracle(_sequences(requests, plain), noise)
    drafted: list[tuple[int, int]] = []  # (output tokens so far, proposal length) of the structured requests
    draft = engine.speculation.draft

    def spy(plan):  # type: ignore[no-untyped-def]
        draft(plan)
        drafted.extend((i.request.num_output_tokens, len(i.draft)) for i in plan.scheduled
                       if i.draft and i.request.grammar is not None)

    engine.speculation.draft = spy  # type: ignore[method-assign]
    assert_same_outputs(plain, run_to_completion(engine, requests))
    assert drafted and engine.speculation.stats.num_accepted > 0
    assert all(done + length < budget - CLOSE_WINDOW for done, length in drafted)
    assert_no_leak(engine)
