"""The multi-level queue policy: lanes, FCFS within a lane, aging, normal's minimum share, background on
idle capacity, preemption choices; and its effect inside the real scheduler and engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from policies.multilevel import BACKGROUND, INTERACTIVE, NORMAL, MultiLevelConfig, MultiLevelPolicy
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams


@dataclass
class Status:
    finished: bool = False
    value: str = "waiting"


@dataclass(eq=False)
class Item:
    name: str
    priority: int
    arrival_time: float
    num_prompt_tokens: int = 10
    status: Status = field(default_factory=Status)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_policy():
    def make(**config: float) -> tuple[MultiLevelPolicy, Clock]:
        clock = Clock()
        return MultiLevelPolicy(MultiLevelConfig(**config), clock=clock), clock

    return make


def _drain(policy: MultiLevelPolicy) -> list[str]:
    order = []
    while policy.peek() is not None:
        order.append(policy.pop().name)
    return order


def test_lanes_in_order_and_fcfs_within_a_lane(make_policy):
    policy, _ = make_policy()
    for item in [Item("b1", BACKGROUND, 0), Item("n1", NORMAL, 1), Item("i1", INTERACTIVE, 2),
                 Item("n2", NORMAL, 3), Item("i2", INTERACTIVE, 4)]:
        policy.add(item)
    assert len(policy) == 5
    assert _drain(policy) == ["i1", "i2", "n1", "n2", "b1"]


def test_requeued_request_goes_to_the_front_of_its_lane(make_policy):
    policy, _ = make_policy()
    policy.add(Item("n1", NORMAL, 0))
    policy.requeue(Item("n0", NORMAL, 5))
    policy.add(Item("i1", INTERACTIVE, 6))
    assert _drain(policy) == ["i1", "n0", "n1"]


def test_aging_promotes_a_long_wait(make_policy):
    policy, clock = make_policy(aging_s=10.0)
    policy.add(Item("old-normal", NORMAL, 0.0))
    clock.now = 12.0  # waited 1.2 aging periods: now ranks ahead of a fresh interactive request
    policy.add(Item("fresh-interactive", INTERACTIVE, 12.0))
    assert policy.peek().name == "old-normal"
    clock.now = 5.0  # (had it waited only half a period, interactive would go first)
    assert policy.peek().name == "fresh-interactive"


def test_background_runs_only_on_idle_capacity_unless_aged(make_policy):
    policy, clock = make_policy(aging_s=10.0)
    policy.add(Item("bg", BACKGROUND, 0.0))
    policy.add(Item("n", NORMAL, 0.0))
    assert policy.peek().name == "n"
    clock.now = 25.0  # 2.5 periods: background now competes (and wins against a fresh normal head)
    policy.pop()
    policy.add(Item("n-fresh", NORMAL, 25.0))
    assert policy.peek().name == "bg"


def test_aged_background_never_goes_before_interactive(make_policy):
    """Aging lifts background to compete with normal work, never above an interactive arrival: an aged
    background head that finds every seat taken cannot displace anyone, and would block the queue."""
    policy, clock = make_policy(aging_s=10.0)
    policy.add(Item("bg", BACKGROUND, 0.0))
    clock.now = 100.0  # ten periods
    policy.add(Item("chat", INTERACTIVE, 100.0))
    policy.add(Item("n", NORMAL, 100.0))
    assert _drain(policy) == ["chat", "bg", "n"]


def test_normal_keeps_its_minimum_share(make_policy):
    policy, _ = make_policy(normal_min_share=0.25)
    interactive, normal = Item("i", INTERACTIVE, 0), Item("n", NORMAL, 0)
    policy.add(interactive)
    policy.add(normal)
    policy.on_scheduled(Item("x", INTERACTIVE, 0), 900)
    policy.on_scheduled(Item("y", NORMAL, 0), 100)  # normal had 10 % < 25 % of recent tokens
    assert policy.peek() is normal
    policy.on_scheduled(Item("y", NORMAL, 0), 400)  # now well above its share
    assert policy.peek() is interactive


def test_victims(make_policy):
    policy, _ = make_policy()
    running = [Item("i", INTERACTIVE, 0), Item("n-old", NORMAL, 1), Item("n-new", NORMAL, 2)]
    assert policy.pick_victim(running).name == "n-new"
    running.append(Item("bg", BACKGROUND, 0))
    assert policy.pick_victim(running).name == "bg"
    assert policy.urgent_victim(Item("arrival", INTERACTIVE, 9), running).name == "bg"
    assert policy.urgent_victim(Item("arrival", NORMAL, 9), running).name == "bg"  # background: idle capacity
    assert policy.urgent_victim(Item("arrival", NORMAL, 9), running[:3]) is None  # normal never displaces normal
    assert policy.urgent_victim(Item("arrival", BACKGROUND, 9), running) is None
    assert policy.urgent_victim(Item("arrival", INTERACTIVE, 9), [Item("i", INTERACTIVE, 0)]) is None
    assert policy.remove(running[0]) is False


def test_normal_work_is_displaced_only_well_above_its_share(make_policy):
    policy, _ = make_policy(normal_min_share=0.2)
    running, arrival = [Item("n", NORMAL, 0)], Item("chat", INTERACTIVE, 5)
    policy.on_scheduled(Item("x", INTERACTIVE, 0), 700)
    policy.on_scheduled(Item("y", NORMAL, 0), 300)  # 30 % < 2 x 20 %: spared
    assert policy.urgent_victim(arrival, running) is None
    policy.on_scheduled(Item("y", NORMAL, 0), 600)  # now well above: may be displaced
    assert policy.urgent_victim(arrival, running).name == "n"


def test_long_requests_run_at_most_max_long_running_at_once(make_policy):
    policy, _ = make_policy(long_prompt_tokens=1000, max_long_running=1)
    doc1, doc2 = Item("doc1", NORMAL, 0, 5000), Item("doc2", NORMAL, 1, 1000)
    chat = Item("chat", NORMAL, 2, 30)
    for item in (doc1, doc2, chat):
        policy.add(item)
    assert policy.pop() is doc1
    assert policy.peek() is chat  # doc2 is long and the long lane is full: the short one behind it goes
    assert policy.pop() is chat
    assert policy.peek() is None and len(policy) == 1
    doc1.status.finished = True  # the slot frees when the running long request ends ...
    assert policy.pop() is doc2
    policy.requeue(doc2)  # ... or when it is preempted
    assert policy.pop() is doc2


def test_long_lane_without_a_limit(make_policy):
    policy, _ = make_policy(long_prompt_tokens=100, max_long_running=None)
    for i in range(3):
        policy.add(Item(f"doc{i}", NORMAL, i, 500))
    assert _drain(policy) == ["doc0", "doc1", "doc2"]


@pytest.mark.parametrize("bad", [{"aging_s": 0}, {"normal_min_share": 1.0}, {"max_long_running": 0},
                                 {"long_prompt_tokens": 0}, {"urgent_step_max_share": 1.0},
                                 {"share_window_steps": 0}])
def test_config_is_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        MultiLevelConfig(**bad)


def _steps_to_first_token(engine: LLMEngine, request_id: str, max_steps: int = 5000) -> int:
    for step in range(1, max_steps + 1):
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                return step
    raise AssertionError(f"{request_id} got no token in {max_steps} steps")


@pytest.mark.parametrize("scheduling", ["fcfs", "multilevel"])
def test_interactive_arrival_under_background_saturation(tiny_loaded, scheduling):
    """Counted in engine steps, not seconds: with `multilevel` an interactive request starts at once by
    displacing background work; with `fcfs` it waits behind the whole background queue."""
    config = EngineConfig(kv_cache_bytes=1 << 20, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                          scheduling=scheduling)
    engine = LLMEngine(tiny_loaded(), config)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(12):
        engine.add_request(f"bg{i}", [5 + i, 6, 7, 8], long, priority=BACKGROUND)
    for _ in range(3):
        engine.step()
    engine.add_request("chat", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=4), priority=INTERACTIVE)
    waited = _steps_to_first_token(engine, "chat")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # nothing leaked, every request finished
    if scheduling == "multilevel":
        assert waited == 1 and engine.scheduler.num_preemptions >= 1
    else:
        assert waited > 40 and engine.scheduler.num_preemptions == 0


def test_an_interactive_arrival_is_not_stuck_behind_aged_background_work(tiny_loaded):
    """Every seat runs background work and more background has waited for ages (a saturating batch load):
    an interactive arrival still starts at the next step, displacing a running background request."""
    now = [0.0]
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                          scheduling="multilevel", multilevel={"aging_s": 1.0})
    engine = LLMEngine(tiny_loaded(), config, clock=lambda: now[0])
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"bg{i}", [5 + i, 6, 7, 8], long, priority=BACKGROUND)
    for _ in range(3):
        engine.step()
    now[0] = 50.0  # the four waiting background requests have waited 50 aging periods
    engine.add_request("chat", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=2), priority=INTERACTIVE)
    assert _steps_to_first_token(engine, "chat") == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("scheduling", ["fcfs", "multilevel"])
def test_interactive_arrival_during_background_prefills(tiny_loaded, scheduling):
    """Running background requests still in chunked prefill would take the whole token budget every step;
    with `multilevel` the interactive arrival goes first anyway (and takes a seat from one of them)."""
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                          scheduling=scheduling)
    engine = LLMEngine(tiny_loaded(), config)
    for i in range(2):
        engine.add_request(f"doc{i}", [5 + (i + j) % 200 for j in range(300)],
                           SamplingParams(temperature=0.0, max_tokens=5), priority=BACKGROUND)
    engine.step()  # both docs are now running, each with ~280 prompt tokens to go
    engine.add_request("chat", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=2), priority=INTERACTIVE)
    waited = _steps_to_first_token(engine, "chat")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert waited == 1 if scheduling == "multilevel" else waited > 15


def test_normal_keeps_its_minimum_share_under_an_interactive_flood(tiny_loaded):
    """Counted in scheduled tokens: a constant flood of interactive work would starve normal requests under
    strict priority; `normal_min_share` keeps them moving at (at least about) that share."""
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                          scheduling="multilevel", multilevel={"normal_min_share": 0.25, "share_window_tokens": 512})
    engine = LLMEngine(tiny_loaded(), config)
    lanes: dict[str, int] = {}
    tokens = {INTERACTIVE: 0, NORMAL: 0}
    for i in range(4):
        engine.add_request(f"n{i}", [7, 8, 9 + i], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
                           priority=NORMAL)
        lanes[f"n{i}"] = NORMAL
    for step in range(120):
        if len(engine.scheduler.waiting) < 8:  # keep interactive work always waiting
            engine.add_request(f"i{step}", [5, 6, step % 200 + 3], SamplingParams(temperature=0.0, max_tokens=8,
                                                                                  ignore_eos=True),
                               priority=INTERACTIVE)
            lanes[f"i{step}"] = INTERACTIVE
        for out in engine.step():
            tokens[lanes[out.request_id]] += len(out.new_token_ids)
    share = tokens[NORMAL] / (tokens[NORMAL] + tokens[INTERACTIVE])
    assert 0.2 <= share <= 0.5, tokens  # at least about its 25 % floor; interactive keeps the larger part
    assert engine.scheduler.num_preemptions <= 4  # no preempt/readmit churn (each one recomputes a prompt)


# --- urgent steps --------------------------------------------------------------------------------------------


def test_urgent_steps_are_for_interactive_first_arrivals_within_their_share(make_policy):
    policy, _ = make_policy(urgent_step_max_share=0.25, share_window_steps=8)
    chat, batch = Item("chat", INTERACTIVE, 0.0), Item("batch", NORMAL, 0.0)
    policy.add(batch)
    assert policy.urgent_head() is None  # a normal request is never due a step of its own
    policy.add(chat)
    assert policy.urgent_head() is chat
    urgent = []
    for _ in range(400):  # an interactive arrival at every step: at most a quarter of the steps are its own
        allowed = policy.urgent_head() is chat
        urgent.append(allowed)
        policy.on_step(allowed)
    assert 0.2 <= sum(urgent[-100:]) / 100 <= 0.25
    unshared, _ = make_policy(urgent_step_max_share=0.0)
    unshared.add(chat)
    assert unshared.urgent_head() is None


def test_an_interactive_arrival_is_due_its_own_step_while_a_promoted_normal_request_goes_first(make_policy):
    """A normal request that aged past interactive ones (or is owed its minimum share) is admitted first by ordinary
    steps, but an interactive arrival still gets its short step of its own at once, taken out of the queue by itself:
    without that it waited for a whole ordinary step (~300 ms on SmolLM2 under load) behind the normal one."""
    policy, clock = make_policy(aging_s=1.0)
    waited = Item("waited", NORMAL, 0.0)
    policy.add(waited)
    clock.now = 2.5  # two lanes' worth of aging: it now ranks ahead of a fresh interactive arrival
    chat = Item("chat", INTERACTIVE, 2.5)
    policy.add(chat)
    assert policy.peek() is waited and policy.urgent_head() is chat
    assert policy.pop(chat) is chat and policy.peek() is waited and policy.urgent_head() is None


def recorded_plans(engine: LLMEngine) -> list[list[str]]:
    """From now on, the request ids of each step the engine's scheduler plans, in order (sorted within a step)."""
    plans: list[list[str]] = []
    schedule = engine.scheduler.schedule

    def recording():  # type: ignore[no-untyped-def]
        plan = schedule()
        plans.append(sorted(item.request.request_id for item in plan.scheduled))
        return plan

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return plans


def test_an_urgent_arrival_gets_a_step_of_its_own(tiny_loaded):
    """Counted in engine steps: under a batch of decodes, an interactive arrival's prefill runs alone (the decodes
    skip that step) and its first token comes out of it; the decodes go on at the next step, and every request's
    output is the same as without urgent steps."""

    def run(urgent_share: float) -> tuple[dict[str, list[int]], list[list[str]], int]:
        config = EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                              scheduling="multilevel", multilevel={"urgent_step_max_share": urgent_share})
        engine = LLMEngine(tiny_loaded(), config)
        plans = recorded_plans(engine)
        long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        for i in range(6):
            engine.add_request(f"bg{i}", [5 + i, 6, 7, 8], long, priority=NORMAL)
        tokens: dict[str, list[int]] = {}
        first_token_step = -1
        for step in range(100):
            if step == 4:
                engine.add_request("chat", [9, 10, 11, 12, 13], SamplingParams(temperature=0.0, max_tokens=3),
                                   priority=INTERACTIVE)
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.request_id == "chat" and first_token_step < 0:
                    first_token_step = step
            if not engine.has_unfinished_requests():
                break
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        return tokens, plans, first_token_step

    background = sorted(f"bg{i}" for i in range(6))
    tokens, plans, first = run(0.5)
    assert first == 4 and plans[4] == ["chat"]  # its own step, right away
    assert plans[5] == sorted([*background, "chat"])  # then everyone decodes together again
    baseline, plans_without, first_without = run(0.0)
    assert first_without == 4 and plans_without[4] == sorted([*background, "chat"])  # inside the decode batch
    assert tokens == baseline  # the same outputs: only the order of steps changed


def test_an_interactive_arrival_gets_its_own_step_while_a_normal_request_owed_its_share_waits_first(tiny_loaded):
    """Normal work owed its minimum share is at the head of the queue (`peek`) when an interactive request arrives:
    the arrival still gets a step of its own at once, and the normal request the next ordinary step. (Before, the
    urgent step was asked of the head only, so the arrival waited behind the normal request's long prompt chunk.)"""
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                          scheduling="multilevel", multilevel={"normal_min_share": 0.9})
    engine = LLMEngine(tiny_loaded(), config)
    plans = recorded_plans(engine)
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"bg{i}", [5 + i, 6, 7, 8], long, priority=BACKGROUND)
    for _ in range(3):
        engine.step()
    engine.add_request("doc", [3 + i % 50 for i in range(60)], long, priority=NORMAL)  # one chunk takes the budget
    engine.add_request("chat", [9, 10, 11, 12, 13], SamplingParams(temperature=0.0, max_tokens=3),
                       priority=INTERACTIVE)
    assert engine.scheduler.waiting.peek().request_id == "doc"  # normal is owed its share: ordinary admission's
    first = next(i for i in range(10) if any(out.request_id == "chat" for out in engine.step()))
    assert first == 0 and plans[3] == ["chat"]  # the arrival's own step came first
    engine.step()
    assert "doc" in plans[4]  # and the normal request went in the next ordinary one
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_an_urgent_step_that_cannot_fit_admits_nothing_in_the_step_that_displaced():
    """The urgent pass displaces background work for KV room and still cannot fit the arrival (normal work holds
    the rest): the step is an ordinary one that admits nobody (no preempt-and-admit in one step), and the displaced
    request is reported as preempted."""
    from runtimes.llm.kv_cache_manager import KVCacheManager
    from runtimes.llm.request import Request, RequestStatus
    from runtimes.llm.scheduler import Scheduler

    scheduler = Scheduler(KVCacheManager(10, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                          policy=MultiLevelPolicy(MultiLevelConfig()))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def request(name: str, length: int, lane: int, at: float) -> Request:
        return Request(name, list(range(5, 5 + length)), params, 8, at, priority=lane, cache_namespace=None)

    normal = request("normal", 27, NORMAL, 0.0)  # 7 blocks
    background = request("bg", 7, BACKGROUND, 1.0)  # 2 blocks
    for r in (normal, background):
        scheduler.add_request(r)
    plan = scheduler.schedule()
    scheduler.update(plan, {r.request.request_id: [9] for r in plan.scheduled})
    assert {r.request_id for r in scheduler.running} == {"normal", "bg"}
    chat = request("chat", 15, INTERACTIVE, 2.0)  # needs 4 blocks: 1 free + 2 from bg is not enough
    scheduler.add_request(chat)
    plan = scheduler.schedule()
    assert [r.request_id for r in plan.preempted] == ["bg"] and background.status == RequestStatus.PREEMPTED
    assert [item.request.request_id for item in plan.scheduled] == ["normal"]  # its decode; nobody admitted
    assert chat.status == RequestStatus.WAITING


@pytest.mark.parametrize("max_num_seqs", [2, 3])
def test_an_urgent_step_does_not_take_the_last_seat_from_normal_work_owed_its_share(max_num_seqs):
    """With one seat left, the interactive arrival's step of its own would take it from the normal request that
    ordinary admission owes it to (below its minimum share), every time a seat frees: so the step is an ordinary one,
    and the normal request gets the seat. With a seat for each, the arrival's own step comes first as usual."""
    from runtimes.llm.kv_cache_manager import KVCacheManager
    from runtimes.llm.request import Request
    from runtimes.llm.scheduler import Scheduler

    scheduler = Scheduler(KVCacheManager(32, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                          max_model_len=256, policy=MultiLevelPolicy(MultiLevelConfig(normal_min_share=0.5)))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def request(name: str, lane: int, at: float) -> Request:
        return Request(name, [5, 6, 7], params, 8, at, priority=lane, cache_namespace=None)

    scheduler.add_request(request("chat0", INTERACTIVE, 0.0))
    plan = scheduler.schedule()
    scheduler.update(plan, {"chat0": [9]})  # normal's share of scheduled tokens is 0 now
    scheduler.add_request(request("doc", NORMAL, 1.0))
    scheduler.add_request(request("chat1", INTERACTIVE, 2.0))
    plan = scheduler.schedule()
    admitted = [item.request.request_id for item in plan.scheduled if item.request.request_id != "chat0"]
    if max_num_seqs == 2:
        assert not plan.urgent and admitted == ["doc"]
    else:
        assert plan.urgent and admitted == ["chat1"]


def test_other_lanes_take_short_prompt_chunks_while_interactive_traffic_is_about(make_policy):
    policy, clock = make_policy(busy_chunk_tokens=32, busy_window_s=10.0)
    batch, chat = Item("batch", BACKGROUND, 0.0), Item("chat", INTERACTIVE, 1.0)
    assert policy.chunk_cap(batch) is None  # no interactive traffic yet
    clock.now = 1.0
    policy.add(chat)
    assert policy.chunk_cap(batch) == 32 and policy.chunk_cap(chat) is None
    clock.now = 11.5
    assert policy.chunk_cap(batch) is None  # it has been quiet for longer than the window
    assert make_policy(busy_chunk_tokens=None)[0].chunk_cap(batch) is None


def test_the_scheduler_applies_the_chunk_cap_to_prompts_not_decodes():
    from runtimes.llm.kv_cache_manager import KVCacheManager
    from runtimes.llm.request import Request
    from runtimes.llm.scheduler import Scheduler

    clock = Clock()
    scheduler = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                          policy=MultiLevelPolicy(MultiLevelConfig(busy_chunk_tokens=16), clock=clock))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    short = Request("short", [5, 6, 7], params, 4, 0.0, priority=BACKGROUND)
    scheduler.add_request(short)
    plan = scheduler.schedule()
    scheduler.update(plan, {"short": [9]})
    doc = Request("doc", list(range(5, 105)), params, 4, 1.0, priority=BACKGROUND)
    chat = Request("chat", [5, 6], params, 4, 2.0, priority=INTERACTIVE)
    scheduler.add_request(doc)
    scheduler.add_request(chat)  # interactive traffic: from now on other lanes' prompt chunks are capped
    plan = scheduler.schedule()
    assert {i.request.request_id: i.num_new_tokens for i in plan.scheduled} == {"chat": 2}  # its own step
    scheduler.update(plan, {"chat": [9]})
    plan = scheduler.schedule()
    sizes = {i.request.request_id: i.num_new_tokens for i in plan.scheduled}
    assert sizes == {"short": 1, "chat": 1, "doc": 16}  # decodes whole, the document's chunk capped at 16


def test_only_interactive_arrivals_within_the_urgent_share_stop_a_step(make_policy):
    policy, _ = make_policy(urgent_step_max_share=0.25, share_window_steps=8)
    assert policy.yields_to(INTERACTIVE) and not policy.yields_to(NORMAL) and not policy.yields_to(BACKGROUND)
    assert policy.yields_to(-5)  # more urgent than interactive is clamped to it
    for _ in range(8):  # the share is used up: no more urgent steps, so no step is stopped for one either
        policy.on_step(True)
    policy.add(Item("chat", INTERACTIVE, 0.0))
    assert not policy.yields_to(INTERACTIVE) and policy.urgent_head() is None
    assert not make_policy(urgent_step_max_share=0.0)[0].yields_to(INTERACTIVE)


def _interrupt_engine(tiny_loaded) -> LLMEngine:
    """Prefix caching on, small blocks and steps: a long prompt's prefill takes several chunks."""
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                          scheduling="multilevel", enable_prefix_caching=True)
    return LLMEngine(tiny_loaded(), config)


def _solo(tiny_loaded, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = _interrupt_engine(tiny_loaded)
    engine.add_request("solo", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_an_interactive_arrival_stops_the_step_in_flight_between_layers(tiny_loaded):
    """The arrival is announced (`request_yield`) while a background prompt's chunk runs: the step stops after the
    layer it is in, nothing of it is applied yet (no progress, no token, no block in the prefix cache), the arrival
    gets the next step to itself, then the stopped step is finished from the layer where it stopped, and every
    output is the undisturbed one. An arrival that shares the background prompt's prefix only reuses blocks of
    completed steps (a half-written block would give it wrong KV)."""
    shared = list(range(20, 40))
    background_prompt = [*shared, *range(40, 60)]  # 40 tokens: three chunks of 16
    chat_prompt = [*shared, 7, 8, 9]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = _interrupt_engine(tiny_loaded)
    engine.add_request("bg", background_prompt, greedy, priority=BACKGROUND)
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    step()  # the first chunk: 16 tokens computed, blocks 0-3 in the prefix cache
    request = engine.scheduler.requests["bg"]
    assert request.num_computed_tokens == 16 and engine.kv.pool.num_cached_blocks == 4
    layers = engine.runner.model.layers
    seen: list[int] = []
    announced: list[bool] = []
    for i, layer in enumerate(layers):
        def forward(*args, _i=i, _f=layer.forward):  # type: ignore[no-untyped-def]
            seen.append(_i)
            if not announced:  # the arrival comes while the first layer runs
                announced.append(True)
                engine.request_yield(INTERACTIVE)
            return _f(*args)
        layer.forward = forward  # type: ignore[method-assign]
    step()
    assert seen == [0] and engine.num_interrupted_steps == 1  # stopped after layer 0
    assert request.num_computed_tokens == 16 and engine.kv.pool.num_cached_blocks == 4 and "bg" not in tokens
    engine.clear_yield()  # what the async engine does when it takes the arrival in
    engine.add_request("chat", chat_prompt, greedy, priority=INTERACTIVE)
    plan = engine.scheduler.schedule_urgent
    plans = []

    def recording():  # type: ignore[no-untyped-def]
        out = plan()
        plans.append((out.urgent, [item.request.request_id for item in out.scheduled]))
        return out

    engine.scheduler.schedule_urgent = recording  # type: ignore[method-assign]
    step()
    assert plans == [(True, ["chat"])] and "chat" in tokens  # its own step, its first token
    chat = engine.scheduler.requests.get("chat")
    assert chat is None or chat.num_cached_tokens == 16  # hits: the first chunk's blocks only
    all_layers = list(range(len(layers)))
    del seen[:]
    step()  # the stopped step, finished from layer 1
    assert seen == all_layers[1:] and request.num_computed_tokens == 32
    while engine.has_unfinished_requests():
        step()
    assert engine.num_interrupted_steps == 1 and engine.num_dropped_steps == 0  # a yield is taken once
    assert tokens["bg"] == _solo(tiny_loaded, background_prompt, greedy)
    assert tokens["chat"] == _solo(tiny_loaded, chat_prompt, greedy)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and all(c == 0 for c in engine.kv.pool.ref_cnt)


def _stopped(engine: LLMEngine) -> None:
    """Step once with an interactive arrival announced: the step in flight stops (and is kept to finish)."""
    engine.request_yield(INTERACTIVE)
    assert engine.step() == []
    engine.clear_yield()


def test_a_stopped_step_whose_request_was_aborted_meanwhile_is_dropped_and_redone(tiny_loaded):
    """Between the stop and the finish a request of the stopped step is aborted: its blocks are freed (and may go
    to the arrival), so the step is not finished; the others compute those tokens again, with the same outputs."""
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine = _interrupt_engine(tiny_loaded)
    prompts = {"bg1": list(range(5, 13)), "bg2": list(range(20, 28))}
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, greedy, priority=BACKGROUND)
    _stopped(engine)
    assert engine.num_interrupted_steps == 1
    engine.abort_request("bg1")
    engine.add_request("chat", [60, 61, 62], greedy, priority=INTERACTIVE)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.num_dropped_steps == 1 and "bg1" not in tokens
    assert tokens["bg2"] == _solo(tiny_loaded, prompts["bg2"], greedy)
    assert tokens["chat"] == _solo(tiny_loaded, [60, 61, 62], greedy)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and all(c == 0 for c in engine.kv.pool.ref_cnt)


def test_an_arrival_without_a_seat_displaces_background_work_out_of_the_stopped_step(tiny_loaded):
    """No seat for the arrival (max_num_seqs): its step displaces a background request, as it would without a
    stopped step; that request's rows are taken out of the stopped step, which the other one then finishes (not
    redone), and every output is the undisturbed one."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                          scheduling="multilevel")
    engine = LLMEngine(tiny_loaded(), config)
    prompts = {"bg1": list(range(5, 13)), "bg2": list(range(20, 28)), "chat": [60, 61, 62]}
    for name in ("bg1", "bg2"):
        engine.add_request(name, prompts[name], greedy, priority=BACKGROUND)  # both in the first step
    _stopped(engine)
    assert len(engine.scheduler.running) == 2
    engine.add_request("chat", prompts["chat"], greedy, priority=INTERACTIVE)
    tokens: dict[str, list[int]] = {}

    def step() -> list[str]:
        outs = engine.step()
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [out.request_id for out in outs]

    assert step() == ["chat"] and engine.scheduler.num_preemptions == 1  # its own step, a seat taken from bg2
    assert step() == ["bg1"]  # the stopped step, finished without bg2
    while engine.has_unfinished_requests():
        step()
    assert engine.num_interrupted_steps == 1 and engine.num_dropped_steps == 0
    for name, prompt in prompts.items():
        assert tokens[name] == _solo(tiny_loaded, prompt, greedy), name
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and all(c == 0 for c in engine.kv.pool.ref_cnt)


def test_a_step_with_interactive_work_is_not_stopped_and_fcfs_never_yields(tiny_loaded):
    """Neither an urgent step nor an ordinary one that runs an interactive prompt's chunk stops for the next
    interactive arrival: under a flood, the step that starts the first of them would never finish."""
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine = _interrupt_engine(tiny_loaded)
    engine.add_request("bg", list(range(5, 45)), greedy, priority=BACKGROUND)
    engine.step()
    engine.add_request("chat", list(range(50, 60)), greedy, priority=INTERACTIVE)
    engine.request_yield(INTERACTIVE)  # another arrival announced: the urgent step for "chat" still runs
    outputs = engine.step()
    assert engine.num_interrupted_steps == 0 and [out.request_id for out in outputs] == ["chat"]
    engine.clear_yield()
    engine.add_request("long-chat", list(range(60, 100)), greedy, priority=INTERACTIVE)
    engine.request_yield(INTERACTIVE)  # announced while the step that admits "long-chat" is about to run
    engine.step()  # an ordinary step (the urgent share is used up): chat's decode and long-chat's first chunk
    assert engine.num_interrupted_steps == 0 and engine.scheduler.requests["long-chat"].num_computed_tokens > 0
    fcfs = LLMEngine(tiny_loaded(), EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_batched_tokens=16))
    fcfs.add_request("a", list(range(5, 45)), greedy)
    fcfs.request_yield(INTERACTIVE)
    fcfs.step()
    assert fcfs.num_interrupted_steps == 0 and fcfs.scheduler.requests["a"].num_computed_tokens == 16


def test_a_step_with_an_interactive_decode_and_a_background_chunk_is_stopped(tiny_loaded):
    """An interactive request that is decoding loses one step; the arrival does not wait behind the chunk."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = _interrupt_engine(tiny_loaded)
    engine.add_request("chat", [50, 51, 52], greedy, priority=INTERACTIVE)
    engine.step()  # chat's prompt and first token
    engine.add_request("bg", list(range(5, 45)), greedy, priority=BACKGROUND)
    engine.request_yield(INTERACTIVE)
    assert engine.step() == [] and engine.num_interrupted_steps == 1  # chat's decode and bg's first chunk: stopped
    tokens: dict[str, list[int]] = {"chat": [], "bg": []}
    engine.clear_yield()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert len(tokens["chat"]) == 7 and tokens["bg"] == _solo(tiny_loaded, list(range(5, 45)), greedy)


def test_a_stopped_step_that_fails_when_finished_is_run_again_from_its_plan(tiny_loaded, monkeypatch):
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = _interrupt_engine(tiny_loaded)
    engine.add_request("bg", list(range(5, 25)), greedy, priority=BACKGROUND)
    _stopped(engine)

    def broken(step, interrupt=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected fault while finishing")

    monkeypatch.setattr(engine.runner, "resume", broken)
    assert engine.step() == [] and engine.num_dropped_steps == 1
    assert engine.scheduler.requests["bg"].num_computed_tokens == 0  # nothing applied
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == _solo(tiny_loaded, list(range(5, 25)), greedy)


def test_an_arrival_that_cannot_have_a_step_of_its_own_joins_the_ordinary_plan_at_once(tiny_loaded):
    """Its own step cannot seat it (only normal work runs, which such a step never displaces): rather than wait for
    the stopped step to finish, the stopped step is dropped and the ordinary plan (which may displace normal work)
    takes the arrival now, as it would have without the stop."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                          scheduling="multilevel")
    engine = LLMEngine(tiny_loaded(), config)
    for name, prompt in (("n1", list(range(5, 13))), ("n2", list(range(20, 28)))):
        engine.add_request(name, prompt, greedy, priority=NORMAL)
    _stopped(engine)
    engine.add_request("chat", [60, 61, 62], greedy, priority=INTERACTIVE)
    outputs = engine.step()
    assert engine.num_dropped_steps == 1 and "chat" in [out.request_id for out in outputs]
