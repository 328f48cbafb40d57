"""The time-slice arbiter's core on a fake clock: weighted shares of measured step time, work conservation, no
banked credit for idle clients, and the protocol errors it refuses."""

from __future__ import annotations

import pytest

from partitioner.timeslice.arbiter import TimeSliceArbiter


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def simulate(arbiter: TimeSliceArbiter, clock: FakeClock, step_s: dict[str, float], busy: set[str],
             duration_s: float) -> dict[str, float]:
    """Clients in `busy` step back to back (each step `step_s[c]` long, `more=True`) for `duration_s` of fake
    time; returns the device time each one got. The lease must always be held while anyone is busy."""
    got = dict.fromkeys(step_s, 0.0)
    holder = arbiter.holder
    for client in sorted(busy):
        granted = arbiter.request(client) if client != holder else None
        holder = granted or holder
    end = clock.now_s + duration_s
    while clock.now_s < end:
        assert holder is not None, "work-conserving: somebody is busy, so somebody holds the lease"
        clock.now_s += step_s[holder]
        got[holder] += step_s[holder]
        holder = arbiter.release(holder, step_s[holder], more=holder in busy)
    if holder is not None:  # leave the device idle between phases
        arbiter.release(holder, 0.0, more=False)
    return got


def shares(got: dict[str, float]) -> dict[str, float]:
    total = sum(got.values())
    return {k: v / total for k, v in got.items()}


def two_clients(weight_a: float = 3.0, weight_b: float = 1.0) -> tuple[TimeSliceArbiter, FakeClock]:
    clock = FakeClock()
    arbiter = TimeSliceArbiter(clock, share_window_s=5.0)
    arbiter.register("a", weight_a)
    arbiter.register("b", weight_b)
    return arbiter, clock


@pytest.mark.parametrize(("step_a", "step_b"), [(0.010, 0.010), (0.002, 0.030), (0.040, 0.003)])
def test_saturating_clients_share_device_time_by_weight_whatever_their_step_lengths(step_a, step_b):
    arbiter, clock = two_clients()
    got = simulate(arbiter, clock, {"a": step_a, "b": step_b}, {"a", "b"}, duration_s=20.0)
    assert shares(got)["a"] == pytest.approx(0.75, abs=0.01)
    recent = {s.client_id: s.recent_share for s in arbiter.shares()}
    assert recent["a"] == pytest.approx(0.75, abs=0.02)


def test_an_idle_clients_share_goes_to_the_busy_one():
    arbiter, clock = two_clients()
    got = simulate(arbiter, clock, {"a": 0.01, "b": 0.01}, {"b"}, duration_s=5.0)  # a idle: b gets it all
    assert got == {"a": 0.0, "b": pytest.approx(5.0, abs=0.011)}
    assert {s.client_id: s.recent_share for s in arbiter.shares()} == {"a": 0.0, "b": 1.0}


def test_a_client_back_from_idle_gets_its_share_not_a_burst():
    arbiter, clock = two_clients(weight_a=1.0, weight_b=1.0)
    simulate(arbiter, clock, {"a": 0.01, "b": 0.01}, {"b"}, duration_s=30.0)  # b alone for a long time
    # had a banked 30 s of credit, it would run alone for ~30 s now; it gets its half from the first second on
    got = simulate(arbiter, clock, {"a": 0.01, "b": 0.01}, {"a", "b"}, duration_s=1.0)
    assert shares(got)["a"] == pytest.approx(0.5, abs=0.02)


def test_a_newcomer_starts_at_the_current_virtual_time():
    arbiter, clock = two_clients(weight_a=1.0, weight_b=1.0)
    simulate(arbiter, clock, {"a": 0.01, "b": 0.01}, {"a", "b"}, duration_s=10.0)
    arbiter.register("c", 2.0)
    got = simulate(arbiter, clock, {"a": 0.01, "b": 0.01, "c": 0.01}, {"a", "b", "c"}, duration_s=4.0)
    assert shares(got) == {"a": pytest.approx(0.25, abs=0.02), "b": pytest.approx(0.25, abs=0.02),
                           "c": pytest.approx(0.5, abs=0.02)}


def test_one_holder_at_a_time_and_grants_in_tag_order():
    arbiter, _ = two_clients()
    assert arbiter.request("a") == "a"  # free device: granted at once
    assert arbiter.request("b") is None  # a holds it
    assert arbiter.release("a", 0.03, more=True) == "b"  # a's tag is 0.01, b's 0.0: b goes first
    assert arbiter.release("b", 0.01, more=False) == "a"
    assert arbiter.release("a", 0.0) is None and arbiter.holder is None


def test_a_departing_holder_passes_the_lease_on():
    arbiter, _ = two_clients()
    arbiter.request("a")
    arbiter.request("b")
    assert arbiter.unregister("a") == "b"
    assert [s.client_id for s in arbiter.shares()] == ["b"]


def test_a_lease_held_too_long_expires_and_the_late_release_is_charged_in_full():
    clock = FakeClock()
    arbiter = TimeSliceArbiter(clock, share_window_s=5.0, max_lease_s=2.0)
    arbiter.register("stuck", 1.0)
    arbiter.register("b", 1.0)
    assert arbiter.request("stuck") == "stuck" and arbiter.lease_deadline() == 2.0
    assert arbiter.request("b") is None
    clock.now_s = 1.9
    assert arbiter.expire() is None and arbiter.holder == "stuck"  # not yet
    clock.now_s = 2.0
    assert arbiter.expire() == "b"  # b must not wait on a hung step
    assert arbiter.lease_deadline() == 4.0
    with pytest.raises(RuntimeError, match="stuck asked for the lease it already holds"):
        arbiter.request("stuck")  # it has not released yet: the client protocol still holds
    clock.now_s = 2.5
    assert arbiter.release("stuck", 2.5, more=True) is None  # late, and queued again: b keeps the device
    assert arbiter.holder == "b"
    assert arbiter.release("b", 0.5, more=True) == "b"  # stuck's tag is 2.5, b's 0.5: b goes on
    by_id = {s.client_id: s for s in arbiter.shares()}
    assert (by_id["stuck"].busy_s, by_id["stuck"].num_expired, by_id["stuck"].holding) == (2.5, 1, False)
    assert by_id["b"].num_expired == 0 and by_id["b"].holding


def test_an_expired_lease_with_nobody_waiting_leaves_the_device_free():
    clock = FakeClock()
    arbiter = TimeSliceArbiter(clock, max_lease_s=1.0)
    arbiter.register("a", 1.0)
    arbiter.request("a")
    clock.now_s = 5.0
    assert arbiter.expire() is None and arbiter.holder is None and arbiter.lease_deadline() is None
    assert arbiter.release("a", 5.0) is None and arbiter.holder is None
    assert arbiter.request("a") == "a"  # it can take the lease again
    with pytest.raises(ValueError, match="max_lease_s must be > 0"):
        TimeSliceArbiter(clock, max_lease_s=0.0)


def test_protocol_errors_name_the_client():
    arbiter, _ = two_clients()
    with pytest.raises(RuntimeError, match="b released a lease it does not hold"):
        arbiter.release("b", 0.01)
    arbiter.request("a")
    with pytest.raises(RuntimeError, match="a asked for the lease it already holds"):
        arbiter.request("a")
    with pytest.raises(KeyError, match="unknown arbiter client 'zz'"):
        arbiter.request("zz")
    with pytest.raises(ValueError, match="weight must be a positive number"):
        arbiter.register("d", 0.0)
