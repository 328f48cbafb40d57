"""A worker's side of the time-slice arbiter: a small blocking client that is the engine loop's step gate.

`acquire()` before an engine step blocks until the device's lease is ours; `release(more)` after it reports
how long we held the device (measured here, on our own clock) and whether we step again at once. It has the
shape of `runtimes.engine_driver.StepGate` without importing it (runtimes never import the partitioner).

Standard library only: a worker process loads it next to its engine, and one step costs one message out and
one line back on a Unix socket (see docs/partitioner.md for the measured overhead).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from pathlib import Path


class ArbiterError(ConnectionError):
    """The arbiter service refused us or went away; the message says which socket and what it said."""


class LeaseClient:
    """One replica's connection to its device's arbiter (`arbiter_service.ArbiterService`)."""

    def __init__(self, socket_path: str | Path, client_id: str, weight: float,
                 clock: Callable[[], float] = time.perf_counter, connect_timeout_s: float = 5.0) -> None:
        if " " in client_id or not client_id:
            raise ValueError(f"arbiter client id must be non-empty without spaces, got {client_id!r}")
        self.socket_path = str(socket_path)
        self.client_id = client_id
        self.weight = weight
        self._clock = clock
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout_s)
        try:
            self._sock.connect(self.socket_path)
        except OSError as exc:
            self._sock.close()
            raise ArbiterError(f"cannot reach the time-slice arbiter at {self.socket_path}: {exc}") from None
        self._sock.settimeout(None)  # a grant may take as long as the other replicas' steps: wait for it
        self._buffer = b""
        self._queued = False  # the last release said `more`: the service already queued us
        self._granted_at: float | None = None
        self._send(f"H {weight!r} {client_id}\n")

    def acquire(self) -> None:
        """Block until this replica holds the device."""
        if self._granted_at is not None:
            raise RuntimeError(f"{self.client_id}: acquire() while holding the lease")
        if not self._queued:
            self._send("A\n")
        self._queued = False
        answer = self._read_line()
        if answer != "G":
            raise ArbiterError(f"arbiter at {self.socket_path} answered {answer!r} to {self.client_id}'s acquire")
        self._granted_at = self._clock()

    def release(self, more: bool = False) -> None:
        """The step is done; `more`: this replica steps again right away (it stays in the queue)."""
        if self._granted_at is None:
            raise RuntimeError(f"{self.client_id}: release() without holding the lease")
        busy_s = self._clock() - self._granted_at
        self._granted_at = None
        self._send(f"R {busy_s:.9f} {1 if more else 0}\n")
        self._queued = more

    def close(self) -> None:
        """Leave the arbiter (the service unregisters us and passes on a lease we held)."""
        self._sock.close()

    def _send(self, line: str) -> None:
        try:
            self._sock.sendall(line.encode())
        except OSError as exc:
            # The service answers a protocol error with `E <why>` and then closes: when our write comes after
            # the close, the reason is still waiting in our receive buffer, and it says more than EPIPE.
            said = self._last_words()
            if said is not None:
                raise ArbiterError(f"arbiter at {self.socket_path} answered {said!r} to {self.client_id}") from None
            raise ArbiterError(f"lost the time-slice arbiter at {self.socket_path}: {exc}") from None

    def _last_words(self) -> str | None:
        """A line the service sent before it closed on us, if one is there to read."""
        self._sock.settimeout(0.2)
        try:
            return self._read_line()
        except ArbiterError:
            return None
        finally:
            with contextlib.suppress(OSError):
                self._sock.settimeout(None)

    def _read_line(self) -> str:
        while b"\n" not in self._buffer:
            try:
                chunk = self._sock.recv(256)
            except OSError as exc:
                raise ArbiterError(f"lost the time-slice arbiter at {self.socket_path}: {exc}") from None
            if not chunk:
                raise ArbiterError(f"the time-slice arbiter at {self.socket_path} closed the connection")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()
