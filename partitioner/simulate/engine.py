"""One replica's engine, as the simulator steps it: iteration-level continuous batching like runtimes/llm/scheduler.

Each step: running requests' decodes first (one token each), then their unfinished prompt chunks, then waiting
requests in arrival order while the token budget (`max_num_batched_tokens`), `max_num_seqs` and the KV cache last;
a prompt longer than the budget left is chunked. A prompt's last chunk samples its first token.

One difference, on the safe side: a request is admitted only when its whole prompt + output (in blocks) fits the KV
cache left, so nothing is ever preempted; the runtime admits on what the next chunk needs and preempts the newest
request when the cache runs out, which recomputes work the simulator never does. A request that could never fit
(longer than `max_model_len`, or than the whole cache) is rejected at arrival, as the runtime refuses it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from partitioner.simulate.cost import StepWork
from registry.engine import EngineOptions

_DEFAULTS = EngineOptions()  # the registry's and the runtime's defaults, defined once there


@dataclass(frozen=True)
class EngineLimits:
    """The engine options that shape batches (registry/engine.py's `EngineOptions`, whose defaults they take)."""

    max_num_seqs: int = _DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = _DEFAULTS.max_num_batched_tokens
    max_model_len: int | None = _DEFAULTS.max_model_len
    block_size: int = _DEFAULTS.block_size


@dataclass(eq=False)
class SimRequest:
    model: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    computed: int = 0  # prompt tokens in the KV cache
    generated: int = 0
    reserved_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def context(self) -> int:
        """Tokens whose KV the request holds now."""
        return self.computed + max(0, self.generated - 1)


@dataclass
class ReplicaEngine:
    replica_id: str
    model: str
    limits: EngineLimits
    kv_capacity_tokens: int
    waiting: deque[SimRequest] = field(default_factory=deque)
    running: list[SimRequest] = field(default_factory=list)
    kv_reserved_tokens: int = 0
    kv_peak_tokens: int = 0
    finished: list[SimRequest] = field(default_factory=list)
    rejected: list[SimRequest] = field(default_factory=list)

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: SimRequest) -> None:
        """Queue `request`, or reject it when it could never run here."""
        request.reserved_tokens = self._blocks(request.prompt_tokens + request.output_tokens)
        too_long = self.limits.max_model_len is not None and \
            request.prompt_tokens + request.output_tokens > self.limits.max_model_len
        if too_long or request.reserved_tokens > self.kv_capacity_tokens:
            self.rejected.append(request)
        else:
            self.waiting.append(request)

    def plan_step(self) -> list[tuple[SimRequest, int]]:
        """(request, tokens it computes) for the next step; admits waiting requests (module docstring)."""
        budget = self.limits.max_num_batched_tokens
        plan: list[tuple[SimRequest, int]] = []
        decodes = [r for r in self.running if r.computed == r.prompt_tokens]
        chunks = [r for r in self.running if r.computed < r.prompt_tokens]
        for request in decodes + chunks:
            if budget == 0:
                return plan
            n = 1 if request.computed == request.prompt_tokens else min(request.prompt_tokens - request.computed,
                                                                         budget)
            plan.append((request, n))
            budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.limits.max_num_seqs:
            head = self.waiting[0]
            if self.kv_reserved_tokens + head.reserved_tokens > self.kv_capacity_tokens:
                break  # first come, first served: nobody overtakes the head
            self.waiting.popleft()
            self.running.append(head)
            self.kv_reserved_tokens += head.reserved_tokens
            self.kv_peak_tokens = max(self.kv_peak_tokens, self.kv_reserved_tokens)
            n = min(head.prompt_tokens, budget)
            plan.append((head, n))
            budget -= n
        return plan

    @staticmethod
    def work(plan: list[tuple[SimRequest, int]]) -> StepWork:
        return StepWork(computed_tokens=sum(n for _, n in plan), attended_tokens=sum(r.context for r, _ in plan))

    def finish_step(self, plan: list[tuple[SimRequest, int]], now_s: float) -> None:
        """Apply a step that ended at `now_s`: progress, first tokens, finished requests and their KV freed."""
        for request, n in plan:
            if request.computed < request.prompt_tokens:
                request.computed += n
                if request.computed == request.prompt_tokens:
                    request.generated, request.first_token_s = 1, now_s
            else:
                request.generated += 1
            if request.generated == request.output_tokens:
                request.finish_s = now_s
                self.running.remove(request)
                self.kv_reserved_tokens -= request.reserved_tokens
                self.finished.append(request)

    def _blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.limits.block_size) * self.limits.block_size
