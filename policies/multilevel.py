"""Multi-level queue policy for the engine scheduler: interactive, normal and background lanes.

A request's lane is its `priority` (0 interactive, 1 normal, 2 background; the classifier in
`policies/classify.py` decides it). Rules, in order:

- Within a lane: first come, first served; preempted requests return to the front of their lane.
- Across lanes: the most urgent non-empty lane goes first, except that
  * waiting promotes (aging): every `aging_s` a request has waited lifts it one lane, background at most to
    just above normal (never ahead of interactive: see `_next`);
  * normal keeps a minimum share: when normal's share of recently scheduled tokens is below
    `normal_min_share` and normal has work waiting, normal goes before interactive;
  * background only runs on idle capacity: it is admitted only when no other lane is waiting.
- Preemption: the victim is the least urgent, newest running request; an interactive arrival that
  cannot be admitted may preempt a running normal or background request (`urgent_victim`).
- Urgent steps: an interactive arrival (first admission) starts in a step of its own: the running requests'
  decodes skip that step, so its first token waits for one short prefill instead of a prefill inside a full
  decode batch; also when a normal request goes first in ordinary admission (`urgent_head`, not `peek`). At most
  `urgent_step_max_share` of recent steps (`share_window_steps`) are such steps, so a stream of interactive
  arrivals slows the others' decoding by at most that much.
- Short steps while interactive traffic is about (off by default): with `busy_chunk_tokens` set, for `busy_window_s`
  after an interactive arrival, normal and background prompt chunks take at most that many tokens per step, so the
  step an arrival must wait for (it cannot be interrupted) stays short. Prefill of other lanes goes on in smaller
  pieces, so more steps carry a chunk: on SmolLM2 at 32 tokens, interactive TTFT p99 fell ~20 % and the median
  inter-token latency doubled (docs/benchmarks.md).
- Long requests (prompts of `long_prompt_tokens` or more) form their own lane inside each level: at most
  `max_long_running` of them run at once, so a burst of documents cannot fill every slot; the others
  wait while shorter requests behind them go first.

Pure logic: the clock is injected, no I/O.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

INTERACTIVE, NORMAL, BACKGROUND = 0, 1, 2
LANES = ("interactive", "normal", "background")


class Queued(Protocol):
    """What the policy reads of a request (the engine's Request satisfies it)."""

    priority: int
    arrival_time: float
    num_prompt_tokens: int
    status: Any  # has `.finished`: the policy learns from it when a long request it started is done


@dataclass(frozen=True)
class MultiLevelConfig:
    aging_s: float = 10.0  # waiting this long lifts a request one lane
    normal_min_share: float = 0.2  # of recently scheduled tokens, kept for normal when it has work
    share_window_tokens: int = 4096  # the "recently" of normal_min_share (exponential decay horizon)
    long_prompt_tokens: int = 4096  # prompts this long or longer are "long"
    max_long_running: int | None = 1  # long requests running at once; None: no limit
    urgent_step_max_share: float = 0.5  # of recent steps, at most this many run urgent arrivals alone (0: never)
    share_window_steps: int = 32  # the "recent" of urgent_step_max_share (exponential decay horizon)
    interrupt_steps: bool = True  # an arrival that gets an urgent step stops the step in flight (redone later)
    busy_chunk_tokens: int | None = None  # prompt chunk cap for other lanes while interactive traffic is about
    busy_window_s: float = 10.0  # "about": an interactive arrival this recent

    def __post_init__(self) -> None:
        checks = [(self.aging_s > 0, f"aging_s must be > 0, got {self.aging_s}"),
                  (0 <= self.normal_min_share < 1, f"normal_min_share must be in [0, 1), got {self.normal_min_share}"),
                  (self.share_window_tokens >= 1, f"share_window_tokens must be >= 1, got {self.share_window_tokens}"),
                  (self.long_prompt_tokens >= 1, f"long_prompt_tokens must be >= 1, got {self.long_prompt_tokens}"),
                  (self.max_long_running is None or self.max_long_running >= 1,
                   f"max_long_running must be >= 1, got {self.max_long_running}"),
                  (0 <= self.urgent_step_max_share < 1,
                   f"urgent_step_max_share must be in [0, 1), got {self.urgent_step_max_share}"),
                  (self.share_window_steps >= 1, f"share_window_steps must be >= 1, got {self.share_window_steps}"),
                  (isinstance(self.interrupt_steps, bool),
                   f"interrupt_steps must be true or false, got {self.interrupt_steps!r}"),
                  (self.busy_chunk_tokens is None or self.busy_chunk_tokens >= 1,
                   f"busy_chunk_tokens must be >= 1, got {self.busy_chunk_tokens}"),
                  (self.busy_window_s >= 0, f"busy_window_s must be >= 0, got {self.busy_window_s}")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def _lane(priority: int) -> int:
    return min(max(priority, INTERACTIVE), BACKGROUND)


def lane_of(request: Queued) -> int:
    return _lane(request.priority)


class MultiLevelPolicy:
    """Implements the scheduler's QueuePolicy protocol (see runtimes/llm/queue_policy.py)."""

    def __init__(self, config: MultiLevelConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or MultiLevelConfig()
        self.clock = clock
        self._lanes: tuple[deque[Queued], ...] = (deque(), deque(), deque())
        self._recent_tokens = [0.0, 0.0, 0.0]  # decayed count of scheduled tokens per lane
        self._long_started: list[Queued] = []  # long requests popped (admitted) and not yet seen finished
        self._recent_steps = [0.0, 0.0]  # decayed count of recent steps: [all, urgent ones]
        self._last_interactive: float | None = None  # the clock at the latest interactive arrival

    # -------------------------------------------------------------------------------- queue protocol

    def add(self, request: Queued) -> None:
        self._lanes[lane_of(request)].append(request)
        if lane_of(request) == INTERACTIVE:
            self._last_interactive = self.clock()

    def requeue(self, request: Queued) -> None:
        if request in self._long_started:  # preempted: no longer holds a long slot
            self._long_started.remove(request)
        self._lanes[lane_of(request)].appendleft(request)

    def peek(self) -> Queued | None:
        chosen = self._next()
        return None if chosen is None else chosen[1]

    def pop(self, request: Queued | None = None) -> Queued:
        if request is None:
            chosen = self._next()
            if chosen is None:
                raise IndexError("pop from an empty multi-level queue")
            lane, request = chosen
        else:
            lane = lane_of(request)
        self._lanes[lane].remove(request)
        if self._is_long(request):
            self._long_started.append(request)
        return request

    def remove(self, request: Queued) -> bool:
        for lane in self._lanes:
            try:
                lane.remove(request)
            except ValueError:
                continue
            return True
        return False

    def pick_victim(self, running: Sequence[Queued]) -> Queued:
        return max(running, key=lambda r: (lane_of(r), r.arrival_time))

    def urgent_victim(self, waiting: Queued, running: Sequence[Queued], own_step: bool = False) -> Queued | None:
        """A running request that `waiting` (which found no seat or KV room) may displace, least urgent first.

        Background only runs on idle capacity, so any interactive or normal arrival may displace it (otherwise
        a normal request at the head of the queue would block interactive ones behind it until a background
        request finished). An interactive arrival may also displace normal work, but only while normal has at
        least twice its minimum share: preempting throws progress away (recompute), and preempting near the
        floor would make the two rules fight, each step readmitting and preempting the same request. For a step of
        its own (`own_step`), only background work is displaced: normal work is left to the ordinary steps.
        """
        lane = lane_of(waiting)
        if lane == BACKGROUND:
            return None
        spare_normal = (lane != INTERACTIVE or own_step
                        or self._normal_share() < 2 * self.config.normal_min_share)
        candidates = [r for r in running if lane_of(r) == BACKGROUND or (lane_of(r) == NORMAL and not spare_normal)]
        return self.pick_victim(candidates) if candidates else None

    def outranks(self, waiting: Queued, running: Queued) -> bool:
        """A waiting request of a more urgent lane goes before a running request's next prompt chunk."""
        return lane_of(waiting) < lane_of(running)

    def on_scheduled(self, request: Queued, num_tokens: int) -> None:
        """Feed the share accounting: tokens the scheduler just gave `request`."""
        decay = max(0.0, 1.0 - num_tokens / self.config.share_window_tokens)
        self._recent_tokens = [count * decay for count in self._recent_tokens]
        self._recent_tokens[lane_of(request)] += num_tokens

    def num_ahead(self, priority: int) -> int:
        """Requests in lanes at least as urgent: a flood of background work does not fill an interactive queue."""
        return sum(len(lane) for lane in self._lanes[:_lane(priority) + 1])

    def urgent_head(self) -> Queued | None:
        """An interactive first arrival gets a step of its own while urgent steps stay within their share, even when
        ordinary admission would take a normal request first (promoted by aging or its minimum share): that one
        goes in the next ordinary step, one short step later."""
        head = self._head(INTERACTIVE)
        if head is None or getattr(head.status, "value", None) != "waiting" or not self._urgent_step_allowed():
            return None
        return head

    def yields_to(self, priority: int) -> bool:
        """An interactive arrival stops the step in flight (at its next layer boundary, the step redone later) when
        it will get a step of its own: within the same share, so the work thrown away is bounded too."""
        return self.config.interrupt_steps and _lane(priority) == INTERACTIVE and self._urgent_step_allowed()

    def step_yields(self, prefilling: Sequence[Queued]) -> bool:
        return all(lane_of(request) != INTERACTIVE for request in prefilling)

    def _urgent_step_allowed(self) -> bool:
        total, urgent = self._recent_steps
        share = self.config.urgent_step_max_share
        return share > 0 and (total < 1.0 or (urgent + 1) / (total + 1) <= share)

    def chunk_cap(self, request: Queued) -> int | None:
        """The most prompt tokens `request` may take in one step (None: no cap beyond the step's budget)."""
        cap, last = self.config.busy_chunk_tokens, self._last_interactive
        if cap is None or last is None or lane_of(request) == INTERACTIVE:
            return None
        return cap if self.clock() - last <= self.config.busy_window_s else None

    def on_step(self, urgent: bool) -> None:
        decay = 1.0 - 1.0 / self.config.share_window_steps
        self._recent_steps = [self._recent_steps[0] * decay + 1, self._recent_steps[1] * decay + urgent]

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes)

    def __iter__(self) -> Iterator[Queued]:
        for lane in self._lanes:
            yield from lane

    # -------------------------------------------------------------------------------- lane choice

    def _is_long(self, request: Queued) -> bool:
        return request.num_prompt_tokens >= self.config.long_prompt_tokens

    def _long_lane_full(self) -> bool:
        limit = self.config.max_long_running
        if limit is None:
            return False
        self._long_started = [r for r in self._long_started if not r.status.finished]
        return len(self._long_started) >= limit

    def _head(self, lane: int) -> Queued | None:
        """The first request of `lane` that may start now: long ones are skipped while their lane is full."""
        queue = self._lanes[lane]
        if queue and self._is_long(queue[0]) and self._long_lane_full():
            return next((r for r in queue if not self._is_long(r)), None)
        return queue[0] if queue else None

    def _next(self) -> tuple[int, Queued] | None:
        """The lane that goes next and its head (each lane's head is looked up once: this runs on every peek)."""
        heads = {lane: head for lane in range(3) if (head := self._head(lane)) is not None}
        if not heads:
            return None
        if NORMAL in heads and self._normal_starved():
            return NORMAL, heads[NORMAL]
        if heads.keys() == {BACKGROUND}:
            return BACKGROUND, heads[BACKGROUND]
        # after aging, fractional: longer waits rank first within a level
        now = self.clock()
        rank = {lane: lane - max(0.0, now - head.arrival_time) / self.config.aging_s for lane, head in heads.items()}
        if BACKGROUND in rank:
            # Aged background competes with normal work, never with interactive: it cannot displace anyone, so
            # at the head of a full engine it would hold every interactive arrival behind it until a seat frees.
            rank[BACKGROUND] = max(rank[BACKGROUND], INTERACTIVE + 0.5)
        # aging may lift a long-waiting background head into the foreground competition
        contenders = [lane for lane in heads if lane != BACKGROUND or rank[lane] < BACKGROUND - 1]
        lane = min(contenders, key=lambda lane: (rank[lane], lane))
        return lane, heads[lane]

    def _normal_share(self) -> float:
        """Normal's part of recently scheduled tokens (1.0 before anything was scheduled)."""
        total = sum(self._recent_tokens)
        return 1.0 if total < 1.0 else self._recent_tokens[NORMAL] / total

    def _normal_starved(self) -> bool:
        return self._normal_share() < self.config.normal_min_share
