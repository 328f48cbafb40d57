"""Replica choice: small policies over a snapshot of the candidates; no I/O, randomness injected.

A policy sees only replicas that may take traffic (ready, breaker not open, not draining) and returns
one of them. The gateway owns the snapshot and applies the choice.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    replica_id: str
    outstanding: int  # requests in flight from this gateway


class RoutingPolicy(Protocol):
    def choose(self, candidates: Sequence[Candidate], key: str | None = None) -> Candidate:
        """Pick one of a non-empty list of candidates; `key` carries a session or prefix hint."""


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Candidate], key: str | None = None) -> Candidate:
        pick = candidates[self._next % len(candidates)]
        self._next += 1
        return pick


class LeastOutstanding:
    """Fewest requests in flight; ties broken round-robin so equal replicas share the load."""

    def __init__(self) -> None:
        self._tiebreak = 0

    def choose(self, candidates: Sequence[Candidate], key: str | None = None) -> Candidate:
        low = min(c.outstanding for c in candidates)
        tied = [c for c in candidates if c.outstanding == low]
        self._tiebreak += 1
        return tied[self._tiebreak % len(tied)]


class PowerOfTwo:
    """Two random candidates, the less loaded wins: near least-loaded without herding."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Candidate], key: str | None = None) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return a if a.outstanding <= b.outstanding else b


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "power_of_two": PowerOfTwo,
}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
