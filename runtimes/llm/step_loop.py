"""The engine's step loop: which kind of step runs next, run.

In order: a decode step launched ahead is collected (the one after it launched first, when it can be); a step
stopped between layers is finished, unless an arrival due a step of its own goes first (runtimes/llm/steps/
stopped.py); else the scheduler's plan runs now, by graph replay or eagerly, isolating faults (steps/scheduled.py).
After an ordinary step, the next decode step is launched ahead when its plan is certain (steps/ahead.py). With
speculative decoding, the scheduler's plan takes proposals for its decodes before it runs, and its results and time
teach the next proposals (runtimes/llm/speculative.py); no step is launched ahead then (its input token is not known
yet, so it could not carry a proposal).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.model import StepInterrupted
from runtimes.llm.model_runner import ModelRunner
from runtimes.llm.scheduler import Scheduler, SchedulerOutput
from runtimes.llm.speculative import Speculation
from runtimes.llm.steps import Ran
from runtimes.llm.steps.ahead import LaunchAhead
from runtimes.llm.steps.scheduled import ScheduledStep
from runtimes.llm.steps.stopped import Chosen, StoppedSteps


class StepLoop:
    """`quiet`: nothing is due but the running batch's next tokens (the engine has no samples waiting for their
    prompt and no self-check in flight), which a step launched ahead needs besides its own conditions."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: KVCacheManager, max_model_len: int,
                 overlap_steps: bool, quiet: Callable[[], bool], speculation: Speculation | None = None) -> None:
        self.scheduler = scheduler
        self.speculation = speculation
        self._fresh: SchedulerOutput | None = None  # the plan the scheduler made for the step now running
        self._seconds: float | None = None  # that step's time, when it ran whole
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
        started = time.perf_counter()
        try:
            ran = run()
        except StepInterrupted as stop:
            self.stopped.suspend(stop.partial, plan)
            return None
        fresh, self._fresh = self._fresh is plan, None
        self._seconds = time.perf_counter() - started if fresh and ran is not None and not ran.faults else None
        return ran

    def after(self, ran: Ran) -> None:
        """A step's results are applied: speculation learns from them; after an ordinary step, launch the next decode
        step ahead if it can be."""
        if self.speculation is not None:
            self.speculation.observe(ran.plan, ran.result.sampled, self._seconds)
        elif not ran.launched:
            self.ahead.launch(self._nothing_else_due)
        self._seconds = None

    def _choose(self) -> Chosen | None:
        chosen = self.stopped.choose()
        if chosen is not None:
            return chosen
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        if self.speculation is not None:
            self.speculation.draft(plan)
        self._fresh = plan
        return plan, functools.partial(self.scheduled.run, plan, self.stopped.interrupt_for(plan))

    def _nothing_else_due(self) -> bool:
        return self._quiet() and self.stopped.suspended is None and not self.stopped.wanted.is_set()
