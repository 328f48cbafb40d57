"""Readiness of one replica: the startup probe, the draining flag, and why it is not ready.

A replica is ready once a startup probe (a 1-token generation, or one embedding) went end to end through the
engine thread,
and stays ready unless it is draining (a pool stops sending it work), its engine died, or its engine loop is
stuck: no step finished and no wait for work began for `stall_timeout_s` (a hung kernel, a deadlock). A stuck
replica also refuses new work (503), so its pool stops routing to it and, after a while, restarts it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import anyio
import structlog

log = structlog.get_logger(__name__)


class EngineLiveness(Protocol):
    """What readiness reads of an engine's async face (the LLM's or the embedding one's)."""

    dead_error: BaseException | None

    def stalled_s(self) -> float:
        """Seconds since the engine loop last showed progress (a step returned, or it waited for work)."""


@dataclass
class Readiness:
    """Mutable on purpose: the lifespan sets `ready`/`failure`, an operator or pool sets `draining`."""

    ready: bool = False  # the startup probe passed
    draining: bool = False  # refuse new requests; in-flight ones finish
    failure: str | None = None  # why the startup probe failed
    stall_timeout_s: float = 60.0  # longer than any sane step (a long prefill on CPU takes seconds)

    def unready_reason(self, engine: EngineLiveness) -> str | None:
        """None when ready; otherwise what an operator should read in /ready's 503."""
        if engine.dead_error is not None:
            return f"the engine thread died: {engine.dead_error!r}"
        stalled_s = engine.stalled_s()
        if stalled_s > self.stall_timeout_s:
            return (f"stalled: the engine loop has made no progress for {stalled_s:.0f} s "
                    f"(limit {self.stall_timeout_s:g} s)")
        if self.failure is not None:
            return self.failure
        if self.draining:
            return "draining: this replica takes no new requests"
        if not self.ready:
            return "loading: the startup probe has not passed yet"
        return None

    def refusal(self, engine: EngineLiveness) -> str | None:
        """Why a new request must be refused (503); a replica still warming up accepts work."""
        reason = self.unready_reason(engine)
        return None if reason is None or reason.startswith("loading") else reason


class ProbeFailed(Exception):
    """The engine answered the startup probe, but wrongly (no token, a vector of the wrong shape)."""


async def run_startup_probe(check: Callable[[], Awaitable[None]], state: Readiness, timeout_s: float,
                            model: str) -> None:
    """Run `check()`, one unit of work end to end through the engine thread that raises unless its result is
    right (each app has its own: one generated token, one finite vector); mark the replica ready, or record why
    it is broken.

    Any failure (bad weights, a dead engine thread, a timeout) must show up in /ready instead of killing the
    server, so it is recorded and logged here rather than raised.
    """
    try:
        with anyio.fail_after(timeout_s):
            await check()
    except Exception as exc:
        state.failure = f"startup probe failed: {exc!r}"
        log.exception("startup probe failed")
        return
    state.ready = True
    log.info("replica ready", model=model)
