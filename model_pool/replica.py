"""A replica as the pool and gateway see it: where it is, its state, load and health record."""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from foundation.http.replica_auth import bearer
from model_pool.health import CircuitBreaker
from model_pool.launcher import ReplicaHandle
from registry.launch import Footprint


class ReplicaState(enum.Enum):
    STARTING = "starting"  # launched, /ready not yet 200
    READY = "ready"
    UNHEALTHY = "unhealthy"  # probes failing; restarted if its process died
    DRAINING = "draining"  # no new requests; in-flight ones finish
    STOPPED = "stopped"
    FAILED = "failed"  # crash-looping: given up on


@dataclass
class Replica:
    replica_id: str  # "<model>/<index>"
    model: str
    index: int
    breaker: CircuitBreaker
    handle: ReplicaHandle | None = None
    state: ReplicaState = ReplicaState.STARTING
    outstanding: int = 0  # requests in flight through this gateway
    last_probe_at: float | None = None
    last_probe_ok: bool | None = None
    consecutive_failures: int = 0
    restarts: int = 0
    crash_times: deque[float] = field(default_factory=lambda: deque(maxlen=16))
    transitions: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=32))
    manually_drained: bool = False
    # drained with migration while no other replica of its group could take its streams: they finish here, or move
    # once one can (the pool moves them then)
    migration_waiting: bool = False
    state_since: float = 0.0  # the pool's clock when `state` was last changed
    probe_path: str = "/ready"  # what answers 200 once it serves (a command replica's server: its health path)
    ready_timeout_s: float = 180.0  # not ready this long after its launch: a failed start (set at each launch)
    # streams relayed from this replica that can go on elsewhere: each callback asks its relay to move
    movable: set[Callable[[], None]] = field(default_factory=set)
    footprint: Footprint = field(default_factory=Footprint)  # what it holds of its device's memory budget
    stopping: bool = False  # being stopped by the pool (retired, unloaded, evicted): its memory frees soon
    last_used: float = 0.0  # the pool's clock at its launch and at each request's start and end (idleness)
    # the pool's clock at its last two requests' starts: eviction goes by the older (`eviction_key`)
    request_starts: deque[float] = field(default_factory=lambda: deque(maxlen=2))

    def migrate_streams(self) -> int:
        """Ask every movable stream to continue on another replica; returns how many were asked."""
        self.migration_waiting = False
        movers = list(self.movable)
        for move in movers:
            move()
        return len(movers)

    @property
    def base_url(self) -> str:
        if self.handle is None:
            raise RuntimeError(f"replica {self.replica_id} has not been launched")
        return self.handle.base_url

    @property
    def display_url(self) -> str | None:
        """The URL with any credentials blanked: for logs, /health/models and metrics."""
        return None if self.handle is None else redact_url(self.handle.base_url)

    def auth_headers(self) -> dict[str, str]:
        """What every request to this replica carries: its launch token, if it has one."""
        return {} if self.handle is None else bearer(self.handle.token)

    def routable(self) -> bool:
        return self.state == ReplicaState.READY and self.breaker.allows_request()

    @property
    def unhealthy_since(self) -> float | None:
        """The pool's clock when the replica became UNHEALTHY; None while it is in any other state."""
        return self.state_since if self.state == ReplicaState.UNHEALTHY else None

    def set_state(self, state: ReplicaState, now: float) -> None:
        """`now` is the pool's (monotonic) clock; transitions are recorded in wall time for people to read."""
        if state != self.state:
            self.state, self.state_since = state, now
            self.transitions.append((time.time(), state.value))

    def snapshot(self) -> dict[str, Any]:
        """What GET /health/models shows for this replica."""
        return {
            "id": self.replica_id,
            "url": self.display_url,
            "pid": None if self.handle is None else self.handle.pid,
            "state": self.state.value,
            "last_probe_at": self.last_probe_at,
            "last_probe_ok": self.last_probe_ok,
            "consecutive_failures": self.consecutive_failures,
            "breaker": self.breaker.state.value,
            "in_flight": self.outstanding,
            "migration_waiting": self.migration_waiting,
            "restarts": self.restarts,
            "memory_bytes": self.footprint.bytes,
            "device": self.footprint.device,
            "transitions": [{"at": t, "state": s} for t, s in self.transitions],
        }


class Lease:
    """One request's hold on a replica, from dispatch to the end of its reply. Only leases move a replica's
    in-flight count and feed its circuit breaker: counted while held; `succeeded()` or `failed()` says how it went
    (a sane refusal, such as a full queue, is a success: the replica answered). A stream's lease is handed to the
    code that relays it, which releases it at the stream's end; `async with` releases it on leaving."""

    def __init__(self, replica: Replica, clock: Callable[[], float] | None = None) -> None:
        self.replica = replica
        self._held = True
        self._mover: Callable[[], None] | None = None
        self._clock = clock  # the pool's: marks the replica used at the start and the end
        replica.outstanding += 1
        replica.breaker.on_dispatch()
        if clock is not None:
            replica.last_used = clock()
            replica.request_starts.append(replica.last_used)

    def movable(self, move: Callable[[], None]) -> None:
        """While held, `move()` is called if the replica is drained with migration."""
        self._mover = move
        self.replica.movable.add(move)

    def succeeded(self) -> None:
        self.replica.breaker.record_success()

    def failed(self) -> None:
        self.replica.breaker.record_failure()

    def release(self) -> None:
        """No longer in flight (idempotent)."""
        if self._held:
            self._held = False
            self.replica.outstanding -= 1
            if self._clock is not None:
                self.replica.last_used = self._clock()
            if self._mover is not None:
                self.replica.movable.discard(self._mover)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


def redact_url(url: str) -> str:
    """`http://user:secret@host:8000/x` -> `http://***@host:8000/x`; a URL without credentials is unchanged."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))
