"""Tests for the iteration-level scheduler (runtimes/llm/scheduler.py) driven by a fake runner: CPU only, no model.

The fake runner plays the model: for every planned item it checks that the scheduler hands it the right
slice of the request's tokens, and for items that reach the end of the known tokens it "samples" a
deterministic token derived from the request id and its length.
"""

from __future__ import annotations

import random
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pytest

from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.request import Request, RequestStatus
from runtimes.llm.sampling_params import SamplingParams
from runtimes.llm.scheduler import Scheduler, SchedulerOutput

EOS = 2
BS = 4


def fake_token(request_id: str, num_tokens: int) -> int:
    """Deterministic, never EOS nor a small stop id."""
    return 1000 + (zlib.crc32(request_id.encode()) + 7919 * num_tokens) % 50_000


def prompt_for(request_id: str, length: int) -> list[int]:
    base = zlib.crc32(request_id.encode()) % 10_000
    return [100_000 + base * 1000 + i for i in range(length)]


@dataclass(frozen=True)
class Fed:
    """What the runner saw for one planned item."""

    step: int
    start: int
    tokens: tuple[int, ...]
    samples: bool


class FakeRunner:
    def __init__(self, token: Callable[[Request], int] | None = None) -> None:
        self.token = token or (lambda r: fake_token(r.request_id, r.num_tokens))
        self.fed: dict[str, list[Fed]] = defaultdict(list)
        self.step = 0

    def __call__(self, plan: SchedulerOutput) -> dict[str, list[int]]:
        sampled = {}
        for item in plan.scheduled:
            r = item.request
            assert item.num_new_tokens > 0
            assert item.start == r.num_computed_tokens
            assert item.start + item.num_new_tokens <= r.num_tokens
            tokens = tuple(r.token_ids[item.start : item.start + item.num_new_tokens])
            self.fed[r.request_id].append(Fed(self.step, item.start, tokens, item.samples))
            if item.samples:
                sampled[r.request_id] = [self.token(r)]
        self.step += 1
        return sampled


@dataclass
class Run:
    plans: list[SchedulerOutput]
    running_before: list[list[Request]]  # scheduler.running just before each schedule()
    runner: FakeRunner


def step(scheduler: Scheduler, runner: FakeRunner, log: Run | None = None) -> SchedulerOutput:
    before = list(scheduler.running)
    plan = scheduler.schedule()
    assert plan.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert len({s.request.request_id for s in plan.scheduled}) == len(plan.scheduled)
    assert all(s.request.status == RequestStatus.RUNNING for s in plan.scheduled)
    for victim in plan.preempted:
        assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
        assert victim.request_id not in scheduler.kv.block_tables and victim in list(scheduler.waiting)
    if plan.preempted:
        assert all(item.request in before for item in plan.scheduled)  # no admission in a step that preempted
    scheduler.update(plan, runner(plan))
    if log is not None:
        log.plans.append(plan)
        log.running_before.append(before)
    return plan


def run(scheduler: Scheduler, steps: int, runner: FakeRunner | None = None) -> Run:
    """Step until nothing is left (failing after `steps`: a bound that catches deadlock and livelock)."""
    log = Run([], [], runner or FakeRunner())
    for _ in range(steps):
        if scheduler.num_unfinished == 0:
            return log
        step(scheduler, log.runner, log)
    assert scheduler.num_unfinished == 0, f"not done after {steps} steps: {list(scheduler.requests.values())}"
    return log


@pytest.fixture
def make_scheduler() -> Callable[..., Scheduler]:
    def make(
        num_blocks: int = 256,
        block_size: int = BS,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 4096,
    ) -> Scheduler:
        return Scheduler(KVCacheManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, max_model_len)

    return make


@pytest.fixture
def make_request() -> Callable[..., Request]:
    clock = iter(range(1_000_000))

    def make(
        request_id: str,
        prompt: int | list[int] = 8,
        max_tokens: int = 4,
        namespace: str | None = "m",
        priority: int = 0,
        eos: tuple[int, ...] = (),
        **params: object,
    ) -> Request:
        tokens = prompt_for(request_id, prompt) if isinstance(prompt, int) else prompt
        params.setdefault("ignore_eos", True)
        sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
        return Request(request_id, tokens, sp, max_tokens, float(next(clock)), priority=priority,
                       eos_token_ids=eos, cache_namespace=namespace)

    return make


def add_all(scheduler: Scheduler, requests: Iterable[Request]) -> list[Request]:
    requests = list(requests)
    for r in requests:
        scheduler.add_request(r)
    return requests


def assert_all_done(scheduler: Scheduler, requests: list[Request]) -> None:
    assert all(r.status.finished for r in requests)
    assert scheduler.requests == {} and scheduler.running == [] and len(scheduler.waiting) == 0
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert scheduler.kv.block_tables == {}


# --- budgets ----------------------------------------------------------------------------------------


def test_token_budget_and_max_num_seqs(make_scheduler, make_request) -> None:
    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=32)
    rng = random.Random(0)
    reqs = add_all(s, (make_request(f"r{i}", rng.randint(5, 60), rng.randint(3, 10)) for i in range(20)))
    log = run(s, 500)  # `step` asserts both limits on every plan
    assert max(p.num_batched_tokens for p in log.plans) == 32  # the budget was actually binding
    assert max(len(b) for b in log.running_before) == 4
    assert_all_done(s, reqs)
    assert all(r.num_output_tokens == r.max_tokens and r.status == RequestStatus.FINISHED_LENGTH for r in reqs)


def test_duplicate_request_id_is_rejected(make_scheduler, make_request) -> None:
    s = make_scheduler()
    s.add_request(make_request("dup"))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("dup"))


# --- chunked prefill --------------------------------------------------------------------------------


def test_long_prompt_is_chunked_and_never_stalls_running_decodes(make_scheduler, make_request) -> None:
    s = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner()
    decoders = add_all(s, (make_request(f"d{i}", prompt=4, max_tokens=100) for i in range(3)))
    step(s, runner)  # 3 x 4 prompt tokens, each samples its first token
    assert all(d.num_output_tokens == 1 for d in decoders)

    long = make_request("long", prompt=100, max_tokens=2)
    s.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        outputs_before = [d.num_output_tokens for d in decoders]
        plan = step(s, runner)
        items = {item.request.request_id: item for item in plan.scheduled}
        assert all(items[d.request_id].num_new_tokens == 1 for d in decoders)
        assert [d.num_output_tokens for d in decoders] == [n + 1 for n in outputs_before]  # a token every step
        chunks.append(items["long"].num_new_tokens)
        assert len(chunks) < 20
    assert chunks == [13] * 7 + [9]  # 16 - 3 decodes per step; 7 * 13 + 9 == 100
    fed = runner.fed["long"]
    assert [f.start for f in fed] == [sum(chunks[:i]) for i in range(len(chunks))]
    assert sum((f.tokens for f in fed), ()) == tuple(long.prompt_token_ids)
    assert [f.samples for f in fed] == [False] * 7 + [True]


def test_decodes_are_planned_before_prompt_chunks(make_scheduler, make_request) -> None:
    s = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner()
    decoders = add_all(s, (make_request(f"d{i}", prompt=4, max_tokens=50) for i in range(3)))
    step(s, runner)
    long = make_request("long", prompt=100, max_tokens=2)
    s.add_request(long)
    step(s, runner)  # long is admitted with its first chunk
    # Put the mid-prefill request first in `running`: its position must not decide the plan order.
    s.running.remove(long)
    s.running.insert(0, long)
    plan = step(s, runner)
    assert [item.request for item in plan.scheduled] == [*decoders, long]
    assert [item.num_new_tokens for item in plan.scheduled] == [1, 1, 1, 13]

    s.max_num_batched_tokens = 3  # only room for the decodes: the chunk waits, the decodes do not
    plan = step(s, runner)
    assert [item.request for item in plan.scheduled] == decoders


# --- preemption -------------------------------------------------------------------------------------


def check_victims(log: Run) -> int:
    """Every preempted request was the least urgent (highest priority value), newest, running one."""
    count = 0
    for plan, before in zip(log.plans, log.running_before, strict=True):
        candidates = list(before)
        for victim in plan.preempted:
            assert victim is max(candidates, key=lambda r: (r.priority, r.arrival_time))
            candidates.remove(victim)
            count += 1
    return count


@pytest.mark.parametrize("namespace", [None, "m"])
def test_preemption_when_the_pool_is_too_small(make_scheduler, make_request, namespace) -> None:
    # 4 requests each growing to 8 + 16 = 24 tokens (6 blocks) in a 12-block pool.
    s = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = add_all(s, (make_request(f"r{i}", prompt=8, max_tokens=16, namespace=namespace) for i in range(4)))
    log = run(s, 400)
    assert s.num_preemptions > 0
    assert check_victims(log) == s.num_preemptions == sum(r.num_preemptions for r in reqs)
    assert reqs[0].num_preemptions == 0  # the oldest request keeps its progress
    assert all(r.num_output_tokens == 16 and r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    for r in reqs:  # outputs are exactly what the runner sampled, none lost or duplicated by recompute
        assert r.output_token_ids == [fake_token(r.request_id, n) for n in range(8, 24)]
    assert_all_done(s, reqs)


def test_preemption_victim_is_the_least_urgent_before_the_newest(make_scheduler, make_request) -> None:
    s = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = add_all(s, [
        make_request("old-urgent", prompt=8, max_tokens=16, priority=0),
        make_request("old-lazy", prompt=8, max_tokens=16, priority=5),
        make_request("new-urgent", prompt=8, max_tokens=16, priority=0),
        make_request("new-mid", prompt=8, max_tokens=16, priority=1),
    ])
    log = run(s, 400)
    first_victim = next(p.preempted[0] for p in log.plans if p.preempted)
    assert first_victim.request_id == "old-lazy"
    assert check_victims(log) == s.num_preemptions > 0
    assert reqs[0].num_preemptions == 0 and reqs[2].num_preemptions == 0
    assert all(r.num_output_tokens == 16 for r in reqs)
    assert_all_done(s, reqs)


def test_preempted_request_recomputes_its_full_history(make_scheduler, make_request) -> None:
    s = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    reqs = add_all(s, (make_request(f"r{i}", prompt=8, max_tokens=16, namespace=None) for i in range(4)))
    log = run(s, 400)
    preempted_at = {}  # request id -> (step, tokens known at preemption)
    for i, plan in enumerate(log.plans):
        for victim in plan.preempted:
            preempted_at.setdefault(victim.request_id, (i, None))
    assert preempted_at
    for rid, (at, _) in preempted_at.items():
        r = next(x for x in reqs if x.request_id == rid)
        fed = log.runner.fed[rid]
        before = [f for f in fed if f.step < at]
        known = 8 + sum(f.samples for f in before)  # prompt + outputs sampled before preemption
        assert known > 8  # it was decoding when preempted
        after = [f for f in fed if f.step > at]
        assert after[0].start == 0  # no prefix cache: recompute from scratch
        replay = []
        for f in after:
            replay.extend(f.tokens)
            if f.samples:
                break
        assert replay == r.token_ids[:known]  # the whole history, generated tokens included
        assert len(replay) == known


def test_resume_after_preemption_starts_at_its_own_cached_prefix(make_scheduler, make_request) -> None:
    # 10 blocks: a (16 + 9 tokens, 7 blocks) and b (16 + 20 tokens) both hold 5 blocks after 4 outputs;
    # a's next block preempts b, whose 4 full prompt blocks stay cached while a finishes with one more block.
    s = make_scheduler(num_blocks=10, max_num_batched_tokens=64)
    a, b = add_all(s, [make_request("a", prompt=16, max_tokens=9), make_request("b", prompt=16, max_tokens=20)])
    log = run(s, 100)
    preempting = [i for i, plan in enumerate(log.plans) if plan.preempted]
    assert len(preempting) == 1 and log.plans[preempting[0]].preempted == [b]
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    at = preempting[0]
    fed = log.runner.fed["b"]
    known = 16 + sum(f.samples for f in fed if f.step < at)
    resumed = next(f for f in fed if f.step > at)
    assert resumed.start == 16  # the prompt blocks were hits; only the generated tokens are recomputed
    assert resumed.tokens == tuple(b.token_ids[16:known]) and resumed.samples
    assert b.num_cached_tokens == 0  # counted at first admission only
    assert b.output_token_ids == [fake_token("b", n) for n in range(16, 36)]
    assert_all_done(s, [a, b])


# --- prefix caching ---------------------------------------------------------------------------------


def test_second_request_with_a_shared_prefix_starts_at_the_hit(make_scheduler, make_request) -> None:
    s = make_scheduler(block_size=16, max_num_batched_tokens=256)
    shared = list(range(500, 548))  # 48 tokens = 3 blocks of 16
    first = make_request("first", prompt=[*shared, *range(10, 18)], max_tokens=8)
    s.add_request(first)
    runner = FakeRunner()
    step(s, runner)
    assert first.num_output_tokens == 1 and first.num_cached_tokens == 0

    second = make_request("second", prompt=[*shared, *range(20, 30)], max_tokens=8)
    s.add_request(second)
    plan = step(s, runner)
    item = next(i for i in plan.scheduled if i.request is second)
    assert item.start == 48 and item.num_new_tokens == 10
    assert second.num_cached_tokens == 48
    assert s.kv.block_table("second")[:3] == s.kv.block_table("first")[:3]
    assert runner.fed["second"][0].tokens == tuple(range(20, 30))
    # Counted once per admitted request.
    assert s.kv.stats.hit_tokens == 48
    assert s.kv.stats.queried_tokens == 56 + 58
    reqs = [first, second]
    run(s, 50, runner)
    assert_all_done(s, reqs)


def test_identical_prompt_still_computes_its_last_token(make_scheduler, make_request) -> None:
    s = make_scheduler(block_size=16, max_num_batched_tokens=256)
    prompt = list(range(500, 548))
    first = make_request("first", prompt=prompt)
    s.add_request(first)
    runner = FakeRunner()
    step(s, runner)
    second = make_request("second", prompt=prompt)
    s.add_request(second)
    step(s, runner)
    assert second.num_cached_tokens == 32  # the last full block is recomputed to get logits for token 48
    assert runner.fed["second"][0].start == 32 and runner.fed["second"][0].samples


def test_no_namespace_means_no_prefix_hits(make_scheduler, make_request) -> None:
    s = make_scheduler(block_size=16, max_num_batched_tokens=256)
    prompt = list(range(500, 560))
    s.add_request(make_request("first", prompt=prompt, namespace=None))
    runner = FakeRunner()
    step(s, runner)
    second = make_request("second", prompt=prompt, namespace=None)
    s.add_request(second)
    step(s, runner)
    assert second.num_cached_tokens == 0 and runner.fed["second"][0].start == 0
    assert s.kv.stats.hit_tokens == 0


# --- abort ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["prefill", "decode", "waiting"])
def test_abort_frees_all_blocks_at_once(make_scheduler, make_request, phase) -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=16)
    runner = FakeRunner()
    others = add_all(s, (make_request(f"o{i}", prompt=4, max_tokens=20) for i in range(2)))
    step(s, runner)
    if phase == "waiting":  # a third request ahead of the victim fills max_num_seqs
        others.append(make_request("filler", prompt=4, max_tokens=30))
        s.add_request(others[-1])
    victim = make_request("victim", prompt=100 if phase == "prefill" else 6, max_tokens=50)
    s.add_request(victim)
    for _ in range(3):
        step(s, runner)
    if phase == "prefill":
        assert 0 < victim.num_computed_tokens < victim.num_prompt_tokens
    elif phase == "decode":
        assert victim.num_output_tokens >= 2
    else:
        assert victim.status == RequestStatus.WAITING
    held = len(s.kv.block_tables.get("victim", []))
    assert (held > 0) == (phase != "waiting")
    free_before = s.kv.num_free_blocks

    assert s.abort_request("victim") is victim
    assert victim.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == free_before + held
    assert "victim" not in s.kv.block_tables and victim not in s.running and victim not in list(s.waiting)
    assert s.abort_request("victim") is None

    run(s, 200, runner)
    assert all(o.status == RequestStatus.FINISHED_LENGTH and o.num_output_tokens == o.max_tokens for o in others)
    assert_all_done(s, [*others, victim])


def test_abort_between_schedule_and_update(make_scheduler, make_request) -> None:
    s = make_scheduler()
    a, b = add_all(s, [make_request("a", max_tokens=5), make_request("b", max_tokens=5)])
    runner = FakeRunner()
    step(s, runner)
    plan = s.schedule()
    sampled = runner(plan)
    s.abort_request("a")
    s.update(plan, sampled)
    assert a.status == RequestStatus.FINISHED_ABORTED and a.num_output_tokens == 1  # the late token is dropped
    assert b.num_output_tokens == 2
    run(s, 20, runner)
    assert_all_done(s, [a, b])


def test_abort_unknown_request_is_a_no_op(make_scheduler) -> None:
    assert make_scheduler().abort_request("nope") is None


# --- stop conditions --------------------------------------------------------------------------------


def run_single(make_scheduler, request: Request, token: Callable[[Request], int], max_model_len: int = 4096) -> None:
    s = make_scheduler(max_model_len=max_model_len)
    s.add_request(request)
    run(s, 100, FakeRunner(token))
    assert_all_done(s, [request])


def emits_at(n_output: int, token: int) -> Callable[[Request], int]:
    """A runner that samples `token` as the `n_output`-th output token (1-based), filler otherwise."""
    return lambda r: token if r.num_output_tokens + 1 == n_output else fake_token(r.request_id, r.num_tokens)


def test_eos_stops(make_scheduler, make_request) -> None:
    r = make_request("r", max_tokens=10, eos=(EOS, 7), ignore_eos=False)
    run_single(make_scheduler, r, emits_at(3, 7))
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.num_output_tokens == 3 and r.output_token_ids[-1] == 7
    assert r.stop_reason is None


def test_eos_is_ignored_with_ignore_eos(make_scheduler, make_request) -> None:
    r = make_request("r", max_tokens=10, eos=(EOS,), ignore_eos=True)
    run_single(make_scheduler, r, lambda _: EOS)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [EOS] * 10


def test_stop_token_ids_stop_and_set_stop_reason(make_scheduler, make_request) -> None:
    r = make_request("r", max_tokens=10, stop_token_ids=(42,))
    run_single(make_scheduler, r, emits_at(4, 42))
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.num_output_tokens == 4 and r.stop_reason == 42


def test_stop_token_ids_apply_even_with_ignore_eos(make_scheduler, make_request) -> None:
    r = make_request("r", max_tokens=10, eos=(EOS,), stop_token_ids=(EOS,), ignore_eos=True)
    run_single(make_scheduler, r, emits_at(2, EOS))
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == EOS and r.num_output_tokens == 2


def test_max_tokens_finishes_with_length(make_scheduler, make_request) -> None:
    r = make_request("r", prompt=5, max_tokens=7)
    run_single(make_scheduler, r, lambda x: fake_token(x.request_id, x.num_tokens))
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 7 and r.stop_reason is None


def test_max_model_len_finishes_with_length(make_scheduler, make_request) -> None:
    r = make_request("r", prompt=10, max_tokens=100)
    run_single(make_scheduler, r, lambda x: fake_token(x.request_id, x.num_tokens), max_model_len=13)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_tokens == 13 and r.num_output_tokens == 3


@pytest.mark.parametrize("kind", ["eos", "stop_token_ids"])
def test_min_tokens_holds_back_stops(make_scheduler, make_request, kind) -> None:
    extra = {"stop_token_ids": (EOS,)} if kind == "stop_token_ids" else {"eos": (EOS,)}
    r = make_request("r", max_tokens=10, ignore_eos=False, min_tokens=4, **extra)
    run_single(make_scheduler, r, lambda _: EOS)  # a stop token every step
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.num_output_tokens == 4  # not before min_tokens outputs


# --- nothing is lost --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_request_ends_finished_under_churn(make_scheduler, make_request, seed) -> None:
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=40, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=120)
    runner = FakeRunner(lambda r: EOS if rng.random() < 0.05 else fake_token(r.request_id, r.num_tokens))
    shared = prompt_for("shared", 12)
    added: list[Request] = []
    log = Run([], [], runner)
    for i in range(60):
        prompt = rng.randint(1, 40)
        tokens = shared[: rng.choice([0, 4, 12])] + prompt_for(f"p{i}", prompt)
        r = make_request(f"r{i}", prompt=tokens, max_tokens=rng.randint(1, 30), priority=rng.randint(0, 2),
                         eos=(EOS,), ignore_eos=rng.random() < 0.5)
        s.add_request(r)
        added.append(r)
        for _ in range(rng.randint(0, 3)):
            step(s, runner, log)
        if rng.random() < 0.1 and s.requests:
            s.abort_request(rng.choice(sorted(s.requests)))
    final = run(s, 2000, runner)
    check_victims(log)
    check_victims(final)
    assert_all_done(s, added)
    assert s.num_preemptions > 0  # the pool was small enough to exercise preemption
    for r in added:
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert 1 <= r.num_output_tokens <= r.max_tokens and r.num_tokens <= 120
            if r.status == RequestStatus.FINISHED_LENGTH:
                assert r.num_output_tokens == r.max_tokens or r.num_tokens == 120
