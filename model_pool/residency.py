"""Which replicas may be resident at once: each device's memory budget, what the running replicas hold of it, and
which idle replicas to evict for a new one (least recently used first, by their second most recent request).
Decisions only: the pool acts on them.

A replica holds its footprint (`Footprint`, the planner's memory model) from its launch until its process is gone:
starting, ready, unhealthy (a restart is due) and draining replicas all count, so a replica being stopped to make
room is still counted until it has stopped, and the budget is never exceeded on the way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from model_pool.replica import Replica, ReplicaState
from registry.fields import gib
from registry.launch import Footprint
from registry.schema import ModelSpec

# a replica in any of these states may have its process (and its memory) up
HOLDING = frozenset({ReplicaState.STARTING, ReplicaState.READY, ReplicaState.UNHEALTHY, ReplicaState.DRAINING})

BudgetFor = Callable[[str], int | None]  # device ("cpu", "0", ...) -> its budget in bytes (None: no limit)
FootprintFor = Callable[[ModelSpec, int], Footprint]  # (spec, replica index) -> what that replica holds


def budget_key_name(device: str) -> str:
    """Where a device's budget is set in the registry (for messages)."""
    return f"gateway.memory_budget_gib.{device}" if device == "cpu" else f'gateway.memory_budget_gib."{device}"'


def eviction_key(replica: Replica) -> tuple[float, float]:
    """The order replicas are evicted in, first first: least recently used by their second most recent request
    (LRU-2), so a model called once (a scan over the long tail) goes before one called steadily whose last request
    happens to be older; those with fewer than two requests go first, by their last use."""
    starts = replica.request_starts
    return (starts[0] if len(starts) == 2 else float("-inf"), replica.last_used)


def holds(replica: Replica) -> bool:
    """Whether `replica` counts against its device's budget now."""
    return replica.state in HOLDING and replica.footprint.bytes is not None


def held_bytes(replicas: Iterable[Replica], device: str) -> int:
    """What the replicas counted on `device` hold."""
    return sum(r.footprint.bytes or 0 for r in replicas if holds(r) and r.footprint.device == device)


@dataclass(frozen=True)
class Room:
    """Whether a footprint fits on its device: now (`fits` with no `victims`), after evicting `victims` (idle
    replicas, least recently used first), once replicas already stopping are gone (`wait`), or not."""

    fits: bool
    victims: tuple[Replica, ...] = ()
    wait: bool = False  # not now, but once the replicas the pool is stopping are gone (never a drained one)


def find_room(footprint: Footprint, budget: int | None, resident: Iterable[Replica],
              evictable: Iterable[Replica]) -> Room:
    """Room for `footprint` under `budget` among the `resident` replicas, evicting from `evictable` (on the same
    device, idle, above their model's resident floor) in `eviction_key` order, only as many as it takes."""
    if budget is None or footprint.bytes is None:
        return Room(True)
    replicas = list(resident)
    free = budget - held_bytes(replicas, footprint.device)
    if footprint.bytes <= free:
        return Room(True)
    stopping = held_bytes((r for r in replicas if r.stopping), footprint.device)
    if footprint.bytes <= free + stopping:  # being stopped already (evicted, retired): room once they are gone
        return Room(False, wait=True)
    victims = []
    for replica in sorted((r for r in evictable if holds(r) and r.footprint.device == footprint.device),
                          key=eviction_key):
        victims.append(replica)
        free += replica.footprint.bytes or 0
        if footprint.bytes <= free:
            return Room(True, tuple(victims))
    return Room(False)


def holders_text(replicas: Iterable[Replica], device: str, pinned: Callable[[Replica], bool]) -> str:
    """Who holds `device`'s budget, largest first: `chat/0 1.03 GiB (2 in flight)` ..."""
    held = sorted((r for r in replicas if holds(r) and r.footprint.device == device),
                  key=lambda r: -(r.footprint.bytes or 0))
    parts = []
    for r in held:
        why = ("pinned" if pinned(r) else f"{r.outstanding} in flight" if r.outstanding
               else r.state.value if r.state != ReplicaState.READY else "resident")
        parts.append(f"{r.replica_id} {gib(r.footprint.bytes or 0)} ({why})")
    return ", ".join(parts) or "nothing"


@dataclass
class ResidencyStats:
    """Counters the metrics read at scrape time: cold starts by (model, outcome), unloads by (model, reason)."""

    cold_starts: Counter[tuple[str, str]] = field(default_factory=Counter)
    unloads: Counter[tuple[str, str]] = field(default_factory=Counter)
