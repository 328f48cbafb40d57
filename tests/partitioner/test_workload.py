"""The one workload vocabulary of bench and the simulator: a lognormal centred by its median or by its mean, bounds,
what each kind refuses, the SLO's judgement in seconds; a traffic file's spelling of them; and the simulator's draws
from before it shared them (pinned: a seed gives the requests it gave; bench's are in tests/bench/test_workloads.py)."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from partitioner.simulate.traffic import DEFAULT_SLO, load_traffic
from partitioner.simulate.workload import LengthDist, Slo


def test_a_lognormal_is_centred_by_its_median_or_by_its_mean():
    by_median = LengthDist("lognormal", median=300, sigma=0.8)
    by_mean = LengthDist("lognormal", mean=300, sigma=0.8)
    rng = np.random.default_rng(0)
    assert np.median(by_median.draw(rng, 200_000)) == pytest.approx(300, rel=0.02)
    assert np.mean(by_mean.draw(rng, 200_000)) == pytest.approx(300, rel=0.02)
    assert statistics.median(by_median.samples(20_000, random.Random(0))) == pytest.approx(300, rel=0.03)
    # the same distribution given either way: a mean is the median times exp(sigma²/2)
    assert by_median.expected() == pytest.approx(300 * math.exp(0.8 ** 2 / 2))
    assert by_mean.expected() == 300


def test_bounds_clamp_every_kind_and_each_kind_says_what_it_lacks():
    rng = np.random.default_rng(1)
    drawn = LengthDist("lognormal", median=100, sigma=2.0, low=20, high=400).draw(rng, 10_000)
    assert drawn.min() == 20 and drawn.max() == 400
    assert set(LengthDist("uniform", low=3, high=5).draw(rng, 1000)) == {3, 4, 5}
    assert LengthDist("fixed", value=50, high=40).sample(random.Random(0)) == 40
    for fields, message in [({"kind": "lognormal", "median": 100, "mean": 100}, "one of median or mean"),
                            ({"kind": "lognormal"}, "one of median or mean"),
                            ({"kind": "lognormal", "mean": 0.5}, "mean 0.5"),
                            ({"kind": "fixed", "value": 0}, "value >= 1, got 0"),
                            ({"kind": "uniform", "low": 4}, "uniform lengths need high"),
                            ({"kind": "uniform", "low": 9, "high": 5}, "low=9 high=5"),
                            ({"kind": "gaussian"}, "known: fixed, uniform, lognormal")]:
        with pytest.raises(ValueError, match=message):
            LengthDist(**fields)


def test_parameters_name_only_what_the_kind_draws_by():
    assert LengthDist("fixed", value=12).parameters() == {"kind": "fixed", "value": 12, "low": 1, "high": None}
    assert LengthDist("uniform", low=2, high=9).parameters() == {"kind": "uniform", "low": 2, "high": 9}
    assert LengthDist("lognormal", mean=80, sigma=0.3).parameters() == {
        "kind": "lognormal", "mean": 80, "sigma": 0.3, "low": 1, "high": None}


def test_an_slo_judges_in_seconds_and_a_one_token_answer_has_no_tpot():
    slo = Slo.from_ms(500, 40)
    assert slo == Slo(ttft_s=0.5, tpot_s=0.04)
    assert slo.met(0.5, 0.04) and not slo.met(0.51, 0.01) and not slo.met(0.1, 0.041)
    assert slo.met(0.1, None) and not slo.met(None, 0.01)  # no TPOT to judge; no first token at all
    assert Slo().met(99.0, 99.0) and Slo.from_ms(None, 40) == Slo(tpot_s=0.04)


def test_a_traffic_file_spells_lengths_and_slos_as_before_and_refuses_what_it_does_not_know(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("models:\n"
                    "  a: {prompt_tokens: {dist: lognormal, mean: 512, sigma: 0.6}, output_tokens: {value: 64},\n"
                    "      slo: {ttft_ms: 250}}\n"
                    "  b: {prompt_tokens: {dist: lognormal, median: 400, sigma: 0.5, high: 2000},\n"
                    "      output_tokens: {dist: uniform, low: 8, high: 300}}\n")
    traffic = load_traffic(path)
    a, b = traffic.models["a"], traffic.models["b"]
    assert a.prompt_tokens == LengthDist("lognormal", mean=512, sigma=0.6)
    assert a.output_tokens == LengthDist("fixed", value=64)
    assert a.slo == Slo(ttft_s=0.25, tpot_s=DEFAULT_SLO.tpot_s) and b.slo == DEFAULT_SLO == Slo(1.0, 0.1)
    assert b.prompt_tokens == LengthDist("lognormal", median=400, sigma=0.5, high=2000)
    assert b.output_tokens == LengthDist("uniform", low=8, high=300)
    for entry, message in [("{prompt_tokens: {dist: lognormal, mean: 5, avg: 3}}",
                            r"unknown field\(s\) \['models.a.prompt_tokens.avg'\]"),
                           ("{slo: {ttft_s: 0.5}}", r"unknown field\(s\) \['models.a.slo.ttft_s'\]"),
                           ("{slo: {ttft_ms: fast}}", "models.a.slo.ttft_ms: expected a non-negative number"),
                           ("{output_tokens: {dist: lognormal, sigma: 0.5}}",
                            "models.a.output_tokens: lognormal lengths need one of median or mean"),
                           ("{output_tokens: 64}", r"models.a.output_tokens: expected an object such as")]:
        path.write_text(f"models:\n  a: {entry}\n")
        with pytest.raises(ValueError, match=message):
            load_traffic(path)


def test_the_simulator_draws_the_requests_it_drew_before_the_vocabulary_was_shared(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("duration_s: 10\nseed: 5\nmodels:\n"
                    "  x: {rate_per_s: 8, prompt_tokens: {dist: uniform, low: 16, high: 512},"
                    " output_tokens: {dist: fixed, value: 64}}\n"
                    "  y: {rate_per_s: 3, arrival_cv: 2, prompt_tokens: {dist: lognormal, mean: 700, sigma: 0.8},"
                    " output_tokens: {dist: uniform, low: 8, high: 300}}\n")
    traffic = load_traffic(path)
    # the model's name seeds its generator: these are the draws of models named llama-3b and llama-8b before
    traffic = type(traffic)(traffic.duration_s, {"llama-3b": traffic.models["x"], "llama-8b": traffic.models["y"]},
                            traffic.seed)
    first = [(a.prompt_tokens, a.output_tokens) for a in traffic.arrivals("llama-8b")[:3]]
    assert first == [(227, 227), (391, 249), (256, 147)]
    assert [a.prompt_tokens for a in traffic.arrivals("llama-3b")[:3]] == [335, 188, 389]
    assert traffic.models["llama-8b"].offered_tokens_per_s(10) == 2562.0

