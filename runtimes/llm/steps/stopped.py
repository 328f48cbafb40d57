"""Steps stopped between layers for an arrival due a step of its own (`QueuePolicy.yields_to`), and finished after
the arrival's step.

Another thread asks (`request`) when such an arrival is queued; the step in flight stops at its next layer boundary
(StepInterrupted) unless the policy spares it (an urgent step, or one that starts an urgent request's prompt). The
stopped step is kept (`suspend`) and finished when its turn comes again (`choose`): unless an arrival due a step of
its own fits first; it is dropped, its requests computing those tokens again later, when an abort freed blocks it
would write or nobody is left in it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import structlog

from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.model_runner import ModelRunner, SuspendedStep
from runtimes.llm.request import RequestStatus
from runtimes.llm.scheduler import Scheduler, SchedulerOutput
from runtimes.llm.steps import Ran
from runtimes.llm.steps.scheduled import ScheduledStep

log = structlog.get_logger(__name__)

Chosen = tuple[SchedulerOutput, Callable[[], Ran | None]]  # a step's plan, and how to run it


class StoppedSteps:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: KVCacheManager,
                 scheduled: ScheduledStep) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv = kv
        self.scheduled = scheduled
        self.wanted = threading.Event()  # set from other threads: the step in flight stops at its next layer
        self.suspended: SuspendedStep | None = None  # a stopped step, finished after the arrival's step
        self.num_interrupted = 0  # steps stopped between layers for an arrival ...
        self.num_dropped = 0  # ... and of those, the ones not finished later (their work is redone)

    def request(self, priority: int) -> None:
        """A request of `priority` is on its way (safe from any thread): stop the step in flight if the queue policy
        gives such arrivals a step of their own."""
        if self.scheduler.waiting.yields_to(priority):
            self.wanted.set()

    def choose(self) -> Chosen | None:
        """With a stopped step: it is finished, unless an arrival due a step of its own fits first (the stopped one
        is then kept for after it). An arrival due a step of its own that does not fit in one gets into the
        scheduler's ordinary plan, as without a stopped step: the stopped one is dropped then (its requests run
        those tokens again). None: no stopped step, or it was dropped."""
        suspended = self._take()
        if suspended is None:
            return None
        due = self.scheduler.urgent_head() is not None
        urgent = self.scheduler.schedule_urgent()
        held = {item.request.request_id for item in suspended.plan.scheduled}
        if displaced := {r.request_id for r in urgent.preempted} & held:
            suspended = self._without(suspended, displaced)
        if suspended is not None and urgent.is_empty and not due:
            self.scheduler.waiting.on_step(False)  # a step like any other for the urgent steps' share
            return suspended.plan, functools.partial(self._resume, suspended, self.interrupt_for(suspended.plan))
        if not urgent.is_empty:
            self.suspended = suspended
            return urgent, functools.partial(self.scheduled.run, urgent, None)
        if suspended is not None:
            self.num_dropped += 1
        return None

    def interrupt_for(self, plan: SchedulerOutput) -> Callable[[], bool] | None:
        """What may stop `plan` between layers: a yield asked for an arrival, unless the policy spares the step."""
        chunks = [item.request for item in plan.scheduled if item.num_new_tokens > 1]
        if plan.urgent or not self.scheduler.waiting.step_yields(chunks):
            return None
        return self.wanted.is_set

    def suspend(self, partial: object, plan: SchedulerOutput) -> None:
        """Keep a step that stopped between layers to finish after the arrival's step; one stopped inside the fault
        isolation's reruns (a part of its batch) is dropped instead, to be planned again."""
        self.wanted.clear()
        self.num_interrupted += 1
        if isinstance(partial, SuspendedStep) and len(partial.plan.scheduled) == len(plan.scheduled):
            self.suspended = partial

    def _take(self) -> SuspendedStep | None:
        """The stopped step to finish, if its requests are as it left them (running, at the same progress); else it
        is dropped (an abort in between freed blocks it would write to). Their blocks cannot have changed otherwise:
        meanwhile only urgent steps run, which schedule none of them, and a request such a step displaces leaves the
        stopped step (`_without`)."""
        suspended, self.suspended = self.suspended, None
        if suspended is None:
            return None
        if any(item.request.status != RequestStatus.RUNNING or item.request.num_computed_tokens != item.start
               for item in suspended.plan.scheduled):
            self.num_dropped += 1
            return None
        return suspended

    def _without(self, suspended: SuspendedStep, request_ids: set[str]) -> SuspendedStep | None:
        """The stopped step less requests the arrival displaced (their blocks are freed: the step must not write
        them); None, counted as dropped, if nobody is left."""
        pruned = self.runner.without(suspended, request_ids, self.kv.block_tables)
        if pruned is None:
            self.num_dropped += 1
        return pruned

    def _resume(self, suspended: SuspendedStep, interrupt: Callable[[], bool] | None) -> Ran | None:
        """Finish a stopped step; None when that fails. Such a fault is not isolated here: the step is dropped, and
        the next run of its requests (bisected as usual) finds whose it was."""
        try:
            return Ran(suspended.plan, self.runner.resume(suspended, interrupt))
        except Exception as error:
            log.warning("a stopped step failed when finished; its requests run it again", error=repr(error))
            self.num_dropped += 1
            return None
