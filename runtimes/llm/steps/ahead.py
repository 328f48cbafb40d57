"""Decode steps launched ahead: the next step started before the previous one's tokens are read back, so the host's
work overlaps the device's. Only with decode graphs, and only when the step's plan is certain (`launch`).

Unseeded random rows draw from the engine's generator in the same order, but a wasted row's draw (a request that
the step in flight finishes) shifts the later ones: only greedy and seeded requests reproduce exactly (as
everywhere: a batch's make-up changes unseeded draws).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.model_runner import ModelRunner, PendingStep, sampling_row
from runtimes.llm.request import RequestStatus
from runtimes.llm.scheduler import Scheduler, SchedulerOutput
from runtimes.llm.steps import Ran

log = structlog.get_logger(__name__)


@dataclass
class InFlight:
    """A decode step launched ahead: its plan and its tokens on their way."""

    plan: SchedulerOutput
    pending: PendingStep


class LaunchAhead:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: KVCacheManager, max_model_len: int,
                 enabled: bool) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv = kv
        self.max_model_len = max_model_len
        # Off without graphs, and turned off under a time-slice gate (the device's work would outlast the step's
        # lease) or after a launch failed.
        self.enabled = enabled and runner.graphs is not None
        self.inflight: InFlight | None = None  # a launched step, its results not yet applied
        self.num_launched = 0

    def collect(self, quiet: Callable[[], bool]) -> Ran:
        """The step in flight's results; the step after it is launched first, when it can be (`quiet` as for
        `launch`)."""
        inflight, self.inflight = self.inflight, None
        assert inflight is not None
        self.inflight = self._launch(inflight, quiet)
        return Ran(inflight.plan, inflight.pending.collect(), launched=True)

    def launch(self, quiet: Callable[[], bool]) -> None:
        """Launch the next decode step after an ordinary one, when it can be."""
        self.inflight = self._launch(None, quiet)

    def _launch(self, inflight: InFlight | None, quiet: Callable[[], bool]) -> InFlight | None:
        """Start the next decode step without waiting for it, when its plan is certain: every running request takes
        one more token sampled from its logits alone (`Sampler.on_device`), nothing else is due (`quiet`: nothing
        waits to be admitted or finished, no yield is asked), a graph holds the batch, and each has its slot
        (allocated here). After a step in flight (`inflight`), the same requests go on from its tokens, read on the
        device; those it finishes (a stop token) waste the token computed for them here. None: no step launched."""
        graphs = self.runner.graphs
        running = self.scheduler.running
        if (not self.enabled or graphs is None or not running or len(running) > graphs.max_size
                or len(self.scheduler.waiting) or not quiet()):
            return None
        ahead = 0 if inflight is None else 1
        if inflight is None:
            requests = list(running)
        else:
            requests = [item.request for item in inflight.plan.scheduled]
            if len(requests) != len(running) or any(r.status != RequestStatus.RUNNING for r in requests):
                return None
        for r in requests:
            # the step's input must exist and its output be wanted: not past max_tokens or the context
            if (r.num_tokens - r.num_computed_tokens != 1 or r.num_output_tokens + ahead >= r.max_tokens
                    or r.num_tokens + ahead >= self.max_model_len
                    or not self.runner.sampler.on_device(sampling_row(r))):
                return None
        plan = self.scheduler.plan_ahead(requests, ahead)
        if plan is None:
            return None
        try:
            pending = self.runner.launch(plan, self.kv.block_tables,
                                         None if inflight is None else inflight.pending.tokens)
        except Exception as error:  # the ordinary steps take over: they plan these tokens again, isolating faults
            log.error("launch_ahead_failed", error=repr(error), batch=len(requests))
            self.enabled = False
            return None
        if pending is None:
            return None
        self.num_launched += 1
        return InFlight(plan, pending)
