"""Replica choice: small policies over a snapshot of the candidates; no I/O, randomness injected.

A policy sees only replicas that may take traffic (ready, breaker not open, not draining) and returns
one of them. The gateway owns the snapshot and applies the choice.
"""

from __future__ import annotations

import bisect
import hashlib
import math
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


class ConsistentHash:
    """Requests with the same key go to the same replica (consistent hashing), unless it is overloaded.

    Keyed by the prompt's head (`prefix_affinity`: shared prefixes land where their KV blocks are cached)
    or a session header (`session`). Each replica owns `num_points` points on a hash ring; a key goes to
    the first replica clockwise whose load stays within `load_bound` x the mean after taking it
    (consistent hashing with bounded loads, Mirrokni et al. 2018), so one hot key cannot pile onto one
    replica. A replica joining or leaving moves only the keys next to its points. No key: least outstanding.
    """

    def __init__(self, load_bound: float = 1.25, num_points: int = 64) -> None:
        if load_bound < 1.0:
            raise ValueError(f"load_bound must be >= 1, got {load_bound}")
        self.load_bound = load_bound
        self.num_points = num_points
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}
        self._fallback = LeastOutstanding()

    def choose(self, candidates: Sequence[Candidate], key: str | None = None) -> Candidate:
        if key is None or len(candidates) == 1:
            return self._fallback.choose(candidates)
        by_id = {c.replica_id: c for c in candidates}
        points, owners = self._ring(tuple(sorted(by_id)))
        total = sum(c.outstanding for c in candidates) + 1  # counting this request
        cap = math.ceil(self.load_bound * total / len(candidates))
        start = bisect.bisect(points, _hash(key))
        for step in range(len(owners)):
            pick = by_id[owners[(start + step) % len(owners)]]
            if pick.outstanding + 1 <= cap:
                return pick
        raise AssertionError("unreachable: some replica is at or below the mean load")

    def _ring(self, replica_ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(replica_ids)
        if ring is None:
            if len(self._rings) > 64:  # replica sets change rarely; forget old ones
                self._rings.clear()
            pairs = sorted((_hash(f"{rid}#{i}"), rid) for rid in replica_ids for i in range(self.num_points))
            ring = self._rings[replica_ids] = ([p for p, _ in pairs], [r for _, r in pairs])
        return ring


def _hash(text: str) -> int:
    """A hash that is the same in every process and run (Python's `hash()` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


KEYED_POLICIES = frozenset({"prefix_affinity", "session"})  # the gateway passes them a routing key
POLICY_NAMES = ("round_robin", "least_outstanding", "power_of_two", "prefix_affinity", "session")


def make_policy(name: str, load_bound: float = 1.25) -> RoutingPolicy:
    """A fresh policy (each instance group keeps its own round-robin and ring state)."""
    if name in KEYED_POLICIES:
        return ConsistentHash(load_bound)
    simple: dict[str, Callable[[], RoutingPolicy]] = {
        "round_robin": RoundRobin, "least_outstanding": LeastOutstanding, "power_of_two": PowerOfTwo}
    if name not in simple:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    return simple[name]()
