"""Speculative decoding's parts that do not run the model: proposing tokens by prompt lookup, and verifying a
proposal against the target model's logits with the engine's own sampler.

Prompt lookup (`NgramProposer`): outputs that copy from their input (summaries, edits, code over a given file)
repeat runs of the prompt, so the tokens that followed the latest earlier occurrence of the sequence's last n
tokens are a good guess of what comes next, at no model cost.

Verification (`verification_rows`, `accepted`): the target model's logits at each proposed position (one forward
pass over the proposal) are sampled as plain decoding samples them: the same sampler and logits processors, each
position's row seeing the output as it would be had the proposal been accepted up to there (penalties,
`min_tokens`), and a seeded row's noise keyed by its output position (runtimes/llm/sampler.py). The proposal is kept
up to its first difference from those samples, followed by the sample at that position (or, all accepted, the one
after). A proposal is a point mass, and for a point mass this is the rejection rule of speculative sampling
(Leviathan et al. 2023; Chen et al. 2023): proposed token x is kept with probability p(x), and a rejection yields a
draw from p without x. So the output is distributed as without speculation, and a greedy or seeded request gets
the same tokens, token for token, whatever was proposed.

The step (`Speculation.draft`): after the scheduler's plan, each decode in it gets a proposal (`ScheduledRequest.
draft`) and KV slots for it; the model runner computes the known token and each proposed one as decode rows of their
own (each attending to the cache up to its position: what plain decoding computes there, with the same kernel), and
samples each row; the scheduler takes the accepted tokens one at a time up to a stop, and hands back the blocks of a
rejected tail (`KVCacheManager.trim`: the KV written in its slots is never read, since a position is written again
before anything reads it). A stop string inside the accepted tokens drops those after it (the output processor).

How much to propose (`adaptive`): a verified row costs the step time of one more row, and a proposed token pays only
if it is accepted, which gets less likely the deeper it lies. From the decode steps' measured times (`StepCost`: a
step of R rows takes about a + b R seconds) and the request's recent acceptance rate r, the j-th proposed token is
worth its row where r**j > b B / (a + b B), B the step's requests: what one more row costs against what a step
spends per token. So a lone stream proposes deep when its proposals keep being accepted, and a large batch (where a
row costs about what a token is worth) proposes nothing. Rows under a grammar are not verified (their matcher would
have to advance along the proposal): they decode one token at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from runtimes.llm.logits_processors import SamplingRow

if TYPE_CHECKING:
    from registry.engine import SpeculativeOptions
    from runtimes.llm.scheduler import Scheduler, SchedulerOutput


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to `k` tokens: those that followed the latest earlier occurrence of the sequence's last n tokens,
    for the longest n from `max_n` down to `min_n` that occurs (vLLM's prompt_lookup_max / _min, llama.cpp's
    lookup decoding)."""

    k: int = 4
    max_n: int = 4
    min_n: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if self.k < 1:
            raise ValueError(f"k must be at least 1, got {self.k}")

    def propose(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """Up to min(k, `limit`) tokens to verify after `token_ids` (the prompt and the output so far); [] when no
        suffix of at least `min_n` tokens occurred before."""
        count = self.k if limit is None else min(self.k, limit)
        tokens = np.asarray(token_ids, dtype=np.int64)
        if count <= 0 or tokens.size < self.min_n + 1:
            return []
        for n in range(min(self.max_n, tokens.size - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # windows starting at 0 .. size-n-1: every earlier occurrence (the suffix itself starts at size-n)
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # what followed the latest occurrence
                return tokens[start:start + count].tolist()
        return []


def verification_rows(row: SamplingRow, proposal: Sequence[int]) -> list[SamplingRow]:
    """The rows whose samples verify `proposal` for `row`: for j = 0 .. len(proposal), the row as plain decoding
    would sample it after the first j proposed tokens (the target's logits at that position go with it)."""
    if row.grammar is not None:
        raise ValueError("a row under a grammar is not verified by proposal: its matcher would have to advance "
                         "along the proposal")
    outputs = list(row.output_token_ids)
    return [replace(row, output_token_ids=[*outputs, *proposal[:j]]) for j in range(len(proposal) + 1)]


def accepted(proposal: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verified proposal yields: `proposal` up to its first difference from the target's samples
    `sampled` (one per verification row: len(proposal) + 1), then the sample there. At least one token; a stop
    token among them ends the sequence there as in plain decoding (the caller appends them one by one)."""
    if len(sampled) != len(proposal) + 1:
        raise ValueError(f"expected {len(proposal) + 1} samples for a proposal of {len(proposal)}, got {len(sampled)}")
    kept = 0
    while kept < len(proposal) and proposal[kept] == sampled[kept]:
        kept += 1
    return [*proposal[:kept], sampled[kept]]


@dataclass
class SpeculationStats:
    """Counters for /metrics and the benchmarks (vLLM's spec_decode_num_draft_tokens / _accepted_tokens)."""

    num_drafts: int = 0  # proposals verified (one per request per step)
    num_proposed: int = 0  # tokens proposed
    num_accepted: int = 0  # of those, accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0


PRIOR_ROW_COST = 0.25  # before the row counts vary: a row's cost b, as a fraction of a one-row step's a + b
PRIOR_WEIGHT = 4.0  # how many squared rows of spread the prior slope counts for
COST_DECAY = 0.98  # weight of the previous step in the cost fit (about the last 50 steps count)
ACCEPTANCE_DECAY = 0.8  # weight of a request's earlier proposals in its acceptance rate
RELAX_DECAY = 0.95  # per step without a proposal, toward the prior
PRIOR_ACCEPTANCE = (1.0, 2.0)  # a new request's rate: as if 1 of 2 proposed tokens had been accepted


@dataclass
class StepCost:
    """Seconds per decode step as a + b * rows, fitted by decayed least squares over the steps measured (the slope
    held near a prior until the row counts vary)."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def record(self, rows: int, seconds: float) -> None:
        d = COST_DECAY
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + rows, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b): seconds per step and per row; None before any step was measured. The slope is shrunk toward the
        prior (PRIOR_ROW_COST of the mean step per row) by PRIOR_WEIGHT, so steps of nearly one row count do not
        make it up."""
        if self.n == 0:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        spread = self.sxx - self.n * mean_x * mean_x  # sum of squared deviations of the row counts
        covariance = self.sxy - self.n * mean_x * mean_y
        prior = PRIOR_ROW_COST * mean_y / max(mean_x, 1.0)
        b = max((covariance + PRIOR_WEIGHT * prior) / (max(spread, 0.0) + PRIOR_WEIGHT), 0.0)
        return max(mean_y - b * mean_x, 0.0), b

    def break_even(self, num_requests: int) -> float:
        """The acceptance probability above which a proposed token pays for its row in a step of `num_requests`."""
        fitted = self.coefficients()
        if fitted is None:
            return PRIOR_ROW_COST
        a, b = fitted
        spent = a + b * num_requests
        return 1.0 if spent <= 0 else min(1.0, b * num_requests / spent)


@dataclass
class Speculation:
    """Drafts the decodes of a plan (`draft`) and learns from the results (`observe`): see the module's docstring."""

    options: SpeculativeOptions
    scheduler: Scheduler
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    cost: StepCost = field(default_factory=StepCost)
    _acceptance: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> decayed (accepted, proposed)

    def __post_init__(self) -> None:
        opts = self.options
        self.proposer = NgramProposer(opts.k, opts.prompt_lookup_max, opts.prompt_lookup_min)

    def draft(self, plan: SchedulerOutput) -> None:
        """Give each decode of `plan` a proposal, within the step's token budget, the request's max_tokens and the
        model's length; one whose slots the pool cannot supply goes without (nobody is preempted for a proposal)."""
        scheduler = self.scheduler
        budget = scheduler.max_num_batched_tokens - plan.num_batched_tokens
        threshold = self.cost.break_even(len(plan.scheduled))
        for item in plan.scheduled:
            request = item.request
            if budget <= 0:
                break
            if item.num_new_tokens != 1 or not item.samples or request.grammar is not None:
                continue
            depth = self.depth(request.request_id, threshold)
            if depth == 0:
                self._relax(request.request_id)
            limit = min(depth, budget, request.max_tokens - request.num_output_tokens - 1,
                        scheduler.max_model_len - request.num_tokens - 1)
            if limit <= 0:
                continue
            proposal = self.proposer.propose(request.token_ids, limit)
            if proposal and scheduler.kv.allocate_slots(request, 1 + len(proposal)):
                item.draft = proposal
                budget -= len(proposal)

    def depth(self, request_id: str, threshold: float) -> int:
        """How many tokens to propose: all of k without adaptation; else the deepest j with r**j above
        `threshold`, r the request's acceptance rate."""
        k = self.options.k
        if not self.options.adaptive:
            return k
        if threshold >= 1.0:
            return 0
        accepted, proposed = self._acceptance.get(request_id, PRIOR_ACCEPTANCE)
        rate = min(accepted / proposed, 0.999) if proposed else 0.0
        if rate <= threshold:
            return 0
        if threshold <= 0.0:
            return k
        return min(k, int(math.log(threshold) / math.log(rate)))

    def _relax(self, request_id: str) -> None:
        """A request that proposed nothing drifts back toward the prior rate (RELAX_DECAY a step), so it tries again
        now and then: an output may start copying its input later."""
        if (counts := self._acceptance.get(request_id)) is not None:
            d = RELAX_DECAY
            self._acceptance[request_id] = (d * counts[0] + (1 - d) * PRIOR_ACCEPTANCE[0],
                                            d * counts[1] + (1 - d) * PRIOR_ACCEPTANCE[1])

    def observe(self, plan: SchedulerOutput, sampled: dict[str, list[int]], seconds: float | None) -> None:
        """A step's results: each proposal's accepted length into its request's rate and the stats; the step's time
        (`seconds`, where it ran whole at once) into the cost fit when it was decode rows only."""
        for item in plan.scheduled:
            if not item.draft:
                continue
            request_id = item.request.request_id
            tokens = sampled.get(request_id)
            if tokens is None:  # the request failed in this step
                continue
            kept = len(tokens) - 1
            trials = kept + (1 if kept < len(item.draft) else 0)  # the accepted ones, and the one rejected
            accepted, proposed = self._acceptance.get(request_id, PRIOR_ACCEPTANCE)
            self._acceptance[request_id] = (ACCEPTANCE_DECAY * accepted + kept, ACCEPTANCE_DECAY * proposed + trials)
            self.stats.num_drafts += 1
            self.stats.num_proposed += len(item.draft)
            self.stats.num_accepted += kept
        if seconds is not None and plan.scheduled and all(i.num_new_tokens == 1 for i in plan.scheduled):
            self.cost.record(sum(i.num_query_tokens for i in plan.scheduled), seconds)
        if len(self._acceptance) > 2 * len(self.scheduler.requests) + 64:  # forget finished requests
            self._acceptance = {k: v for k, v in self._acceptance.items() if k in self.scheduler.requests}
