"""Regressions beyond noise: the band, the verdicts, and which earlier runs form the baseline."""

import pytest

from bench.compare import baselines_for, compare, noise_band


def record(run_id: str, tok_s: float, ttft_p50: float, label: str = "c=4") -> dict:
    return {"run_id": run_id, "target": {"model": "m", "endpoint": "chat"}, "workload": "chat", "lengths": [],
            "load": {"label": label}, "tag": None,
            "results": {"output_tok_per_s": tok_s, "ttft_ms": {"p50": ttft_p50, "p99": ttft_p50 * 2}}}


def verdicts(rows) -> dict:
    return {r.metric: r.verdict for r in rows}


def test_band_is_the_floor_with_few_runs_and_the_spread_with_many():
    assert noise_band([100.0, 200.0], 0.1) == 0.1
    assert noise_band([100.0, 101.0, 99.0], 0.1) == 0.1  # quiet runs: the floor
    assert noise_band([100.0, 130.0, 70.0, 100.0], 0.1) == pytest.approx(3 * 1.4826 * 15 / 100)


def test_worse_beyond_the_band_is_a_regression_in_either_direction():
    base = [record("a", 100.0, 50.0)]
    rows = verdicts(compare(record("b", 80.0, 60.0), base))
    assert rows["output_tok_per_s"] == "REGRESSION"  # fewer tokens/s
    assert rows["ttft_ms.p50"] == "REGRESSION"  # slower first token
    rows = verdicts(compare(record("c", 95.0, 40.0), base))
    assert rows["output_tok_per_s"] == "ok"
    assert rows["ttft_ms.p50"] == "improved"
    assert rows["tpot_ms.p50"] == "n/a"


def test_noisy_history_widens_the_band():
    noisy = [record(str(i), v, 50.0) for i, v in enumerate([100.0, 140.0, 60.0, 100.0, 120.0])]
    assert verdicts(compare(record("x", 80.0, 50.0), noisy))["output_tok_per_s"] == "ok"


def test_baselines_are_earlier_runs_of_the_same_configuration():
    records = [record("a", 1, 1), record("b", 1, 1, label="c=8"), record("c", 1, 1), record("d", 1, 1)]
    assert [r["run_id"] for r in baselines_for(records, records[3], last=5)] == ["a", "c"]
    assert [r["run_id"] for r in baselines_for(records, records[3], last=1)] == ["c"]


def test_records_of_the_first_schema_compare_with_later_ones_of_the_same_lengths():
    """Schema 1 wrote every field of a length distribution, `mean` standing for a fixed length's value and for a
    lognormal's median; later records name each distribution's own parameters. The same lengths are one
    configuration either way, other lengths another."""
    from bench.history import config_key
    from bench.workloads import parse_length

    def lengths(prompt: str, output: str) -> list[dict]:
        return [{"weight": 1.0, "prompt": parse_length(prompt).parameters(),
                 "output": parse_length(output).parameters()}]

    old = {**record("a", 1, 1), "schema": 1, "lengths": [
        {"weight": 1.0, "prompt": {"kind": "fixed", "mean": 12, "low": 1, "high": 12, "sigma": 0.5},
         "output": {"kind": "lognormal", "mean": 100, "low": 1, "high": 1 << 20, "sigma": 0.7}}]}
    new = {**record("b", 1, 1), "schema": 2, "lengths": lengths("fixed:12", "lognormal:100:0.7")}
    assert config_key(old) == config_key(new)
    assert config_key(old) != config_key({**new, "lengths": lengths("fixed:12", "lognormal:100:0.6")})
    assert config_key(old) != config_key({**new, "lengths": lengths("fixed:13", "lognormal:100:0.7")})
    uniform = {"kind": "uniform", "mean": 128, "low": 20, "high": 120, "sigma": 0.5}
    assert config_key({**old, "lengths": [{"weight": 1.0, "prompt": uniform, "output": uniform}]}) == \
        config_key({**new, "lengths": lengths("uniform:20:120", "uniform:20:120")})
    assert baselines_for([old, new], new, last=5) == [old]
