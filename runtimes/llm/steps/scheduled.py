"""A plan run now, isolating faults: by graph replay where a captured graph holds the batch (one new token per
request: `ModelRunner.execute` decides), else eagerly. A request that makes the step fail is left out, with its
error, and the rest run without it (runtimes/fault_isolation.py bisects the batch)."""

from __future__ import annotations

from collections.abc import Callable

from runtimes.fault_isolation import run_isolating
from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.model_runner import ModelRunner, StepResult
from runtimes.llm.scheduler import SchedulerOutput
from runtimes.llm.steps import Ran


class ScheduledStep:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.runner = runner
        self.kv = kv

    def run(self, plan: SchedulerOutput, interrupt: Callable[[], bool] | None) -> Ran:
        """Run the plan; `interrupt`: see `ModelRunner.execute` (StepInterrupted passes through)."""
        # A rerun is harmless: progress is counted, and seeded noise is keyed by position (runtimes/llm/sampler.py).
        outcome = run_isolating(
            lambda part: self.runner.execute(SchedulerOutput(scheduled=list(part)), self.kv.block_tables, interrupt),
            plan.scheduled)
        if len(outcome.parts) == 1:
            return Ran(plan, outcome.parts[0][1], outcome.faults)
        result = StepResult()
        for _, part_result in outcome.parts:
            result.sampled.update(part_result.sampled)
            result.logprobs.update(part_result.logprobs)
        return Ran(plan, result, outcome.faults)
