"""Arrival processes (rate, burstiness, seeded reproducibility), length distributions as bench draws them, and
traces."""

import json
import random
import statistics

import pytest

from bench.arrivals import arrival_offsets, load_trace, measured_rate
from partitioner.simulate.workload import LengthDist


@pytest.mark.parametrize("kind", ["poisson", "gamma", "constant"])
def test_rate_is_delivered_within_tolerance(kind):
    offsets = arrival_offsets(kind, 4.0, 20_000, random.Random(1), cv=2.0)
    assert measured_rate(offsets) == pytest.approx(4.0, rel=0.04)
    assert offsets == sorted(offsets)


@pytest.mark.parametrize(("kind", "cv", "expected_cv"), [("poisson", 1.0, 1.0), ("gamma", 3.0, 3.0),
                                                          ("gamma", 0.5, 0.5), ("constant", 1.0, 0.0)])
def test_gap_variability_matches_the_process(kind, cv, expected_cv):
    offsets = arrival_offsets(kind, 10.0, 20_000, random.Random(2), cv=cv)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(expected_cv, abs=0.1 * max(cv, 1))


def test_same_seed_same_schedule_other_seed_another():
    first = arrival_offsets("poisson", 2.0, 50, random.Random(7))
    assert arrival_offsets("poisson", 2.0, 50, random.Random(7)) == first
    assert arrival_offsets("poisson", 2.0, 50, random.Random(8)) != first


def test_bad_rate_and_kind_are_refused():
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets("poisson", 0.0, 3, random.Random(0))
    with pytest.raises(ValueError, match="known: poisson"):
        arrival_offsets("weibull", 1.0, 3, random.Random(0))


def test_lengths_stay_in_bounds_and_center_where_asked():
    rng = random.Random(3)
    uniform = LengthDist("uniform", low=20, high=120).samples(5000, rng)
    assert min(uniform) == 20 and max(uniform) == 120
    lognormal = LengthDist("lognormal", median=128, low=16, high=1024, sigma=0.6).samples(5000, rng)
    assert statistics.median(lognormal) == pytest.approx(128, rel=0.05)
    assert min(lognormal) >= 16 and max(lognormal) <= 1024
    assert set(LengthDist("fixed", value=7).samples(10, rng)) == {7}


def test_length_bounds_are_checked():
    with pytest.raises(ValueError, match="low"):
        LengthDist("uniform", low=10, high=5)


def test_trace_offsets_are_relative_to_the_first_request(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 1002.5, "prompt_tokens": 30, "output_tokens": 4},
            {"timestamp": 1000.0, "prompt_tokens": 10, "output_tokens": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    entries = load_trace(path)
    assert [(e.offset_s, e.num_prompt_tokens, e.num_output_tokens) for e in entries] == [(0.0, 10, 2), (2.5, 30, 4)]


def test_a_bad_trace_line_is_named(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 1, "prompt_tokens": 3, "output_tokens": 1}\n{"timestamp": 2}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:2"):
        load_trace(path)
