"""Per-key rate limits on a fake clock: bursts up to the per-minute limit, refill, token debt."""

from __future__ import annotations

import pytest

from policies.ratelimit import KeyLimits, KeyRateLimiter, estimate_tokens


def test_requests_per_minute_allows_a_burst_then_refills():
    limiter, limits = KeyRateLimiter(), KeyLimits(requests_per_minute=3)
    assert [limiter.admit("k", limits, 0.0) for _ in range(3)] == [None, None, None]
    refusal = limiter.admit("k", limits, 0.0)
    assert refusal is not None and (refusal.limit, refusal.value) == ("requests_per_minute", 3)
    assert refusal.retry_after_s == pytest.approx(20.0)  # one request every 20 s
    assert limiter.admit("k", limits, 19.0) is not None
    assert limiter.admit("k", limits, 20.0) is None
    assert limiter.admit("other", limits, 20.0) is None  # buckets are per key


def test_tokens_per_minute_reserves_up_front_and_settles_from_usage():
    limiter, limits = KeyRateLimiter(), KeyLimits(tokens_per_minute=600)
    assert limiter.admit("k", limits, 0.0, reserve_tokens=400) is None
    refusal = limiter.admit("k", limits, 0.0, reserve_tokens=400)  # 200 left while the first is in flight
    assert refusal is not None and refusal.limit == "tokens_per_minute" and refusal.needed is None
    assert refusal.retry_after_s == pytest.approx(20.0)  # 200 more tokens at 10/s
    limiter.settle("k", limits, 1.0, reserved=400, used=100)  # it used less: the rest comes back
    assert limiter.admit("k", limits, 1.0, reserve_tokens=400) is None


def test_a_reply_over_its_reservation_puts_the_key_into_debt():
    limiter, limits = KeyRateLimiter(), KeyLimits(tokens_per_minute=600)
    assert limiter.admit("k", limits, 0.0, reserve_tokens=100) is None
    limiter.settle("k", limits, 1.0, reserved=100, used=900)  # 510 after a second's refill, minus 800 more used
    refusal = limiter.admit("k", limits, 1.0)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(29.1, abs=0.01)  # 291 tokens at 10/s
    assert limiter.admit("k", limits, 30.2) is None


def test_a_request_over_the_whole_budget_is_refused_outright():
    limiter, limits = KeyRateLimiter(), KeyLimits(tokens_per_minute=600)
    refusal = limiter.admit("k", limits, 0.0, reserve_tokens=601)
    assert refusal is not None and refusal.needed == 601
    assert limiter.admit("k", limits, 0.0, reserve_tokens=600) is None  # nothing was taken by the refusal


@pytest.mark.parametrize(("endpoint", "payload", "prompt", "completion"), [
    ("completions", {"prompt": "abcdefgh"}, 2, 16),
    ("completions", {"prompt": [1, 2, 3], "max_tokens": 5, "n": 2}, 3, 10),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, 5, 1),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "abcde"}]}]}, 6, 256),
    ("chat", {"messages": "not a list", "max_completion_tokens": 3}, 0, 3),
    ("chat", {"messages": [], "max_completion_tokens": None, "max_tokens": 7}, 0, 7),
    ("embeddings", {"input": ["abcd", "efgh"]}, 2, 0),
    ("embeddings", {"input": [[1, 2], [3]]}, 3, 0),
])
def test_estimates_count_the_prompt_and_what_may_be_generated(endpoint, payload, prompt, completion):
    estimate = estimate_tokens(endpoint, payload)
    assert (estimate.prompt, estimate.completion) == (prompt, completion)


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
