"""The plan-goodput sweep's own arithmetic: traffic scaled as asked, and a point's best plan never below static MIG
(static MIG is one of the candidates the best is chosen from)."""

from __future__ import annotations

import pytest

from bench.measure.plan_goodput_sweep import EXAMPLE, Example, run_point, scaled
from partitioner.simulate.traffic import load_traffic


def test_scaling_multiplies_every_rate_and_sets_the_gaps_cv():
    traffic = load_traffic(EXAMPLE / "traffic.yaml")
    more = scaled(traffic, 1.5, 4.0)
    for name, spec in traffic.models.items():
        assert more.models[name].rate_per_s == pytest.approx(1.5 * spec.rate_per_s)
        assert more.models[name].arrival_cv == 4.0 and more.models[name].slo == spec.slo


def test_a_point_compares_the_best_plan_with_static_mig_on_the_same_traffic():
    point = run_point(Example.load(), 0.5, 1.0)
    assert point.offered_per_s == pytest.approx(0.5 * (20 + 6 + 1.5))
    assert point.static_goodput > 0 and point.best_goodput >= point.static_goodput and point.ratio >= 1.0
