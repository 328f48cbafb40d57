"""The load generator's schedules: open loop at the planned offsets, closed loop at a fixed concurrency, warm-up
excluded, duration bound; on a fake clock with a fake send (no server)."""

import asyncio
import random

import pytest

from bench.arrivals import arrival_offsets
from bench.loadgen import LoadGenerator, LoadSpec
from bench.stats import RequestResult
from bench.workloads import PlannedRequest


class FakeServer:
    """A send() whose requests take `service_s` of fake time; records when each was sent and the peak in flight."""

    def __init__(self, service_s: float = 0.0) -> None:
        self.now, self.service_s = 0.0, service_s
        self.sent: list[tuple[str, float]] = []
        self.in_flight = self.peak_in_flight = 0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)  # what is ready runs first, at the present time
        self.now += seconds

    async def send(self, plan: PlannedRequest) -> RequestResult:
        self.sent.append((plan.prompt, self.now))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        start = self.now
        for _ in range(3):  # let other requests start while this one is "running"
            await asyncio.sleep(0)
        self.in_flight -= 1
        return RequestResult(sent_s=start, status=200, num_output_tokens=2, ttft_s=0.01, e2e_s=self.service_s)


def plans(n: int) -> list[PlannedRequest]:
    return [PlannedRequest(f"p{i}", 8, 2) for i in range(n)]


def run(server: FakeServer, planned, load, seed=0):
    generator = LoadGenerator(server.send, clock=server.clock, sleep=server.sleep, progress=False)
    return asyncio.run(generator.run(planned, load, random.Random(seed)))


def test_open_loop_sends_at_the_arrival_offsets():
    server = FakeServer()
    outcome = run(server, plans(20), LoadSpec(rate_per_s=5.0, arrival="poisson"), seed=3)
    expected = arrival_offsets("poisson", 5.0, 20, random.Random(3))
    assert [t for _, t in server.sent] == pytest.approx(expected)
    assert len(outcome.results) == 20


def test_warmup_requests_run_first_and_are_not_measured():
    server = FakeServer()
    outcome = run(server, plans(7), LoadSpec(concurrency=2, num_warmup=3))
    assert [p for p, _ in server.sent[:3]] == ["p0", "p1", "p2"]
    assert len(outcome.results) == 4


def test_closed_loop_keeps_concurrency_in_flight():
    server = FakeServer()
    run(server, plans(12), LoadSpec(concurrency=3))
    assert server.peak_in_flight == 3
    assert len(server.sent) == 12


def test_concurrency_caps_an_open_loop():
    server = FakeServer()
    run(server, plans(30), LoadSpec(rate_per_s=1000.0, concurrency=2))
    assert server.peak_in_flight <= 2


def test_duration_bounds_an_open_loop():
    server = FakeServer()
    outcome = run(server, plans(100), LoadSpec(rate_per_s=10.0, arrival="constant", duration_s=2.0))
    assert len(outcome.results) == 20  # arrivals at 0.1 … 2.0 s


def test_trace_offsets_drive_the_schedule():
    server = FakeServer()
    planned = [PlannedRequest("a", 4, 2, offset_s=0.0), PlannedRequest("b", 4, 2, offset_s=1.5)]
    run(server, planned, LoadSpec(arrival="trace"))
    assert server.sent == [("a", 0.0), ("b", 1.5)]


def test_a_load_needs_a_rate_a_concurrency_or_a_trace():
    with pytest.raises(ValueError, match="rate"):
        LoadSpec()
