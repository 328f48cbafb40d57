"""Weighted time-slicing of one device between co-located replicas: the scheduling core, with no I/O.

Before each engine step a replica asks for the device's lease; one replica holds it at a time. The core is
start-time fair queuing (SFQ) on *measured* step time: a client's tag advances by `busy_s / weight` for each
step it ran, and the waiting client with the smallest tag goes next. So two saturating clients with weights
3 and 1 get 75 % / 25 % of device time, whatever their step lengths.

- Work-conserving: the lease never waits for an absent client; whoever is waiting gets it.
- No banked credit: a client that comes back from idle starts at the system's virtual time (the tag of the
  step last granted), never below it, so idling does not buy it a burst later.
- A client that will step again right away says so at release (`more=True`) and is queued in the same
  breath. Without that, the other client would slip in during every short gap between a busy client's steps
  and the shares would drift towards one step each.
- A lease held past `max_lease_s` (a hung step, a stopped process) expires: the next client is granted and
  the late one is charged in full when its release finally comes. One stuck replica must not freeze every
  replica that shares its device; for that while, two run at once, as without an arbiter.

`request`, `release` and `unregister` return the client granted by that event (or None): the transport
(`arbiter_service`) sends it the grant. The clock is injected; tests drive the core with a fake one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Client:
    client_id: str
    weight: float
    order: int  # registration order: the tie-break between equal tags, so scheduling is deterministic
    finish_tag: float = 0.0  # virtual time at which its last step ended
    start_tag: float = 0.0  # tag of its queued (or running) step
    waiting: bool = False
    busy_s: float = 0.0  # all device time it held (as measured by the client)
    num_steps: int = 0
    recent_busy_s: float = 0.0  # busy time decayed over the share window, as of `recent_at`
    recent_at: float = 0.0
    num_expired: int = 0  # leases it held past max_lease_s


@dataclass(frozen=True)
class ClientShare:
    """What one client got: totals, and its share of device time over the recent window."""

    client_id: str
    weight: float
    busy_s: float
    num_steps: int
    recent_share: float  # of the busy time all clients had in the window (0 when nobody ran)
    waiting: bool
    holding: bool
    num_expired: int  # leases it held so long that they expired and passed on


class TimeSliceArbiter:
    """The lease of one device. Not thread-safe: its one owner (the service's thread, or a test) calls it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, share_window_s: float = 10.0,
                 max_lease_s: float = 30.0) -> None:
        if share_window_s <= 0:
            raise ValueError(f"share_window_s must be > 0, got {share_window_s}")
        if not max_lease_s > 0:
            raise ValueError(f"max_lease_s must be > 0, got {max_lease_s}")
        self._clock = clock
        self._window_s = share_window_s
        self.max_lease_s = max_lease_s
        self._overdue: set[str] = set()  # clients whose lease expired and who have not released it yet
        self._holder_since = 0.0  # when the holder was granted the lease (meaningful while there is one)
        self._clients: dict[str, _Client] = {}
        self._next_order = 0
        self._vtime = 0.0  # the system's virtual time: the start tag of the step last granted
        self.holder: str | None = None

    def register(self, client_id: str, weight: float) -> None:
        """Add a client (or change its weight). A newcomer starts at the current virtual time."""
        if not weight > 0 or not math.isfinite(weight):
            raise ValueError(f"{client_id}: weight must be a positive number, got {weight}")
        client = self._clients.get(client_id)
        if client is not None:
            client.weight = weight
            return
        self._clients[client_id] = _Client(client_id, weight, self._next_order, finish_tag=self._vtime,
                                           recent_at=self._clock())
        self._next_order += 1

    def unregister(self, client_id: str) -> str | None:
        """Forget a client (its process went away); a lease it held passes on."""
        self._clients.pop(client_id, None)
        self._overdue.discard(client_id)
        if self.holder == client_id:
            self.holder = None
            return self._grant()
        return None

    def request(self, client_id: str) -> str | None:
        """`client_id` wants the lease for one step. Returns who is granted now (maybe it), or None."""
        client = self._client(client_id)
        if self.holder == client_id or client_id in self._overdue:
            raise RuntimeError(f"{client_id} asked for the lease it already holds")
        if not client.waiting:
            self._enqueue(client)
        return self._grant() if self.holder is None else None

    def release(self, client_id: str, busy_s: float, more: bool = False) -> str | None:
        """The holder ran one step for `busy_s` seconds; `more`: it will ask again at once (queue it now)."""
        late = client_id in self._overdue
        if self.holder != client_id and not late:
            raise RuntimeError(f"{client_id} released a lease it does not hold (holder: {self.holder})")
        client = self._client(client_id)
        busy_s = max(0.0, busy_s)
        client.finish_tag = client.start_tag + busy_s / client.weight
        client.busy_s += busy_s
        client.num_steps += 1
        self._decay(client)
        client.recent_busy_s += busy_s
        if more:
            self._enqueue(client)
        if late:  # its lease passed on when it expired; whoever holds the device now keeps it
            self._overdue.discard(client_id)
            return self._grant() if self.holder is None else None
        self.holder = None
        return self._grant()

    def lease_deadline(self) -> float | None:
        """When the current lease expires (on the arbiter's clock), or None when nobody holds the device."""
        return None if self.holder is None else self._holder_since + self.max_lease_s

    def expire(self) -> str | None:
        """Pass the lease on if its holder kept it past `max_lease_s`. Returns who is granted now, or None."""
        deadline = self.lease_deadline()
        if deadline is None or self._clock() < deadline:
            return None
        assert self.holder is not None
        late = self._clients[self.holder]
        late.num_expired += 1
        self._overdue.add(late.client_id)
        self.holder = None
        return self._grant()

    def shares(self) -> list[ClientShare]:
        """Every client's totals and recent share, in registration order."""
        clients = sorted(self._clients.values(), key=lambda c: c.order)
        for client in clients:
            self._decay(client)
        total = sum(c.recent_busy_s for c in clients)
        return [ClientShare(c.client_id, c.weight, c.busy_s, c.num_steps,
                            c.recent_busy_s / total if total > 0 else 0.0, c.waiting, c.client_id == self.holder,
                            c.num_expired)
                for c in clients]

    def _enqueue(self, client: _Client) -> None:
        client.waiting = True
        client.start_tag = max(client.finish_tag, self._vtime)  # back from idle: no banked credit

    def _grant(self) -> str | None:
        waiting = [c for c in self._clients.values() if c.waiting]
        if not waiting:
            return None
        nxt = min(waiting, key=lambda c: (c.start_tag, c.order))
        nxt.waiting = False
        self._holder_since = self._clock()
        self._vtime = max(self._vtime, nxt.start_tag)
        self.holder = nxt.client_id
        return nxt.client_id

    def _decay(self, client: _Client) -> None:
        """Exponential decay over the share window, so `recent_share` follows what happens now."""
        now = self._clock()
        client.recent_busy_s *= math.exp(-max(0.0, now - client.recent_at) / self._window_s)
        client.recent_at = now

    def _client(self, client_id: str) -> _Client:
        client = self._clients.get(client_id)
        if client is None:
            raise KeyError(f"unknown arbiter client {client_id!r} (registered: {sorted(self._clients)})")
        return client
