"""Per-key rate limits on a fake clock: bursts up to the per-minute limit, refill, token debt."""

from __future__ import annotations

import pytest

from policies.ratelimit import KeyLimits, KeyRateLimiter


def test_requests_per_minute_allows_a_burst_then_refills():
    limiter, limits = KeyRateLimiter(), KeyLimits(requests_per_minute=3)
    assert [limiter.admit("k", limits, 0.0) for _ in range(3)] == [None, None, None]
    refusal = limiter.admit("k", limits, 0.0)
    assert refusal is not None and (refusal.limit, refusal.value) == ("requests_per_minute", 3)
    assert refusal.retry_after_s == pytest.approx(20.0)  # one request every 20 s
    assert limiter.admit("k", limits, 19.0) is not None
    assert limiter.admit("k", limits, 20.0) is None
    assert limiter.admit("other", limits, 20.0) is None  # buckets are per key


def test_tokens_per_minute_is_charged_after_the_reply_and_may_go_into_debt():
    limiter, limits = KeyRateLimiter(), KeyLimits(tokens_per_minute=600)
    assert limiter.admit("k", limits, 0.0) is None
    limiter.charge_tokens("k", limits, 1.0, 900)  # one long reply: 300 tokens of debt
    refusal = limiter.admit("k", limits, 1.0)
    assert refusal is not None and refusal.limit == "tokens_per_minute"
    assert refusal.retry_after_s == pytest.approx(30.1, abs=0.01)  # 301 tokens at 10/s
    assert limiter.admit("k", limits, 31.2) is None


def test_a_changed_limit_starts_a_fresh_bucket_and_no_limit_admits_all():
    limiter = KeyRateLimiter()
    for _ in range(2):
        assert limiter.admit("k", KeyLimits(requests_per_minute=2), 0.0) is None
    assert limiter.admit("k", KeyLimits(requests_per_minute=2), 0.0) is not None
    assert limiter.admit("k", KeyLimits(requests_per_minute=10), 0.0) is None
    assert all(limiter.admit("k", KeyLimits(), 0.0) is None for _ in range(100))


def test_limits_are_checked():
    with pytest.raises(ValueError, match="tokens_per_minute must be >= 1"):
        KeyLimits(tokens_per_minute=0)
