"""Per-API-key rate limits: requests per minute and tokens per minute, as token buckets.

Requests are taken before the request runs. Tokens are reserved before it runs too: an estimate of its prompt
plus its `max_tokens` (`estimate_tokens`), so that concurrent requests cannot all slip under the limit before any
of them is charged. When the reply's usage is known, `settle` hands back the reservation and charges what was
used; a reply that used more than estimated may put the bucket into debt, and the key waits until it is repaid.
A single request that needs more than a minute's budget is refused outright. Buckets start full and hold one
minute's worth, so a key may burst up to its per-minute limit. Buckets live in one gateway process.

Pure logic: the caller passes the clock's reading.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# A chat request without max_tokens may run to the end of the context; this much of it is reserved up front
# (the reply's usage settles the difference).
CHAT_RESERVE_TOKENS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHARS_PER_TOKEN = 4  # the usual estimate for English text with BPE vocabularies
MESSAGE_OVERHEAD_TOKENS = 4  # a chat template's role markers per message


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
    needed: int | None = None  # tokens this one request needs when that alone is over the limit


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

    def admit(self, key: str, limits: KeyLimits, now_s: float, reserve_tokens: int = 0) -> Refusal | None:
        """Take one request and `reserve_tokens` from `key`'s budget, or say which limit refuses it and when to
        retry. A reservation is handed back by `settle` once the request's usage is known."""
        tokens = self._bucket(self._tokens, key, limits.tokens_per_minute, now_s)
        if tokens is not None:
            if reserve_tokens > tokens.capacity:
                return Refusal("tokens_per_minute", int(tokens.capacity), 60.0, needed=reserve_tokens)
            wanted = max(reserve_tokens, 1)
            if tokens.level < wanted:  # spent, reserved by requests in flight, or in debt from earlier replies
                return Refusal("tokens_per_minute", int(tokens.capacity), tokens.seconds_until(wanted))
        requests = self._bucket(self._requests, key, limits.requests_per_minute, now_s)
        if requests is not None:
            if requests.level < 1:
                return Refusal("requests_per_minute", int(requests.capacity), requests.seconds_until(1.0))
            requests.level -= 1
        if tokens is not None:
            tokens.level -= reserve_tokens
        return None

    def settle(self, key: str, limits: KeyLimits, now_s: float, reserved: int, used: int) -> None:
        """A request admitted with `reserved` tokens finished having used `used`: charge the difference."""
        tokens = self._bucket(self._tokens, key, limits.tokens_per_minute, now_s)
        if tokens is not None:
            tokens.level += reserved - used

    @staticmethod
    def _bucket(buckets: dict[str, _Bucket], key: str, per_minute: int | None, now_s: float) -> _Bucket | None:
        if per_minute is None:
            return None
        bucket = buckets.get(key)
        if bucket is None or bucket.capacity != per_minute:  # new key, or its limit was changed
            bucket = buckets[key] = _Bucket(per_minute, now_s)
        bucket.refill(now_s)
        return bucket


@dataclass(frozen=True)
class TokenEstimate:
    prompt: int
    completion: int

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def estimate_tokens(endpoint: str, payload: Mapping[str, Any]) -> TokenEstimate:
    """What a request may cost before it runs: its prompt (token ids counted, text at CHARS_PER_TOKEN) plus what
    it may generate (`n` x `max_tokens`; without one, COMPLETION_DEFAULT_MAX_TOKENS for completions and
    CHAT_RESERVE_TOKENS for chat). `endpoint`: "chat", "completions" or "embeddings"."""
    if endpoint == "embeddings":
        return TokenEstimate(_text_tokens(payload.get("input")), 0)
    if endpoint == "chat":
        messages = payload.get("messages")
        messages = messages if isinstance(messages, list) else []
        prompt = sum(_text_tokens(m.get("content")) + MESSAGE_OVERHEAD_TOKENS for m in messages if isinstance(m, dict))
        limit = payload.get("max_completion_tokens")
        limit = payload.get("max_tokens") if limit is None else limit  # an explicit null is unset, as on a replica
        default = CHAT_RESERVE_TOKENS
    else:
        prompt = _text_tokens(payload.get("prompt"))
        limit, default = payload.get("max_tokens"), COMPLETION_DEFAULT_MAX_TOKENS
    n = payload.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    max_tokens = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0 else default
    return TokenEstimate(prompt, n * max_tokens)


def _text_tokens(value: Any) -> int:
    """Tokens in a prompt-like value: a string, token ids, content parts, or a list of any of these."""
    if isinstance(value, str):
        return math.ceil(len(value) / CHARS_PER_TOKEN)
    if isinstance(value, dict):  # a content part {"type": "text", "text": ...}
        return _text_tokens(value.get("text"))
    if isinstance(value, list):
        if all(isinstance(v, int) for v in value):
            return len(value)
        return sum(_text_tokens(v) for v in value)
    return 0
