"""The per-replica circuit breaker, driven by a fake clock."""

from __future__ import annotations

import pytest

from model_pool.health import BreakerConfig, BreakerState, CircuitBreaker
from tests.gateway.fakes import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(now=100.0)


@pytest.fixture
def breaker(clock: FakeClock) -> CircuitBreaker:
    return CircuitBreaker(BreakerConfig(failure_threshold=3, window_s=30.0, cooldown_s=5.0), clock)


def fail(breaker: CircuitBreaker, clock: FakeClock, times: int, every_s: float = 1.0) -> None:
    for _ in range(times):
        breaker.record_failure()
        clock.advance(every_s)


def test_a_new_breaker_is_closed_and_allows_requests(breaker):
    assert breaker.state == BreakerState.CLOSED
    assert breaker.allows_request()


def test_opens_at_the_threshold_within_the_window(breaker, clock):
    fail(breaker, clock, 2)
    assert breaker.state == BreakerState.CLOSED
    assert breaker.allows_request()
    breaker.record_failure()
    assert breaker.state == BreakerState.OPEN
    assert not breaker.allows_request()


def test_failures_older_than_the_window_do_not_count(breaker, clock):
    fail(breaker, clock, 2, every_s=0.0)
    clock.advance(31.0)  # both now older than window_s
    fail(breaker, clock, 2)
    assert breaker.state == BreakerState.CLOSED
    breaker.record_failure()  # three within the window
    assert breaker.state == BreakerState.OPEN


def test_a_success_while_closed_resets_the_count(breaker, clock):
    fail(breaker, clock, 2)
    breaker.record_success()
    fail(breaker, clock, 2)
    assert breaker.state == BreakerState.CLOSED


def test_open_turns_half_open_after_the_cooldown(breaker, clock):
    fail(breaker, clock, 3, every_s=0.0)
    clock.advance(4.9)
    assert breaker.state == BreakerState.OPEN
    assert not breaker.allows_request()
    clock.advance(0.1)
    assert breaker.state == BreakerState.HALF_OPEN
    assert breaker.allows_request()


def test_half_open_allows_one_trial_at_a_time(breaker, clock):
    fail(breaker, clock, 3, every_s=0.0)
    clock.advance(5.0)
    breaker.on_dispatch()
    assert breaker.state == BreakerState.HALF_OPEN
    assert not breaker.allows_request()  # the trial is still out


def test_dispatch_while_closed_does_not_limit_requests(breaker):
    breaker.on_dispatch()
    breaker.on_dispatch()
    assert breaker.allows_request()


def test_a_successful_trial_closes_it(breaker, clock):
    fail(breaker, clock, 3, every_s=0.0)
    clock.advance(5.0)
    breaker.on_dispatch()
    breaker.record_success()
    assert breaker.state == BreakerState.CLOSED
    assert breaker.allows_request()
    fail(breaker, clock, 2)  # the old failures were forgotten: two new ones do not reopen it
    assert breaker.state == BreakerState.CLOSED


def test_a_failed_trial_reopens_it_for_another_cooldown(breaker, clock):
    fail(breaker, clock, 3, every_s=0.0)
    clock.advance(5.0)
    breaker.on_dispatch()
    breaker.record_failure()  # one failure is enough while half-open
    assert breaker.state == BreakerState.OPEN
    assert not breaker.allows_request()
    clock.advance(4.9)
    assert breaker.state == BreakerState.OPEN  # the cooldown restarted at the failed trial
    clock.advance(0.1)
    assert breaker.state == BreakerState.HALF_OPEN
    assert breaker.allows_request()  # a fresh trial is allowed
