"""Drive planned requests at a server: open loop (arrivals at a rate, optionally capped in flight) or closed loop
(a fixed number in flight). Warm-up requests run first and are not measured; a duration bound stops new sends.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from bench.arrivals import arrival_offsets
from bench.client import Target, send_streaming
from bench.stats import RequestResult
from bench.workloads import PlannedRequest


@dataclass(frozen=True)
class LoadSpec:
    """How hard to push. `rate_per_s` None: closed loop at `concurrency`; else open loop, `concurrency` (if set)
    capping requests in flight (an arrival waits for a slot, and its clock starts when it is sent, as in vLLM's
    `--max-concurrency`)."""

    rate_per_s: float | None = None
    concurrency: int | None = None
    arrival: str = "poisson"  # poisson | gamma | constant | trace
    cv: float = 1.0  # gamma arrivals' coefficient of variation
    duration_s: float | None = None  # no new sends after this many seconds of the measured phase
    num_warmup: int = 0

    def __post_init__(self) -> None:
        if self.rate_per_s is None and self.arrival != "trace" and not self.concurrency:
            raise ValueError("give a rate (open loop), a concurrency (closed loop) or a trace")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @property
    def label(self) -> str:
        if self.arrival == "trace":
            return "trace"
        if self.rate_per_s is None:
            return f"c={self.concurrency}"
        return f"{self.rate_per_s:g} req/s {self.arrival}" + (f" (c<={self.concurrency})" if self.concurrency else "")


@dataclass
class LoadResult:
    results: list[RequestResult]  # measured requests only, in completion order
    duration_s: float  # first measured send -> last measured finish


Send = Callable[[PlannedRequest], Awaitable[RequestResult]]


class LoadGenerator:
    """Runs one load level. Clock, sleep and the random source are injected (tests pass fakes)."""

    def __init__(self, send: Send, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, progress: bool = True) -> None:
        self.send, self.clock, self.sleep, self.progress = send, clock, sleep, progress

    async def run(self, planned: Sequence[PlannedRequest], load: LoadSpec, rng: random.Random) -> LoadResult:
        warmup, measured = planned[:load.num_warmup], planned[load.num_warmup:]
        if warmup:
            await self._closed(warmup, load.concurrency or 1, None, None)
        bar = tqdm(total=len(measured), desc=f"bench {load.label}", unit="req", disable=not self.progress,
                   leave=False)
        start = self.clock()
        try:
            if load.arrival == "trace":
                offsets = [p.offset_s or 0.0 for p in measured]
                results = await self._open(measured, offsets, load, bar)
            elif load.rate_per_s is not None:
                offsets = arrival_offsets(load.arrival, load.rate_per_s, len(measured), rng, load.cv)
                results = await self._open(measured, offsets, load, bar)
            else:
                results = await self._closed(measured, load.concurrency or 1, load.duration_s, bar)
        finally:
            bar.close()
        end = max((r.sent_s + (r.e2e_s or 0.0) for r in results), default=self.clock())
        return LoadResult(results, max(end - start, 1e-9))

    async def _closed(self, planned: Sequence[PlannedRequest], concurrency: int, duration_s: float | None,
                      bar: tqdm | None) -> list[RequestResult]:
        pending = iter(planned)  # shared: each worker takes the next request when its own ends
        results: list[RequestResult] = []
        stop_at = None if duration_s is None else self.clock() + duration_s

        async def worker() -> None:
            for plan in pending:
                if stop_at is not None and self.clock() >= stop_at:
                    return
                results.append(await self.send(plan))
                if bar is not None:
                    bar.update()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results

    async def _open(self, planned: Sequence[PlannedRequest], offsets: Sequence[float], load: LoadSpec,
                    bar: tqdm) -> list[RequestResult]:
        slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None
        results: list[RequestResult] = []
        start = self.clock()

        async def one(plan: PlannedRequest) -> None:
            if slots is None:
                results.append(await self.send(plan))
            else:
                async with slots:
                    results.append(await self.send(plan))
            bar.update()

        tasks = []
        for plan, offset_s in zip(planned, offsets, strict=True):
            if load.duration_s is not None and offset_s > load.duration_s:
                break
            delay_s = start + offset_s - self.clock()
            if delay_s > 0:
                await self.sleep(delay_s)
            tasks.append(asyncio.create_task(one(plan)))
        await asyncio.gather(*tasks)
        return results


def http_sender(http: httpx.AsyncClient, target: Target, clock: Callable[[], float] = time.perf_counter) -> Send:
    """The real `send`: one streamed request per planned request."""

    async def send(plan: PlannedRequest) -> RequestResult:
        return await send_streaming(http, target, plan.prompt, plan.max_tokens, clock)

    return send
