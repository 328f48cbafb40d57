"""The engine's step kinds, each a small strategy over the model runner (runtimes/llm/step_loop.py chooses among
them): a plan run now (`scheduled`), a step stopped between layers and finished later (`stopped`), a decode step
launched before the one before it is read back (`ahead`). What each hands back is a `Ran`."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtimes.llm.model_runner import StepResult
from runtimes.llm.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class Ran:
    """A step that ran: its plan, its results, and the requests that failed in it (left out of the results)."""

    plan: SchedulerOutput
    result: StepResult
    faults: list[tuple[ScheduledRequest, Exception]] = field(default_factory=list)
    launched: bool = False  # a step launched ahead, collected: the step after it is launched already
