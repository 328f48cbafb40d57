"""The simulator: the cost model against hand-computed numbers, the engine's batching, and properties of whole runs
(requests conserved, deterministic, more share serves every request no later when all arrive at once and never
more than a few fewer within the SLO otherwise, time-slice weights respected)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from partitioner.planning.demand import ModelShape
from partitioner.planning.placement import PlanOptions
from partitioner.planning.planner import plan
from partitioner.simulate.candidates import candidate_plans
from partitioner.simulate.cost import DeviceSpeed, Share, StepWork, calibration_factor, step_seconds
from partitioner.simulate.engine import EngineLimits, ReplicaEngine, SimRequest
from partitioner.simulate.pools import plan_pools
from partitioner.simulate.simulator import Member, ModelResult, Pool, SimModel, simulate
from partitioner.simulate.traffic import Arrival, ModelTraffic, Traffic
from partitioner.simulate.workload import LengthDist, Slo
from registry.fields import GIB
from tests.partitioner.conftest import demand, gpus

TINY = ModelShape(num_layers=2, num_kv_heads=1, head_dim=4, weights_bytes=1000, kv_dtype_bytes=2)  # 32 B/token
SLOW = DeviceSpeed("slow", memory_bandwidth_bytes_per_s=100.0, flops_per_s=1000.0)
# a 1 GB model on a device of 1 TB/s and 100 TFLOP/s: decode steps of ~1 ms, prefill compute-bound past ~100 tokens
SHAPE = ModelShape(num_layers=16, num_kv_heads=4, head_dim=64, weights_bytes=10**9, kv_dtype_bytes=2)
GPU = DeviceSpeed("gpu", memory_bandwidth_bytes_per_s=1e12, flops_per_s=1e14)
KV = 64 * 10**6  # bytes: 1953 tokens of SHAPE


def test_step_time_is_the_slower_of_memory_and_compute_on_the_share():
    # bytes = 1000 + (10 + 3) × 32 = 1416 at 100 × 0.25 B/s = 56.64 s; flops = 2 × 500 × 3 = 3000 at 500/s = 6 s
    memory_bound = StepWork(computed_tokens=3, attended_tokens=10)
    assert step_seconds(TINY, memory_bound, Share(0.5, 0.25), SLOW) == pytest.approx(56.64)
    assert step_seconds(TINY, memory_bound, Share(0.5, 0.25), SLOW, calibration=2.0) == pytest.approx(113.28)
    # bytes = 1000 + 100 × 32 = 4200 at 100 B/s = 42 s; flops = 2 × 500 × 100 = 1e5 at 500/s = 200 s
    compute_bound = StepWork(computed_tokens=100, attended_tokens=0)
    assert step_seconds(TINY, compute_bound, Share(0.5, 1.0), SLOW) == pytest.approx(200.0)
    assert calibration_factor(400.0, TINY, compute_bound, Share(0.5, 1.0), SLOW) == pytest.approx(2.0)


def test_shares_and_speeds_out_of_range_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"Share.sm_fraction must be in \(0, 1\], got 1.5"):
        Share(1.5, 1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        DeviceSpeed("x", 0.0, 1.0)
    with pytest.raises(ValueError, match="measured step time must be > 0 s"):
        calibration_factor(0.0, TINY, StepWork(1, 1), Share(1, 1), SLOW)


def test_engine_batches_decodes_first_then_chunks_then_admits_within_budget_seats_and_kv():
    engine = ReplicaEngine("m/0", "m", EngineLimits(max_num_seqs=2, max_num_batched_tokens=8, block_size=4),
                           kv_capacity_tokens=40)
    a, b, c = (SimRequest("m", 0.0, prompt_tokens=10, output_tokens=3) for _ in range(3))
    for r in (a, b, c):
        engine.add(r)
    step = engine.plan_step()
    assert [(r, n) for r, n in step] == [(a, 8)]  # the budget ends a's prompt mid-way
    engine.finish_step(step, 1.0)
    step = engine.plan_step()
    assert [(r, n) for r, n in step] == [(a, 2), (b, 6)]  # a's last chunk, then b admitted; c: no seat left
    engine.finish_step(step, 2.0)
    assert a.first_token_s == 2.0 and a.generated == 1 and b.first_token_s is None
    step = engine.plan_step()
    assert [(r, n) for r, n in step] == [(a, 1), (b, 4)]  # a's decode first
    assert engine.work(step) == StepWork(computed_tokens=5, attended_tokens=10 + 6)
    assert engine.kv_reserved_tokens == 32  # 13 tokens each, in blocks of 4 → 16 each


def test_engine_rejects_what_could_never_fit_and_holds_the_line_for_a_head_that_does_not_fit_yet():
    engine = ReplicaEngine("m/0", "m", EngineLimits(max_num_batched_tokens=100, max_model_len=50, block_size=1),
                           kv_capacity_tokens=30)
    too_long, too_big = SimRequest("m", 0.0, 45, 10), SimRequest("m", 0.0, 20, 20)
    engine.add(too_long)
    engine.add(too_big)
    assert engine.rejected == [too_long, too_big] and not engine.has_work()
    first, second, small = SimRequest("m", 0.0, 10, 10), SimRequest("m", 0.0, 10, 10), SimRequest("m", 0.0, 1, 1)
    for r in (first, second, small):
        engine.add(r)
    assert [r for r, _ in engine.plan_step()] == [first]  # second needs 20 of the 10 left; small waits behind it


def _alone(share: Share, kv_bytes: int = KV, model: str = "m") -> Pool:
    return Pool(f"{model}-pool", "alone", share, GPU, (Member(f"{model}/0", model, kv_bytes),))


def _traffic(rate: float, prompt: int, output: int, duration_s: float = 3.0, seed: int = 0,
             models: tuple[str, ...] = ("m",)) -> Traffic:
    spec = ModelTraffic(rate_per_s=rate, prompt_tokens=LengthDist("uniform", low=1, high=prompt),
                        output_tokens=LengthDist("uniform", low=1, high=output), slo=Slo.from_ms(50, 2.0))
    return Traffic(duration_s, dict.fromkeys(models, spec), seed)


def _conserved(r: ModelResult) -> bool:
    return r.arrived == r.finished + r.in_flight + r.rejected


@settings(max_examples=25, deadline=None)
@given(rate=st.floats(1, 400), prompt=st.integers(1, 3000), output=st.integers(1, 300),
       kv_tokens=st.integers(64, 4000), drain_s=st.floats(0, 2), sharing=st.sampled_from(["mps", "timeslice"]))
def test_every_request_that_arrives_is_finished_in_flight_or_rejected(rate, prompt, output, kv_tokens, drain_s,
                                                                      sharing):
    kv = kv_tokens * SHAPE.kv_bytes_per_token
    pools = [Pool("p", sharing, Share(0.5, 0.5), GPU, (Member("a/0", "a", kv, 0.6, 3.0), Member("b/0", "b", kv, 0.4))),
             _alone(Share(0.25, 0.25), kv, "c")]
    models = dict.fromkeys("abc", SimModel(SHAPE, EngineLimits(max_num_seqs=16, max_num_batched_tokens=256)))
    results = simulate(pools, models, _traffic(rate, prompt, output, 2.0, models=("a", "b", "c")), drain_s)
    assert all(_conserved(r) for r in results.values()), results
    assert sum(r.arrived for r in results.values()) > 0


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    models = {"m": SimModel(SHAPE)}
    runs = [simulate([_alone(Share(0.5, 0.5))], models, _traffic(100, 500, 50, seed=s)) for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0]["m"].arrived != runs[2]["m"].arrived or runs[0]["m"].ttft_ms != runs[2]["m"].ttft_ms


fractions = st.floats(0.05, 1.0)


@settings(max_examples=25, deadline=None)
@given(sm=fractions, bw=fractions, more_sm=fractions, more_bw=fractions,
       lengths=st.lists(st.tuples(st.integers(1, 2000), st.integers(1, 200)), min_size=1, max_size=150),
       duration_s=st.floats(0.005, 2.0), ttft_ms=st.floats(1, 2000), tpot_ms=st.floats(1, 4))
def test_a_larger_share_serves_every_request_no_later_when_all_arrive_at_once(sm, bw, more_sm, more_bw, lengths,
                                                                              duration_s, ttft_ms, tpot_ms):
    """With every request there from the start, the engine plans the same steps whatever its share (its batches
    depend on what is queued, never on when), and a larger share makes each of them no longer: every first token and
    every last one comes no later, so each request's TTFT and TPOT are no worse. Exactly monotone, then; arrivals
    spread over time are what break it (the next two tests)."""
    small, large = Share(sm, bw), Share(max(sm, more_sm), max(bw, more_bw))
    spec = ModelTraffic(trace=tuple(Arrival(0.0, p, o) for p, o in lengths), slo=Slo.from_ms(ttft_ms, tpot_ms))
    traffic = Traffic(duration_s, {"m": spec})
    low, high = (simulate([_alone(s)], {"m": SimModel(SHAPE)}, traffic, drain_s=0.0)["m"] for s in (small, large))
    assert high.finished >= low.finished
    assert high.good >= low.good
    assert high.generated_tokens >= low.generated_tokens


def test_an_earlier_first_token_can_fail_the_tpot_objective():
    """Why goodput is not monotone in speed, for a real continuous-batching engine as for this one: TPOT is measured
    from the first token, so a faster step that brings a first token forward, ahead of a neighbour's prefill instead
    of together with it, moves that prefill out of the request's TTFT into its TPOT. Request a (569 + 4 tokens) at 0
    and b (438 + 1) at 6 ms. At 80 % of the SMs a's first 512-token chunk ends at 6.4 ms, after b came: a's last 57
    prompt tokens share a step with b's prompt (a's first token at 12.6 ms), then 3 decodes of 1 ms. At 90 % the
    chunk ends at 5.7 ms, before b came: a's first token at 6.7 ms, then b's prompt (4.9 ms) rides with a's first
    decode, and a's TPOT is 2.3 ms. Both requests get every token sooner, a finishes 2 ms sooner, and it misses the
    2 ms TPOT objective."""
    spec = ModelTraffic(trace=(Arrival(0.0, 569, 4), Arrival(0.006, 438, 1)), slo=Slo.from_ms(50, 2.0))
    traffic = Traffic(1.0, {"m": spec})
    slow, fast = (simulate([_alone(Share(sm, 1.0))], {"m": SimModel(SHAPE)}, traffic, drain_s=0.0)["m"]
                  for sm in (0.8, 0.9))
    assert (slow.finished, fast.finished) == (2, 2)
    assert fast.ttft_ms["p50"] < slow.ttft_ms["p50"] and fast.ttft_ms["p99"] < slow.ttft_ms["p99"]
    assert slow.tpot_ms["p50"] == pytest.approx(1.01, abs=0.01) and fast.tpot_ms["p50"] == pytest.approx(2.3, abs=0.01)
    assert (slow.good, fast.good) == (2, 1)


def _at_the_edge(arrived: int, per_arrival: float) -> float:
    """How many requests fewer a larger share or weight may finish, or serve within the SLO, than a smaller one:
    two, plus a fraction of the arrivals (the tests below say why, and how the bound was measured)."""
    return 2 + per_arrival * arrived


# Hypothesis found these: a larger bandwidth share served 11 requests within the SLO instead of 12 (the faster engine
# finished two requests sooner, so the KV cache they held let a waiting 581-token prompt in while a running request
# had 3 decodes to go, and those rode with its 8 ms prefill chunks: TPOT 2.22 ms instead of 1.87), and 90 MPS threads
# instead of 83 served 81 instead of 82 (test_an_earlier_first_token_can_fail_the_tpot_objective's case, in a run).
@example(sm=0.625, bw=0.8125, more_sm=0.5, more_bw=0.875, rate=92.5, prompt=879, output=123)
@settings(max_examples=25, deadline=None)
@given(sm=fractions, bw=fractions, more_sm=fractions, more_bw=fractions, rate=st.floats(5, 300),
       prompt=st.integers(1, 2000), output=st.integers(1, 200))
def test_a_larger_share_never_serves_more_than_a_few_fewer_requests_or_fewer_within_the_slo(sm, bw, more_sm, more_bw,
                                                                                           rate, prompt, output):
    small, large = Share(sm, bw), Share(max(sm, more_sm), max(bw, more_bw))
    models, traffic = {"m": SimModel(SHAPE)}, _traffic(rate, prompt, output)
    low, high = (simulate([_alone(s)], models, traffic, drain_s=0.0)["m"] for s in (small, large))
    # With arrivals spread over time a faster engine's steps end at other moments, so a request can be admitted a
    # step sooner or later, ride with prefill chunks it missed before (or miss ones it rode with), or get its first
    # token ahead of a neighbour's prefill and take that prefill into its TPOT (the test above). A real engine batches
    # the same way. Near the SLO's edge each such shift flips a request either way, and at the run's end one more
    # can be left in flight (with a per-step cost dominated by reading the weights, the faster engine's smaller
    # early batches can finish fewer by the horizon). Gains outnumber losses by far: of 23,000 random cases (fresh
    # seeds, increments down to 0.1 %) 1 in 300 lost any and 3 in 10 gained, and the worst losses were 4 of 487
    # arrivals within the SLO and 3 of 696 finished, 0.4 % of the arrivals past two: the bound allows twice that.
    slack = _at_the_edge(low.arrived, 0.01)
    assert high.finished >= low.finished - slack
    assert high.good >= low.good - slack


@example(weight=1.0, more=0.0, percent=83, extra=7, rate=21.0, output=44)  # mps: 81 within the SLO instead of 82
@example(weight=9.862956543217779, more=1.8197607416075856, percent=32, extra=7, rate=93.19300561837433,
         output=9)  # timeslice: 171 instead of 178 (the comment below)
@settings(max_examples=20, deadline=None)
@given(weight=st.floats(0.1, 10), more=st.floats(0, 10), percent=st.integers(1, 90), extra=st.integers(0, 9),
       rate=st.floats(20, 300), output=st.integers(1, 200))
def test_more_weight_or_more_mps_threads_never_serve_a_model_more_than_a_few_requests_worse(weight, more, percent,
                                                                                           extra, rate, output):
    models = dict.fromkeys("ab", SimModel(SHAPE))
    traffic = _traffic(rate, 1000, output, models=("a", "b"))

    def served(sharing: str, mine: Member) -> ModelResult:
        pool = Pool("p", sharing, Share(1.0, 1.0), GPU, (mine, Member("b/0", "b", KV, 0.1, 1.0)))
        return simulate([pool], models, traffic, drain_s=0.0)["a"]

    for sharing, low, high in (("timeslice", Member("a/0", "a", KV, 1.0, weight), Member("a/0", "a", KV, 1.0,
                                                                                          weight + more)),
                               ("mps", Member("a/0", "a", KV, percent / 100), Member("a/0", "a", KV,
                                                                                     (percent + extra) / 100))):
        worse, better = served(sharing, low), served(sharing, high)
        # More MPS threads make a's steps faster: the previous test's shifts, and its bound (of 15,500 random cases
        # 1 in 100 lost any, the worst 2 of 45 arrivals within the SLO). A larger time-slice weight also reorders
        # the leases, so a step of b (several ms) falls inside the decodes of other requests of a, often several
        # short ones at once, or no longer does (weight 9.9 -> 11.7 at 93 req/s: 13 requests lost their TPOT and 6
        # gained it, 171 of 304 within the SLO instead of 178). Of 13,000 random cases 1 in 50 lost any, 3 in 4
        # gained; the worst were that 7 of 304 and 5 of 121, 2.5 % of the arrivals past two: twice that is allowed.
        slack = _at_the_edge(worse.arrived, 0.05 if sharing == "timeslice" else 0.01)
        assert better.finished >= worse.finished - slack, sharing
        assert better.good >= worse.good - slack, sharing


def test_time_slicing_gives_saturated_models_their_weights_share_of_the_device():
    models = dict.fromkeys("ab", SimModel(SHAPE, EngineLimits(max_num_seqs=4)))
    flood = ModelTraffic(rate_per_s=200, prompt_tokens=LengthDist("fixed", value=8),
                         output_tokens=LengthDist("fixed", value=400))
    pool = Pool("cpu", "timeslice", Share(1.0, 1.0), GPU, (Member("a/0", "a", KV, weight=3.0),
                                                            Member("b/0", "b", KV, weight=1.0)))
    results = simulate([pool], models, Traffic(5.0, {"a": flood, "b": flood}), drain_s=0.0)
    alone = simulate([_alone(Share(1.0, 1.0), KV, "a")], models, Traffic(5.0, {"a": flood}), drain_s=0.0)
    a, b = results["a"].output_tokens_per_s, results["b"].output_tokens_per_s
    assert a / b == pytest.approx(3.0, rel=0.05)
    assert a == pytest.approx(0.75 * alone["a"].output_tokens_per_s, rel=0.05)


def test_traffic_for_a_model_without_a_replica_is_refused():
    with pytest.raises(ValueError, match=r"traffic for model\(s\) \['x'\], which no replica of the plan serves"):
        simulate([_alone(Share(1, 1))], {"m": SimModel(SHAPE)}, _traffic(1, 10, 10, models=("m", "x")))


def test_pools_of_a_nested_plan_have_their_mig_devices_fractions():
    h200 = gpus("h200-141gb")
    demands = [demand("big", isolation="mig", gib=60, kv_cache_bytes=GIB),
               demand("a", isolation="mps", gib=15, sm_percent=30, mig_instance="shared", kv_cache_bytes=GIB),
               demand("b", isolation="mps", gib=15, sm_percent=60, mig_instance="shared", kv_cache_bytes=GIB)]
    result = plan(h200, demands, PlanOptions())
    pools = {p.sharing: p for p in plan_pools(result, h200)}
    assert pools["alone"].share == Share(60 / 132, 4 / 8)  # 3g.71gb
    assert pools["mps"].share == Share(26 / 132, 2 / 8)  # 1g.35gb
    assert [(m.replica_id, m.sm_fraction) for m in pools["mps"].members] == [("a/0", 0.3), ("b/0", 0.6)]
    assert pools["alone"].speed.name == "NVIDIA H200"


def test_candidates_cover_every_family_keep_static_mig_and_carry_the_planners_reasons():
    demands = [demand(m, isolation="mig", gib=g) for m, g in (("a", 14), ("b", 30), ("c", 60))]
    found = candidate_plans(gpus("h200-141gb"), demands, PlanOptions(), {"a": 1.0, "b": 3.0, "c": 1.0})
    families = {c.family for c in found}
    assert families == {"as configured", "mig", "mps", "timeslice", "nested"}
    static = [c for c in found if c.family == "mig" and c.name.endswith("(memory-sized)")]
    assert len(static) == 1 and static[0].plan is not None
    assert "a/0=1g.18gb" in static[0].name and "c/0=3g.71gb" in static[0].name
    by_load = next(c for c in found if c.name.startswith("mps by load"))
    assert "b/0=60%" in by_load.name and "a/0=20%" in by_load.name
    refused = [c for c in found if c.plan is None]
    assert refused and all(c.problems and "does not fit" in c.problems[0] for c in refused)
    assert math.isclose(sum(r.weight for r in next(c for c in found if c.name.startswith("timeslice by load"))
                            .plan.replicas), 1.0, rel_tol=1e-3)


def test_a_traffic_file_replays_a_logged_model_and_draws_lognormal_lengths_with_their_mean(tmp_path):
    from partitioner.simulate.traffic import Arrival, load_traffic

    (tmp_path / "t.yaml").write_text("duration_s: 200\nseed: 3\nmodels:\n"
                                     "  a: {rate_per_s: 50, prompt_tokens: {dist: lognormal, mean: 300, sigma: 0.5},\n"
                                     "      calibration: 5.5, host_ms_per_step: 2, arrival_cv: 2}\n"
                                     "  b: {log: traffic.jsonl, slo: {ttft_ms: 10}}\n")
    rows = [{"model": "b", "start_s": 100.5, "prompt_tokens": 7, "output_tokens": 0},
            {"model": "b", "start_s": 100.0, "prompt_tokens": 5, "output_tokens": 9}, {"model": "c", "start_s": 1}]
    read: list[str] = []
    traffic = load_traffic(tmp_path / "t.yaml", lambda path: read.append(path) or rows)
    assert read == [str(tmp_path / "traffic.jsonl")]
    a = traffic.models["a"]
    assert (a.calibration, a.host_s_per_step, a.arrival_cv) == (5.5, 0.002, 2.0)
    assert traffic.arrivals("b") == [Arrival(0.0, 5, 9), Arrival(0.5, 7, 1)]
    assert traffic.models["b"].slo == Slo(ttft_s=0.01, tpot_s=0.1)  # 10 ms given, TPOT's default
    prompts = [a.prompt_tokens for a in traffic.arrivals("a")]
    assert len(prompts) == pytest.approx(50 * 200, rel=0.05)
    assert sum(prompts) / len(prompts) == pytest.approx(300, rel=0.03)


def _flood(host_s: float = 0.0) -> ModelTraffic:
    return ModelTraffic(rate_per_s=200, prompt_tokens=LengthDist("fixed", value=8),
                        output_tokens=LengthDist("fixed", value=400), host_s_per_step=host_s)


def test_host_time_between_steps_stretches_a_lone_engines_cycle():
    """Decode steps of ~1.01 ms (1 GB of weights at 1 TB/s): 1 ms off the device after each halves the rate."""
    models = {"m": SimModel(SHAPE, EngineLimits(max_num_seqs=4))}
    busy = simulate([_alone(Share(1.0, 1.0))], models, Traffic(5.0, {"m": _flood()}), drain_s=0.0)["m"]
    hosted = simulate([_alone(Share(1.0, 1.0))], models, Traffic(5.0, {"m": _flood(1e-3)}), drain_s=0.0)["m"]
    assert hosted.generated_tokens / busy.generated_tokens == pytest.approx(1.01 / 2.01, rel=0.02)


@pytest.mark.parametrize(("weights", "kept"), [((1.0, 1.0), (0.95, 1.0)), ((3.0, 1.0), (0.6, 0.85))])
def test_time_sliced_engines_hide_host_time_behind_each_others_steps_unless_regranted(weights, kept):
    """At 1:1 the lease alternates, so each engine's host work runs while the other steps and the device stays
    busy; at 3:1 the heavier engine is often granted again at once and holds the idle device through its own host
    work (as the real client does), uncharged: the device loses time, the 3:1 split of its busy time stays."""
    models = dict.fromkeys("ab", SimModel(SHAPE, EngineLimits(max_num_seqs=4)))
    pool = Pool("gpu", "timeslice", Share(1.0, 1.0), GPU, (Member("a/0", "a", KV, weight=weights[0]),
                                                            Member("b/0", "b", KV, weight=weights[1])))
    lone = simulate([_alone(Share(1.0, 1.0), KV, "a")], models, Traffic(5.0, {"a": _flood()}), drain_s=0.0)["a"]
    shared = simulate([pool], models, Traffic(5.0, {"a": _flood(1e-3), "b": _flood(1e-3)}), drain_s=0.0)
    a, b = shared["a"].generated_tokens, shared["b"].generated_tokens
    assert kept[0] <= (a + b) / lone.generated_tokens <= kept[1]
    assert a / b == pytest.approx(weights[0] / weights[1], rel=0.05)


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_bursty_arrivals_keep_their_rate_and_have_the_gaps_cv_asked_for(cv):
    spec = ModelTraffic(rate_per_s=20.0, arrival_cv=cv)
    times = [a.time_s for a in Traffic(2000.0, {"m": spec}, seed=1).arrivals("m")]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert len(times) == pytest.approx(20.0 * 2000, rel=0.05) and times[-1] > 1990  # the whole duration is covered
    assert std / mean == pytest.approx(cv, rel=0.1)
