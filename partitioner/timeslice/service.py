"""The time-slice arbiter of one shared device, served on a Unix domain socket to the replicas' worker processes.

The gateway (the pool's process) runs one `ArbiterService` per device that several replicas time-share; each
worker's `arbiter_client.LeaseClient` connects, says hello with its id and weight, and takes a lease around
every engine step. One thread per service runs a `selectors` loop: it wakes only on messages, so an idle
device costs nothing, and a grant is one write on the waiting client's socket.

Wire protocol, ASCII lines (client -> service):
  `H <weight> <client_id>`   hello: register (once per connection; the connection is the client's lifetime)
  `A`                        acquire: the service answers `G` when the lease is the client's
  `R <busy_s> <0|1>`         release after a step that held the device `busy_s`; 1: queue me for the next step
                             at once (the answer is a `G` when it is my turn again)
  `S`                        stats: the service answers `J <json>` (any connection; `partition status` uses it)
A malformed line gets `E <message>` and the connection is closed. A closed connection unregisters its client,
and a lease it held passes on; so does a lease held past `max_lease_s` (see `arbiter.TimeSliceArbiter`).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import structlog

from partitioner.timeslice.arbiter import ClientShare, TimeSliceArbiter

log = structlog.get_logger(__name__)


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.client_id: str | None = None


class ArbiterService:
    """Serves one device's `TimeSliceArbiter` at `socket_path` from a thread of its own. `start()`, `close()`."""

    def __init__(self, socket_path: str | Path, device_key: str, clock: Callable[[], float] = time.monotonic,
                 share_window_s: float = 10.0, max_lease_s: float = 30.0) -> None:
        self.socket_path = Path(socket_path)
        self.device_key = device_key
        self._clock = clock
        self._arbiter = TimeSliceArbiter(clock, share_window_s, max_lease_s)
        self._lock = threading.Lock()  # the arbiter's state is read by scrapes from other threads
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: dict[str, _Conn] = {}  # by client id, to send grants
        self._thread: threading.Thread | None = None
        self._closing = False

    def start(self) -> ArbiterService:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # a stale socket of an earlier run; nobody listens on it any more
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)  # only our user's workers may take leases
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name=f"arbiter-{self.device_key}", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        self._closing = True
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout_s)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def shares(self) -> list[ClientShare]:
        with self._lock:
            return self._arbiter.shares()

    # ------------------------------------------------------------------------------------ service thread

    def _serve(self) -> None:
        try:
            while not self._closing:
                for key, _ in self._selector.select(self._expire_due_lease()):
                    if key.data == "wake":
                        continue
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
        finally:
            for conn in list(self._selector.get_map().values()):
                conn.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_w.close()

    def _expire_due_lease(self) -> float | None:
        """Pass on a lease held past max_lease_s; the select timeout until the current lease is due (none while
        nobody holds it, so an idle device costs nothing)."""
        with self._lock:
            late = self._arbiter.holder
            granted = self._arbiter.expire()
            expired = self._arbiter.holder != late
            deadline = self._arbiter.lease_deadline()
        if expired:
            log.warning("arbiter_lease_expired", device=self.device_key, client=late,
                        max_lease_s=self._arbiter.max_lease_s, granted=granted)
            self._send_grant(granted)  # may pass the lease on again (a client that went away)
            with self._lock:
                deadline = self._arbiter.lease_deadline()
        return None if deadline is None else max(0.0, deadline - self._clock())

    def _accept(self) -> None:
        assert self._listener is not None
        with contextlib.suppress(BlockingIOError):
            sock, _ = self._listener.accept()
            sock.setblocking(True)  # replies are a few bytes to a reader that waits for them: writes never block
            self._selector.register(sock, selectors.EVENT_READ, _Conn(sock))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.buffer += data
        while b"\n" in conn.buffer:
            line, conn.buffer = conn.buffer.split(b"\n", 1)
            try:
                self._handle(conn, line.decode())
            except (ValueError, KeyError, RuntimeError) as exc:  # a client broke the protocol: tell it, drop it
                with contextlib.suppress(OSError):
                    conn.sock.sendall(f"E {exc}\n".encode())
                self._drop(conn)
                return

    def _handle(self, conn: _Conn, line: str) -> None:
        op, _, rest = line.partition(" ")
        if op == "S":
            stats = {"device": self.device_key, "clients": [asdict(s) for s in self.shares()]}
            conn.sock.sendall(f"J {json.dumps(stats)}\n".encode())
            return
        if op == "H":
            weight, _, client_id = rest.partition(" ")
            if not client_id or conn.client_id is not None or client_id in self._conns:
                raise ValueError(f"bad hello {line!r} (one hello per connection, ids unique)")
            with self._lock:
                self._arbiter.register(client_id, float(weight))
            conn.client_id = client_id
            self._conns[client_id] = conn
            return
        if conn.client_id is None:
            raise ValueError(f"{line!r} before hello")
        with self._lock:
            if op == "A":
                granted = self._arbiter.request(conn.client_id)
            elif op == "R":
                busy_s, _, more = rest.partition(" ")
                granted = self._arbiter.release(conn.client_id, float(busy_s), more == "1")
            else:
                raise ValueError(f"unknown message {line!r}")
        self._send_grant(granted)

    def _send_grant(self, client_id: str | None) -> None:
        if client_id is None:
            return
        try:
            self._conns[client_id].sock.sendall(b"G\n")
        except OSError:  # it went away between asking and being granted: pass the lease on
            self._drop(self._conns[client_id])

    def _drop(self, conn: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
        if conn.client_id is None or self._conns.get(conn.client_id) is not conn:
            return
        del self._conns[conn.client_id]
        with self._lock:
            granted = self._arbiter.unregister(conn.client_id)
        self._send_grant(granted)


def read_stats(socket_path: str | Path, timeout_s: float = 1.0) -> dict:
    """One `S` round trip to a running service: `{"device": ..., "clients": [ClientShare fields...]}`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(socket_path))
        sock.sendall(b"S\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"{socket_path}: the arbiter closed the connection")
            data += chunk
    if not data.startswith(b"J "):
        raise ConnectionError(f"{socket_path}: unexpected answer {data[:80]!r}")
    return dict(json.loads(data[2:]))
