"""The engine's step loop: which kind of step runs next, run.

In order: a decode step launched ahead is collected (the one after it launched first, when it can be); a step
stopped between layers is finished, unless an arrival due a step of its own goes first (runtimes/llm/steps/
stopped.py); else the scheduler's plan runs now, by graph replay or eagerly, isolating faults (steps/scheduled.py).
After an ordinary step, the next decode step is launched ahead when its plan is certain (steps/ahead.py). A new
kind (a speculative step: propose, verify, accept) is one more strategy chosen here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.model import StepInterrupted
from runtimes.llm.model_runner import ModelRunner
from runtimes.llm.scheduler import Scheduler
from runtimes.llm.steps import Ran
from runtimes.llm.steps.ahead import LaunchAhead
from runtimes.llm.steps.scheduled import ScheduledStep
from runtimes.llm.steps.stopped import Chosen, StoppedSteps


class StepLoop:
    """`quiet`: nothing is due but the running batch's next tokens (the engine has no samples waiting for their
    prompt and no self-check in flight), which a step launched ahead needs besides its own conditions."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: KVCacheManager, max_model_len: int,
                 overlap_steps: bool, quiet: Callable[[], bool]) -> None:
        self.scheduler = scheduler
        self.scheduled = ScheduledStep(runner, kv)
        self.stopped = StoppedSteps(scheduler, runner, kv, self.scheduled)
        self.ahead = LaunchAhead(scheduler, runner, kv, max_model_len, overlap_steps)
        self._quiet = quiet

    def next(self) -> Ran | None:
        """Run the next step; None when nothing ran to completion (nothing to run, or a step stopped between
        layers, or a stopped step failed when finished: its plan runs again)."""
        if self.ahead.inflight is not None:
            return self.ahead.collect(self._nothing_else_due)
        chosen = self._choose()
        if chosen is None:
            return None
        plan, run = chosen
        try:
            return run()
        except StepInterrupted as stop:
            self.stopped.suspend(stop.partial, plan)
            return None

    def after(self, ran: Ran) -> None:
        """A step's results are applied: after an ordinary step, launch the next decode step ahead if it can be."""
        if not ran.launched:
            self.ahead.launch(self._nothing_else_due)

    def _choose(self) -> Chosen | None:
        chosen = self.stopped.choose()
        if chosen is not None:
            return chosen
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        return plan, functools.partial(self.scheduled.run, plan, self.stopped.interrupt_for(plan))

    def _nothing_else_due(self) -> bool:
        return self._quiet() and self.stopped.suspended is None and not self.stopped.wanted.is_set()
