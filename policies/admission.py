"""Admission and overload rules: when a replica's queue is too long or a request waited too long, the
request is refused with a Retry-After that says when capacity is likely back.

Pure logic over explicit numbers; the caller passes the clock's reading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A client told to come back after 0 s would hammer us; after minutes it gives up on a queue that drains
# in seconds. The estimate is clamped to this range.
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True)
class AdmissionLimits:
    max_queue_len: int | None = None  # waiting requests per replica; None: unbounded
    max_queue_wait_s: float | None = None  # a request not started after this long is refused; None: no limit

    def __post_init__(self) -> None:
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {self.max_queue_len}")
        if self.max_queue_wait_s is not None and not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be > 0, got {self.max_queue_wait_s}")

    def queue_full(self, num_waiting: int) -> bool:
        return self.max_queue_len is not None and num_waiting >= self.max_queue_len

    def wait_cutoff(self, now_s: float) -> float | None:
        """Requests that arrived before this time and have not started are refused (None: never)."""
        return None if self.max_queue_wait_s is None else now_s - self.max_queue_wait_s


class RateMeter:
    """Events per second, exponentially weighted over about `horizon_s` (finished requests, here)."""

    def __init__(self, horizon_s: float = 10.0) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.horizon_s = horizon_s
        self._rate = 0.0
        self._last_s: float | None = None

    def record(self, now_s: float, count: int = 1) -> None:
        self._rate = self.rate(now_s) + count / self.horizon_s
        self._last_s = now_s if self._last_s is None else max(self._last_s, now_s)

    def rate(self, now_s: float) -> float:
        """Read-only (another thread may call it while the owner records)."""
        if self._last_s is None or now_s <= self._last_s:
            return self._rate
        return self._rate * math.exp(-(now_s - self._last_s) / self.horizon_s)


def retry_after_s(num_ahead: int, finishes_per_s: float) -> float:
    """When a refused client should try again: the time the requests ahead of it take to finish at the
    recent finish rate, clamped to [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]; no rate known -> the minimum."""
    if finishes_per_s <= 0:
        return MIN_RETRY_AFTER_S
    return min(max(num_ahead / finishes_per_s, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)
