"""The arbiter over its Unix socket: hello, leases in turn, stats, clients that leave or break the protocol."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from partitioner.timeslice.client import ArbiterError, LeaseClient
from partitioner.timeslice.service import ArbiterService, read_stats


@pytest.fixture
def service(tmp_path):
    svc = ArbiterService(tmp_path / "run" / "cpu.sock", "cpu").start()
    yield svc
    svc.close()
    assert not svc.socket_path.exists()


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def by_id(service: ArbiterService) -> dict:
    return {s.client_id: s for s in service.shares()}


def test_leases_are_exclusive_and_accounted(service):
    a = LeaseClient(service.socket_path, "chat/0", 3.0)
    b = LeaseClient(service.socket_path, "emb/0", 1.0)
    a.acquire()
    got_b = threading.Event()

    def take_b() -> None:
        b.acquire()
        got_b.set()

    thread = threading.Thread(target=take_b)
    thread.start()
    wait_for(lambda: by_id(service).get("emb/0") is not None and by_id(service)["emb/0"].waiting)
    assert not got_b.is_set()  # a holds the device
    time.sleep(0.02)
    a.release(more=False)
    assert got_b.wait(5.0)
    b.release(more=False)
    thread.join()
    wait_for(lambda: by_id(service)["emb/0"].num_steps == 1)
    shares = by_id(service)
    assert shares["chat/0"].weight == 3.0 and shares["chat/0"].num_steps == 1
    assert shares["chat/0"].busy_s >= 0.02  # measured by the client: it held the lease at least that long
    stats = read_stats(service.socket_path)
    assert stats["device"] == "cpu" and [c["client_id"] for c in stats["clients"]] == ["chat/0", "emb/0"]
    a.close()
    b.close()
    wait_for(lambda: service.shares() == [])


def test_a_client_that_dies_holding_the_lease_passes_it_on(service):
    a = LeaseClient(service.socket_path, "a/0", 1.0)
    b = LeaseClient(service.socket_path, "b/0", 1.0)
    a.acquire()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (b.acquire(), done.set()))
    thread.start()
    wait_for(lambda: "b/0" in by_id(service) and by_id(service)["b/0"].waiting)
    a.close()  # the worker process died mid-step
    assert done.wait(5.0)
    thread.join()
    b.release()
    b.close()


def test_a_hung_holder_loses_the_lease_after_max_lease_s_and_may_release_late(tmp_path):
    service = ArbiterService(tmp_path / "hung.sock", "cpu", max_lease_s=0.2).start()
    hung = LeaseClient(service.socket_path, "hung/0", 1.0)
    other = LeaseClient(service.socket_path, "other/0", 1.0)
    try:
        hung.acquire()  # and then its step never ends...
        done = threading.Event()
        thread = threading.Thread(target=lambda: (other.acquire(), done.set()))
        thread.start()
        assert done.wait(5.0)  # ...yet the other replica gets the device once the lease expires
        thread.join()
        assert by_id(service)["hung/0"].num_expired == 1
        hung.release()  # the step finally ended: accepted and charged, no protocol error
        other.release()
        hung.acquire()  # and it takes turns as before
        hung.release()
        wait_for(lambda: by_id(service)["hung/0"].num_steps == 2)
    finally:
        hung.close()
        other.close()
        service.close()


def test_protocol_errors_close_the_connection(service):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(service.socket_path))
        raw.sendall(b"A\n")
        assert raw.recv(256).startswith(b"E 'A' before hello")
        assert raw.recv(256) == b""
    first = LeaseClient(service.socket_path, "x/0", 1.0)
    twin = LeaseClient(service.socket_path, "x/0", 1.0)  # the same id twice: refused at its first acquire
    try:
        # The service may close before or after the twin's `A` goes out: either way it reads the service's reason.
        with pytest.raises(ArbiterError, match=r"answered .E bad hello"):
            twin.acquire()
        first.acquire()
        first.release()
    finally:
        first.close()
        twin.close()


def test_a_write_after_the_service_closed_still_reports_its_reason(tmp_path):
    """The order that made the test above flaky, forced: the refusal and close land before the client writes."""
    path = tmp_path / "refuser.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def refuse() -> None:
        conn, _ = listener.accept()
        conn.recv(256)  # the hello
        conn.sendall(b"E no room for you\n")
        conn.close()

    server = threading.Thread(target=refuse)
    server.start()
    client = LeaseClient(path, "late/0", 1.0)
    try:
        server.join(5.0)
        with pytest.raises(ArbiterError, match=r"answered 'E no room for you' to late/0"):
            client.acquire()
    finally:
        client.close()
        listener.close()


def test_unreachable_arbiter_is_a_clear_error(tmp_path):
    with pytest.raises(ArbiterError, match=r"cannot reach the time-slice arbiter at .*nope\.sock"):
        LeaseClient(tmp_path / "nope.sock", "a/0", 1.0)
    with pytest.raises(ValueError, match="without spaces"):
        LeaseClient(tmp_path / "nope.sock", "a 0", 1.0)
