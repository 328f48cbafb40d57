"""Queue-order policies the scheduler consults: which waiting request goes next, which running one
is preempted first. FCFS lives here; the multi-level policy (policies/) implements the same protocol.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

from runtimes.llm.request import Request


class QueuePolicy(Protocol):
    def add(self, request: Request) -> None:
        """A new arrival."""

    def requeue(self, request: Request) -> None:
        """A preempted request coming back; it should run again soon."""

    def peek(self) -> Request | None: ...

    def pop(self, request: Request | None = None) -> Request:
        """Take the next request for admission (`peek`'s), or `request` (`urgent_head`'s) when given."""

    def remove(self, request: Request) -> bool:
        """Drop a waiting request (abort); False if it was not waiting."""

    def pick_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when KV blocks run out."""

    def urgent_victim(self, waiting: Request, running: Sequence[Request], own_step: bool = False) -> Request | None:
        """A running request that `waiting` (which cannot be admitted) may preempt, or None; `own_step`: for an
        urgent step (`urgent_head`)."""

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        """The scheduler gave `request` this many tokens this step (for share accounting)."""

    def outranks(self, waiting: Request, running: Request) -> bool:
        """Whether `waiting` should get this step's token budget before `running`'s next prompt chunk."""

    def num_ahead(self, priority: int) -> int:
        """Waiting requests a new arrival of `priority` would queue behind (admission limits count these)."""

    def urgent_head(self) -> Request | None:
        """The waiting request due a step of its own now (the running decodes skipping it), if any: it need not be
        the head that ordinary admission takes next (`peek`). The scheduler admits it with `pop(it)`."""

    def yields_to(self, priority: int) -> bool:
        """Whether a step in flight should stop for an arrival of `priority` that `urgent_head` would give a step of
        its own (asked from another thread than the scheduler's, before the arrival is queued)."""

    def step_yields(self, prefilling: Sequence[Request]) -> bool:
        """Whether a step that runs prompt chunks of `prefilling` (and any decodes) may stop for such an arrival: not
        one that starts such a request already (a flood of arrivals would keep stopping the step that starts the
        first of them); a decode loses only its step."""

    def on_step(self, urgent: bool) -> None:
        """A step was planned; `urgent`: one of its own for urgent arrivals (for the bound on those)."""

    def chunk_cap(self, request: Request) -> int | None:
        """The most prompt tokens `request` may take in one step now (None: only the step's budget limits it)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSPolicy:
    """First come, first served; preempted requests go back to the front.

    The victim is the least urgent (highest `priority` value) running request, newest arrival first,
    so the oldest work keeps its progress.
    """

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self, request: Request | None = None) -> Request:
        if request is None:
            return self._queue.popleft()
        self._queue.remove(request)
        return request

    def remove(self, request: Request) -> bool:
        try:
            self._queue.remove(request)
        except ValueError:
            return False
        return True

    def pick_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    def urgent_victim(self, waiting: Request, running: Sequence[Request], own_step: bool = False) -> Request | None:
        return None  # FCFS never displaces running work for a newcomer

    def on_scheduled(self, request: Request, num_tokens: int) -> None:
        return None

    def outranks(self, waiting: Request, running: Request) -> bool:
        return False  # work already started goes first

    def num_ahead(self, priority: int) -> int:
        return len(self._queue)

    def urgent_head(self) -> Request | None:
        return None  # nobody is more urgent than anyone else

    def yields_to(self, priority: int) -> bool:
        return False

    def step_yields(self, prefilling: Sequence[Request]) -> bool:
        return False

    def on_step(self, urgent: bool) -> None:
        return None

    def chunk_cap(self, request: Request) -> int | None:
        return None

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
