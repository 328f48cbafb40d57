"""The one backoff the gateway's retries and the pool's restarts share."""

from __future__ import annotations

import pytest

from policies.retry import Backoff


def test_doubles_from_the_base_and_stops_at_the_cap():
    backoff = Backoff(0.5, 30.0)
    assert [backoff.delay_s(n) for n in range(1, 9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff.delay_s(10_000) == 30.0  # no overflow however long the run of failures


@pytest.mark.parametrize(("base_s", "max_s"), [(-1.0, 1.0), (2.0, 1.0)])
def test_a_backoff_that_makes_no_sense_is_refused(base_s, max_s):
    with pytest.raises(ValueError, match="base_s <= max_s"):
        Backoff(base_s, max_s)


def test_failures_count_from_one():
    with pytest.raises(ValueError, match="counts from 1"):
        Backoff(0.1, 1.0).delay_s(0)
