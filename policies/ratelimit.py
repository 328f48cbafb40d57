"""Per-API-key rate limits: requests per minute and tokens per minute, as token buckets.

Requests are taken before the request runs. Tokens are only known afterwards (the reply's usage), so the
token bucket is charged then and may go into debt: a key that just spent more than its budget waits until
the debt is repaid (the same idea as OpenAI's and LiteLLM's usage-based TPM limits). Buckets start full and
hold one minute's worth, so a key may burst up to its per-minute limit.

Pure logic: the caller passes the clock's reading.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeyLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def any(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class Refusal:
    limit: str  # the field at fault, e.g. "requests_per_minute"
    value: int
    retry_after_s: float


class _Bucket:
    def __init__(self, per_minute: int, now_s: float) -> None:
        self.capacity = float(per_minute)
        self.rate_per_s = per_minute / 60.0
        self.level = self.capacity
        self.updated_s = now_s

    def refill(self, now_s: float) -> None:
        if now_s > self.updated_s:
            self.level = min(self.capacity, self.level + (now_s - self.updated_s) * self.rate_per_s)
            self.updated_s = now_s

    def seconds_until(self, level: float) -> float:
        return max(level - self.level, 0.0) / self.rate_per_s


class KeyRateLimiter:
    """Buckets per key; `admit` before a request, `charge_tokens` once its usage is known."""

    def __init__(self) -> None:
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    def admit(self, key: str, limits: KeyLimits, now_s: float) -> Refusal | None:
        """Take one request from `key`'s budget, or say which limit refuses it and when to retry."""
        tokens = self._bucket(self._tokens, key, limits.tokens_per_minute, now_s)
        if tokens is not None and tokens.level <= 0:  # in debt from earlier replies
            return Refusal("tokens_per_minute", int(tokens.capacity), tokens.seconds_until(1.0))
        requests = self._bucket(self._requests, key, limits.requests_per_minute, now_s)
        if requests is not None:
            if requests.level < 1:
                return Refusal("requests_per_minute", int(requests.capacity), requests.seconds_until(1.0))
            requests.level -= 1
        return None

    def charge_tokens(self, key: str, limits: KeyLimits, now_s: float, num_tokens: int) -> None:
        tokens = self._bucket(self._tokens, key, limits.tokens_per_minute, now_s)
        if tokens is not None:
            tokens.level -= num_tokens

    @staticmethod
    def _bucket(buckets: dict[str, _Bucket], key: str, per_minute: int | None, now_s: float) -> _Bucket | None:
        if per_minute is None:
            return None
        bucket = buckets.get(key)
        if bucket is None or bucket.capacity != per_minute:  # new key, or its limit was changed
            bucket = buckets[key] = _Bucket(per_minute, now_s)
        bucket.refill(now_s)
        return bucket
