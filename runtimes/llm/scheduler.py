"""Iteration-level scheduler: each step is a plan (which requests, how many tokens each).

Order of one `schedule()`:
1. Running requests, decodes first, then unfinished prompt chunks, each taking what it still needs
   from the step's token budget. When the KV pool is exhausted, the policy's victim (least urgent,
   newest) is preempted: its blocks are freed and it will recompute from scratch later.
2. Waiting requests, in the policy's order, while budget, `max_num_seqs` and blocks last; prompts
   longer than the remaining budget are chunked. Nothing new is admitted in a step that preempted.

Except an urgent step: when the policy says the waiting head deserves one (an interactive arrival, within a
bound: policies/multilevel.py), the step admits only such arrivals and the running requests skip it.

`update(plan, sampled)` then applies the results: progress, new tokens, stop checks, freeing, and the prefix
cache's new full blocks. A plan that never gets its update (its step stopped part-way for an urgent arrival)
leaves a valid state: its requests keep the blocks it allocated and recompute the same tokens in a later step. While
the engine holds such a step to finish it, only `schedule_urgent` runs: it admits urgent arrivals only, and a
request it displaces is taken out of the held step (`ModelRunner.without`); the others keep their blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.queue_policy import FCFSPolicy, QueuePolicy
from runtimes.llm.request import Request, RequestStatus

if TYPE_CHECKING:
    from runtimes.llm.grammar import FixedMask


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens when scheduled: the new tokens are token_ids[start : start + num_new_tokens]
    # a decode's proposed next tokens, verified in the same step (runtimes/llm/speculative.py): computed after its
    # known token, each position sampled; their slots are allocated with it
    draft: list[int] = field(default_factory=list)
    # under a grammar: the mask of each verified position (its known token's, then one after each proposed token)
    draft_masks: list[FixedMask] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens

    @property
    def num_query_tokens(self) -> int:
        """The tokens this step computes for the request: its new known tokens and its draft."""
        return self.num_new_tokens + len(self.draft)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    urgent: bool = False  # a step of its own for urgent arrivals

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: QueuePolicy | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: QueuePolicy = policy if policy is not None else FCFSPolicy()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -------------------------------------------------------------------------------------- intake

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop condition, stop string or abort) and free its blocks at once."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def expire_waiting(self, cutoff: float) -> list[Request]:
        """Refuse requests that arrived before `cutoff` and never started (preempted ones keep their place:
        they were accepted and have produced tokens). Their status becomes FINISHED_REJECTED."""
        expired = [r for r in self.waiting if r.status == RequestStatus.WAITING and r.arrival_time < cutoff]
        for request in expired:
            self.finish_request(request, RequestStatus.FINISHED_REJECTED)
        return expired

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # -------------------------------------------------------------------------------------- planning

    def schedule(self) -> SchedulerOutput:
        preempted: list[Request] = []
        if self.running and self.urgent_head() is not None:
            out = SchedulerOutput()
            self._admit_waiting(out, self.max_num_batched_tokens, {}, urgent_only=True)
            if out.scheduled:
                return self._planned(out, urgent=True)
            preempted = out.preempted  # it displaced work and still did not fit: an ordinary step, admitting nothing
        out = self._plan_step(admit=not preempted)
        out.preempted[:0] = preempted
        return self._planned(out, urgent=False)

    def schedule_urgent(self) -> SchedulerOutput:
        """An urgent step alone (no ordinary one instead): empty when the waiting head is not due one or does not
        fit. It may displace background work as `schedule` does (`preempted`): a stopped step that holds such a
        request finishes without it."""
        out = SchedulerOutput()
        if self.urgent_head() is None:
            return out
        self._admit_waiting(out, self.max_num_batched_tokens, {}, urgent_only=True)
        return self._planned(out, urgent=True) if out.scheduled else out

    def urgent_head(self) -> Request | None:
        """The waiting request due a step of its own (the policy's `urgent_head`), unless that step would take the
        last seat (`max_num_seqs`) from the request ordinary admission would seat (normal work owed its minimum share,
        say) while that one could displace nobody for a seat: taking every seat that frees would starve it. (Where it
        can displace someone, background work, it still gets a seat in the next ordinary step.)"""
        head = self.waiting.urgent_head()
        if head is None or len(self.running) + 1 < self.max_num_seqs:
            return head
        ordinary = self.waiting.peek()
        if ordinary is not None and ordinary is not head and self.waiting.urgent_victim(ordinary, self.running) is None:
            return None
        return head

    def plan_ahead(self, requests: list[Request], ahead: int) -> SchedulerOutput | None:
        """A decode step of one token for each of `requests` (running; the engine checks that nothing else waits),
        planned `ahead` steps beyond the results applied so far: with 1, a step still in flight will produce the
        token it reads. Allocates their slots; None when one cannot have its slot (nobody is preempted for it; slots
        already allocated stay, and the next ordinary step uses them)."""
        for request in requests:
            if not self.kv.allocate_slots(request, 1 + ahead):
                return None
        out = SchedulerOutput([ScheduledRequest(r, 1, r.num_computed_tokens + ahead) for r in requests])
        return self._planned(out, urgent=False)

    def _planned(self, out: SchedulerOutput, urgent: bool) -> SchedulerOutput:
        out.urgent = urgent
        for item in out.scheduled:
            self.waiting.on_scheduled(item.request, item.num_new_tokens)
        self.waiting.on_step(urgent)
        return out

    def _plan_step(self, admit: bool = True) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        by_id: dict[str, ScheduledRequest] = {}
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        chunks = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        # Prompt chunks of running requests the policy ranks below the waiting head go after admission, so an
        # urgent arrival is not starved of token budget by long prefills (FCFS never ranks a newcomer higher).
        head = self.waiting.peek()
        deferred = [r for r in chunks if head is not None and self.waiting.outranks(head, r)]
        first = [r for r in chunks if r not in deferred]
        budget = self._schedule_running(decodes + first, out, budget, by_id)
        num_scheduled = len(out.scheduled)
        if admit and not out.preempted:
            budget = self._admit_waiting(out, budget, by_id)
        if len(out.scheduled) == num_scheduled:  # nothing more urgent got in: the deferred chunks go now;
            self._schedule_running(deferred, out, budget, by_id)  # else they wait, keeping the urgent step short
        return out

    def _schedule_running(self, requests: list[Request], out: SchedulerOutput, budget: int,
                          by_id: dict[str, ScheduledRequest]) -> int:
        """Give running requests their next tokens (preempting for KV blocks when needed); returns the budget left."""
        for request in requests:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.waiting.pick_victim(self.running)
                budget += self._preempt_in_plan(victim, out, by_id)
                if victim is request:
                    break
            else:
                item = ScheduledRequest(request, num_new, request.num_computed_tokens)
                out.scheduled.append(item)
                by_id[request.request_id] = item
                budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, by_id: dict[str, ScheduledRequest],
                       urgent_only: bool = False) -> int:
        admitted: list[Request] = []  # never displaced again in the same step (no preempt/admit ping-pong)
        while budget > 0:
            request = self.urgent_head() if urgent_only else self.waiting.peek()
            if request is None:
                break
            hits = self.kv.get_computed_blocks(request)
            partial = self.kv.find_partial(request, len(hits))
            num_computed = len(hits) * self.kv.block_size + (0 if partial is None else partial.num_tokens)
            num_new = self._chunk(request, request.num_tokens - num_computed, budget)
            if (len(self.running) >= self.max_num_seqs
                    or not self.kv.allocate_slots(request, num_new, hits, partial)):
                # The policy may let an urgent arrival displace less urgent running work (never FCFS); in a step
                # of its own, less of it (only work that runs on idle capacity anyway).
                victim = self.waiting.urgent_victim(request, [r for r in self.running if r not in admitted],
                                                    own_step=urgent_only)
                if victim is None:
                    break
                budget += self._preempt_in_plan(victim, out, by_id)
                continue
            self.waiting.pop(request if urgent_only else None)
            if request.status == RequestStatus.WAITING:  # first admission, not a resume
                request.num_cached_tokens = num_computed
                self.kv.stats.queried_tokens += request.num_tokens
                self.kv.stats.hit_tokens += num_computed
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)
            item = ScheduledRequest(request, num_new, num_computed)
            out.scheduled.append(item)
            by_id[request.request_id] = item
            budget -= num_new
        return budget

    def _chunk(self, request: Request, remaining: int, budget: int) -> int:
        """Tokens `request` computes this step: what it still needs, within the budget and the policy's cap on a
        prompt chunk (a decode, one token, is never capped)."""
        num_new = min(remaining, budget)
        cap = self.waiting.chunk_cap(request) if num_new > 1 else None
        return num_new if cap is None else min(num_new, cap)

    def _preempt_in_plan(self, victim: Request, out: SchedulerOutput, by_id: dict[str, ScheduledRequest]) -> int:
        """Preempt `victim` during planning; if this step had already scheduled it, take that back.

        Returns the tokens handed back to the step's budget.
        """
        self._preempt(victim)
        out.preempted.append(victim)
        undone = by_id.pop(victim.request_id, None)
        if undone is None:
            return 0
        out.scheduled.remove(undone)
        return undone.num_new_tokens

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(request)

    # -------------------------------------------------------------------------------------- results

    def update(self, plan: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> list[tuple[Request, list[int]]]:
        """Apply a step's results: each request's new tokens (several where a draft was verified: the accepted
        proposal and the token after it), taken one at a time up to a stop. Returns the requests that received
        tokens (finished ones included), with the tokens they took."""
        advanced = []
        for item in plan.scheduled:
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue
            tokens = sampled.get(request.request_id)
            status = None
            taken: list[int] = []
            for token in tokens or ():
                request.token_ids.append(token)
                taken.append(token)
                if (status := self._stop_status(request, token)) is not None:
                    break
            # the KV written holds the known token and the accepted proposal: every token but the newest
            request.num_computed_tokens += item.num_new_tokens + max(len(taken) - 1, 0)
            self.kv.commit(request)
            self.kv.release_behind_window(request)
            if item.draft:
                self.kv.trim(request)  # the slots of a rejected proposal's tail go back
            if status is not None:
                self.finish_request(request, status)
            if taken:  # else a prompt chunk that did not reach the end
                advanced.append((request, taken))
        return advanced

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Drop a finished request's tokens past `num_tokens` (a stop string ended it inside a step's tokens)."""
        del request.token_ids[num_tokens:]
        request.num_computed_tokens = min(request.num_computed_tokens, max(num_tokens - 1, 0))

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
