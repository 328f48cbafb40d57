"""Per-replica health: a circuit breaker fed by passive signals and active probes.

closed --K failures within window_s--> open --cooldown_s--> half_open --success--> closed
                                                                 \\--failure--> open
While half-open, one trial request (or the next probe) decides. The clock is injected.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 3
    window_s: float = 30.0
    cooldown_s: float = 5.0


class CircuitBreaker:
    def __init__(self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self._failures: deque[float] = deque()
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._state == BreakerState.OPEN and self._clock() - self._opened_at >= self.config.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
        return self._state

    def allows_request(self) -> bool:
        """Closed: yes. Half-open: one trial at a time. Open: no."""
        state = self.state
        if state == BreakerState.CLOSED:
            return True
        return state == BreakerState.HALF_OPEN and not self._trial_in_flight

    def on_dispatch(self) -> None:
        if self.state == BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def record_success(self) -> None:
        self._failures.clear()
        self._state = BreakerState.CLOSED
        self._trial_in_flight = False

    def record_failure(self) -> None:
        now = self._clock()
        if self.state == BreakerState.HALF_OPEN:
            self._open(now)
            return
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.config.window_s:
            self._failures.popleft()
        if len(self._failures) >= self.config.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._trial_in_flight = False
        self._failures.clear()
