"""How long to wait before trying again: one capped exponential backoff for the gateway's request retries and the
pool's restarts of a crashed replica. Pure: the caller counts attempts and does the waiting."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """`base_s` after the first failure, doubling with each one after it, never more than `max_s`."""

    base_s: float
    max_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.base_s <= self.max_s:
            raise ValueError(f"backoff needs 0 <= base_s <= max_s, got base_s={self.base_s}, max_s={self.max_s}")

    def delay_s(self, failures: int) -> float:
        """The wait after `failures` failures in a row (1 for the first)."""
        if failures < 1:
            raise ValueError(f"failures counts from 1, got {failures}")
        return min(self.base_s * 2.0 ** min(failures - 1, 64), self.max_s)
