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

How much to propose (`adaptive`): a verified row costs what one more row adds to the step, and a proposed token pays
only if it is accepted, which gets less likely the deeper it lies. From the decode steps' measured times by row
count (`StepCost`) and the acceptance rate r expected of its proposal (the request's own recent rate, next to the
replica's for proposals from a match of the same length: a long match is far likelier right), each request proposes
the j that most exceeds its rows' cost by its expected gain: r + r**2 + ... + r**j tokens, each worth what a plain
step spends per token (its time over its requests). So a lone stream proposes deep when its proposals keep being
accepted, a request whose proposals fail stops (drifting back to try again now and then), and in a large batch,
where a row costs about what a token is worth, only a request whose proposals are nearly always right proposes. A
request under a grammar (structured outputs) is proposed to as well: its proposal stops before the first token the
grammar refuses (it could never be sampled), an EOS, or a token that completes the grammar (plain decoding ends the
output there), and each verified position is sampled under the grammar's mask there, computed ahead by a copy of the
matcher walking the proposal (`GrammarMatcher.masks_along`); the accepted tokens then advance the matcher as plain
decoding's do. A JSON form proposes only while more than the closing window's tokens of its budget are left
(grammar/closing.py: near the end its output follows a closing plan). A grammar that fails while its masks are made
costs only the request's proposal (it fails the request where plain decoding would).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from runtimes.llm.grammar.closing import CLOSE_WINDOW
from runtimes.llm.logits_processors import SamplingRow

if TYPE_CHECKING:
    from registry.engine import SpeculativeOptions
    from runtimes.llm.grammar import FixedMask
    from runtimes.llm.request import Request
    from runtimes.llm.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

log = structlog.get_logger(__name__)


INDEX_PER_STEP = 4096  # older positions indexed per proposal, newest first: a long prompt's index is built over steps


class NgramIndex:
    """Where each n-gram of a growing sequence (n from `min_n` to `max_n`) last ended, among those that end before
    its last token: kept as the sequence grows, a few dict updates per new token, so a proposal costs no scan of the
    sequence (a numpy scan of a 250-token chat measured ~0.2 ms a step, 4 % of a SmolLM2 decode step). What the
    sequence held when it was first seen is indexed from its end backwards, INDEX_PER_STEP positions a call, so a long
    prompt never stalls a step (its latest part, the likeliest source, comes first)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        # n -> {n-gram: where it last ended}, longest n first
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(max_n, min_n - 1, -1)}
        self.low = self.high = -1  # n-grams ending (exclusive) at positions low .. high are in the tables

    def follow(self, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """Where the latest earlier occurrence of the sequence's longest indexed suffix ended (what followed it starts
        there), and that suffix's length; None when no suffix of `min_n` or more tokens occurred before (or was
        indexed yet). `token_ids` only ever grows."""
        size = len(token_ids)
        if self.high < 0:  # first seen: everything before the last token is older, indexed backwards
            self.high, self.low = size - 1, size
        self._add(token_ids, range(self.high + 1, size), latest_wins=True)  # new n-grams, ending before the last token
        self.high = max(self.high, size - 1)
        stop = max(self.low - INDEX_PER_STEP, 1)
        self._add(token_ids, range(self.low - 1, stop - 1, -1), latest_wins=False)  # older ones, newest first
        self.low = min(self.low, stop)
        for n, table in self.tables.items():
            if n < size and (found := table.get(tuple(token_ids[size - n:]))) is not None:
                return found, n
        return None

    def _add(self, token_ids: Sequence[int], ends: range, latest_wins: bool) -> None:
        """Index the n-grams ending (exclusive) at `ends`; where one is there already, the later end stays."""
        for end in ends:
            for n, table in self.tables.items():
                if end >= n:
                    gram = tuple(token_ids[end - n:end])
                    if latest_wins:
                        table[gram] = end
                    else:
                        table.setdefault(gram, end)


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to `k` tokens: those that followed the latest earlier occurrence of the sequence's last n tokens,
    for the longest n from `max_n` down to `min_n` that occurs (vLLM's prompt_lookup_max / _min, llama.cpp's
    lookup decoding)."""

    k: int = 4
    max_n: int = 4
    min_n: int = 1
    key = None  # (not a field) a proposal's key is the length of its match, known once it is made

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if self.k < 1:
            raise ValueError(f"k must be at least 1, got {self.k}")

    def index(self) -> NgramIndex:
        """A sequence's index, kept by the caller from step to step (`propose(..., index=)`)."""
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, token_ids: Sequence[int], limit: int | None = None, index: NgramIndex | None = None
                ) -> list[int]:
        """Up to min(k, `limit`) tokens to verify after `token_ids` (the prompt and the output so far); [] when no
        suffix of at least `min_n` tokens occurred before. `index`: the sequence's, brought up to date here (else
        one is built for this call)."""
        count = self.k if limit is None else min(self.k, limit)
        found = self.lookup(token_ids, index or self.index(), count) if count > 0 else None
        return [] if found is None else found.tokens

    def lookup(self, token_ids: Sequence[int], index: NgramIndex, limit: int | None = None) -> Lookup | None:
        """The proposal (up to k tokens, and `limit`) and the length of the match it comes from; None: no match."""
        found = index.follow(token_ids)
        if found is None:
            return None
        end, n = found
        return Lookup(list(token_ids[end:end + (self.k if limit is None else min(self.k, limit))]), n)

    def lookup_many(self, wanted: Sequence[tuple[Sequence[int], NgramIndex, int]]) -> list[Lookup | None]:
        return [self.lookup(token_ids, index, limit) for token_ids, index, limit in wanted]


@dataclass(frozen=True)
class Lookup:
    """A proposal of up to k tokens, and what it is learned under (`key`: the length of the n-gram it matched, the
    best predictor of its acceptance: on SmolLM2, a 4-gram's next token was right 94 % of the time, a 1-gram's 18-29
    %)."""

    tokens: list[int]
    key: int


def verification_rows(row: SamplingRow, proposal: Sequence[int], masks: Sequence[FixedMask] = ()
                      ) -> list[SamplingRow]:
    """The rows whose samples verify `proposal` for `row`: for j = 0 .. len(proposal), the row as plain decoding
    would sample it after the first j proposed tokens (the target's logits at that position go with it). A row under
    a grammar takes `masks[j]`, its grammar's mask there (`GrammarMatcher.masks_along`)."""
    if row.grammar is not None and len(masks) != len(proposal) + 1:
        raise ValueError(f"a row under a grammar needs the mask of each of its {len(proposal) + 1} verified "
                         f"positions, got {len(masks)}")
    outputs = list(row.output_token_ids)
    return [replace(row, output_token_ids=[*outputs, *proposal[:j]],
                    grammar=masks[j] if row.grammar is not None else None) for j in range(len(proposal) + 1)]


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
MIN_SEEN = 3  # steps measured at a row count before their mean stands for it
OUTLIER = 3.0  # a step measured at more than this many times its predicted time counts as this many
COST_WEIGHT = 0.1  # weight of the newest proposal in `proposal_cost`
PROBE_EVERY = 64  # a draft that stopped paying proposes one token after this many decisions not to
COST_DECAY = 0.98  # weight of the previous step in the cost fit (about the last 50 steps count)
ACCEPTANCE_DECAY = 0.8  # weight of a request's earlier proposals in its own acceptance rate
SHARED_DECAY = 0.98  # weight of earlier proposals in the replica's rate for a match length
RELAX_DECAY = 0.98  # per step without a proposal: a request's own counts fade (its rate toward the shared one)
PRIOR_RATE = 0.4  # a match length's rate before any of its proposals was verified ...
PRIOR_WEIGHT_TRIALS = 2.5  # ... counting as this many trials
OWN_WEIGHT = 3.0  # the shared rate counts as this many trials next to a request's own


@dataclass
class StepCost:
    """Seconds per decode step by its number of rows: the decayed mean of the steps measured at that count where
    there are MIN_SEEN of them, else a + b * rows fitted by decayed least squares over all (the slope held near a
    prior until the row counts vary). The measured means catch what a line misses: the CPU's int8 kernel passes over
    the weights once per tile of rows (up to 4, or 6 with AVX-512), so some row counts cost more than the next."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    by_rows: dict[int, tuple[float, float]] = field(default_factory=dict)  # rows -> (steps seen, mean seconds)

    def record(self, rows: int, seconds: float) -> None:
        """A decode step of `rows` rows took `seconds`; a step far slower than predicted (the machine was busy
        elsewhere) counts as OUTLIER times the prediction, so one stall does not price a row count out for long."""
        if (predicted := self.seconds(rows)) is not None:
            seconds = min(seconds, OUTLIER * predicted)
        d = COST_DECAY
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + rows, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * seconds
        count, mean = self.by_rows.get(rows, (0.0, 0.0))
        weight = max(1 - d, 1 / (count + 1))  # a running mean at first, then decayed as the fit is
        self.by_rows[rows] = (count + 1, mean + weight * (seconds - mean))

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

    def seconds(self, rows: int) -> float | None:
        """A decode step's expected seconds at `rows` rows; None before any step was measured."""
        count, mean = self.by_rows.get(rows, (0.0, 0.0))
        if count >= MIN_SEEN:
            return mean
        fitted = self.coefficients()
        return None if fitted is None else fitted[0] + fitted[1] * rows


@dataclass
class Acceptance:
    """Decayed counts of proposed tokens accepted, and of trials (the accepted ones, and the one rejected)."""

    accepted: float = 0.0
    trials: float = 0.0

    def learn(self, kept: int, trials: int, decay: float) -> None:
        self.accepted = decay * self.accepted + kept
        self.trials = decay * self.trials + trials

    def rate(self, prior: float, weight: float) -> float:
        """The acceptance rate, `prior` counting as `weight` trials."""
        return (self.accepted + weight * prior) / (self.trials + weight)


class Proposer(Protocol):
    """Where proposals come from: prompt lookup (`NgramProposer`) or a draft model (runtimes/llm/draft.py)."""

    def index(self) -> Any:
        """What the proposer keeps of one sequence from step to step (handed back to `lookup`)."""

    def lookup(self, token_ids: Sequence[int], index: Any, limit: int) -> Lookup | None:
        """Up to `limit` tokens to verify after `token_ids`, with their key for learned acceptance; None: none."""

    def lookup_many(self, wanted: Sequence[tuple[Sequence[int], Any, int]]) -> list[Lookup | None]:
        """`lookup` for each (token_ids, index, limit), made together where the proposer can (a draft's batch)."""

    @property
    def key(self) -> int | None:
        """The key of every proposal, where it is known before one is made (a draft model's): its depth is then
        decided first, and the proposer makes only that many. None: known from the proposal (a match's length)."""


@dataclass
class SequenceState:
    """What speculation keeps of one sequence while it runs: its proposer's index and its own recent acceptance."""

    index: Any
    acceptance: Acceptance = field(default_factory=Acceptance)
    proposed: bool = False  # it has had a proposal (a draft's first prefills the whole sequence: not a token's cost)
    key: int | None = None  # the key of its proposal in the step running (`Lookup.key`)


@dataclass
class Speculation:
    """Drafts the decodes of a plan (`draft`) and learns from the results (`observe`): see the module's docstring."""

    options: SpeculativeOptions
    scheduler: Scheduler
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    cost: StepCost = field(default_factory=StepCost)
    # per running sequence, keyed by the request itself (an id may be used again once its request finished)
    sequences: dict[Request, SequenceState] = field(default_factory=dict)
    shared: dict[int, Acceptance] = field(default_factory=dict)  # Lookup.key -> the replica's acceptance
    proposal_cost: float = 0.0  # seconds a proposed token takes to make (decayed mean of the proposals made)
    _skipped: int = 0  # decisions of no proposal since the last probe

    source: Proposer | None = None  # where proposals come from; None: prompt lookup, as the options say
    proposer: Proposer = field(init=False)

    def __post_init__(self) -> None:
        opts = self.options
        self.proposer = self.source or NgramProposer(opts.k, opts.prompt_lookup_max, opts.prompt_lookup_min)

    def draft(self, plan: SchedulerOutput) -> None:
        """Give each decode of `plan` a proposal, within the step's token budget, the request's max_tokens and the
        model's length; one whose slots the pool cannot supply goes without (nobody is preempted for a proposal).
        A proposer whose proposals' key is known beforehand (a draft model) is told every depth first and makes the
        step's proposals in one call (`lookup_many`: one batch of the draft's engine)."""
        scheduler = self.scheduler
        budget = scheduler.max_num_batched_tokens - plan.num_batched_tokens
        rows = plan.num_batched_tokens
        base = self.cost.seconds(rows)
        key = self.proposer.key
        wanted: list[tuple[ScheduledRequest, SequenceState, int]] = []  # (decode, its state, its depth): key known
        for item in plan.scheduled:
            request = item.request
            if budget <= 0:
                break
            if item.num_new_tokens != 1 or not item.samples:
                continue
            state = self.sequences.get(request)
            if state is None:
                state = self.sequences[request] = SequenceState(self.proposer.index())
            left = request.max_tokens - request.num_output_tokens
            limit = min(self.options.k, budget, left - 1, scheduler.max_model_len - request.num_tokens - 1)
            if request.grammar is not None and request.grammar.plans_closing:  # its masks stay clear of the plan
                limit = min(limit, left - CLOSE_WINDOW - 1)
            if key is not None:  # decided before the proposal is made
                if self.options.adaptive and limit > 0:
                    limit = self.depth(self.rate(state, key), limit, rows, base, len(plan.scheduled))
                    if limit == 0 and self._probe_due():  # now and then one token, so what was measured is refreshed
                        limit = 1
                if limit > 0:
                    wanted.append((item, state, limit))
                    budget -= limit
                    rows += limit
                else:
                    self._none(item, state)
                continue
            found = self._lookup([(request, state, limit)])[0] if limit > 0 else None
            if found is not None and self.options.adaptive:
                limit = self.depth(self.rate(state, found.key), limit, rows, base, len(plan.scheduled))
            if self._take(item, state, found, limit):
                budget -= len(item.draft)
                rows += len(item.draft)
        if wanted:
            found_all = self._lookup([(item.request, state, limit) for item, state, limit in wanted])
            for (item, state, limit), found in zip(wanted, found_all, strict=True):
                self._take(item, state, found, limit)

    def _take(self, item: ScheduledRequest, state: SequenceState, found: Lookup | None, limit: int) -> bool:
        """Give `item` the first `limit` tokens of `found` and the KV slots they need; False: it goes without. Under
        a grammar, the proposal stops before the first token the grammar refuses (it could never be sampled) and
        each verified position gets its mask."""
        proposal = [] if found is None else found.tokens[:limit]
        grammar = item.request.grammar
        masks: list[FixedMask] = []
        if grammar is not None and proposal:
            try:
                masks = grammar.masks_along(proposal)
            except Exception as error:  # the grammar's own failure fails the request when it samples, not here
                log.warning("speculative_grammar_failed", request_id=item.request.request_id, error=repr(error))
            proposal = proposal[:max(len(masks) - 1, 0)]
        if proposal and self.scheduler.kv.allocate_slots(item.request, 1 + len(proposal)):
            item.draft = proposal
            item.draft_masks = masks
            state.key = found.key  # type: ignore[union-attr]
            return True
        self._none(item, state)
        return False

    def _none(self, item: ScheduledRequest, state: SequenceState) -> None:
        """`item` decodes without a proposal this step."""
        state.acceptance.learn(0, 0, RELAX_DECAY)
        self.scheduler.kv.trim(item.request)  # blocks a dropped step's proposal took (no step is launched ahead)

    def _lookup(self, wanted: Sequence[tuple[Request, SequenceState, int]]) -> list[Lookup | None]:
        """The proposer's proposals for (request, its state, limit), their time per token kept (`proposal_cost`;
        not when a sequence has its first, which for a draft prefills it whole); a proposer that fails costs only
        the proposals: the requests decode without them."""
        started = time.perf_counter()
        try:
            found = self.proposer.lookup_many([(r.token_ids, s.index, limit) for r, s, limit in wanted])
        except Exception as error:
            log.warning("speculative_proposal_failed", request_ids=[r.request_id for r, _, _ in wanted],
                        error=repr(error))
            return [None] * len(wanted)
        made = sum(len(f.tokens) for f in found if f is not None)
        if made and all(state.proposed for _, state, _ in wanted):
            per_token = (time.perf_counter() - started) / made
            weight = COST_WEIGHT if self.proposal_cost else 1.0  # the first sample stands alone
            self.proposal_cost += weight * (per_token - self.proposal_cost)
        for _, state, _ in wanted:
            state.proposed = True
        return found

    def _probe_due(self) -> bool:
        """Whether a proposer whose proposals stopped paying should make one more (every PROBE_EVERY decisions)."""
        self._skipped += 1
        if self._skipped < PROBE_EVERY:
            return False
        self._skipped = 0
        return True

    def rate(self, state: SequenceState, key: int) -> float:
        """The acceptance rate expected of a proposal: the request's own recent one, next to the replica's for
        proposals of its kind (`Lookup.key`)."""
        shared = self.shared.get(key)
        prior = PRIOR_RATE if shared is None else shared.rate(PRIOR_RATE, PRIOR_WEIGHT_TRIALS)
        return state.acceptance.rate(prior, OWN_WEIGHT)

    def depth(self, rate: float, limit: int, rows: int, base: float | None, num_requests: int) -> int:
        """How many tokens (up to `limit`) a request of acceptance rate `rate` should propose in a step of `rows`
        rows so far and `num_requests` requests: the j that most exceeds its rows' cost (`StepCost`: seconds(rows +
        j) - seconds(rows)) by its expected gain (rate + rate**2 + ... + rate**j tokens, each worth what a plain step
        spends per token: seconds(rows) / num_requests) less what making them costs (`proposal_cost` a token: a
        draft model's own steps; prompt lookup's is ~nothing)."""
        if base is None:  # nothing measured yet: a plain step first
            return 0
        value = base / max(num_requests, 1)
        best, best_net, gain, chance = 0, 0.0, 0.0, 1.0
        for j in range(1, limit + 1):
            chance *= rate
            gain += chance * value
            cost = self.cost.seconds(rows + j)
            assert cost is not None  # measured once: every count has an estimate
            net = gain - (cost - base) - j * self.proposal_cost
            if net > best_net:
                best, best_net = j, net
        return best

    def observe(self, plan: SchedulerOutput, sampled: dict[str, list[int]], seconds: float | None) -> None:
        """A step's results: each proposal's accepted length into its request's rate and the stats; the step's time
        (`seconds`, where it ran whole at once) into the cost fit when it was decode rows only."""
        for item in plan.scheduled:
            if not item.draft:
                continue
            tokens = sampled.get(item.request.request_id)
            if tokens is None:  # the request failed in this step
                continue
            kept = len(tokens) - 1
            trials = kept + (1 if kept < len(item.draft) else 0)  # the accepted ones, and the one rejected
            if (state := self.sequences.get(item.request)) is not None:
                state.acceptance.learn(kept, trials, ACCEPTANCE_DECAY)
                if state.key is not None:
                    self.shared.setdefault(state.key, Acceptance()).learn(kept, trials, SHARED_DECAY)
                    state.key = None
            self.stats.num_drafts += 1
            self.stats.num_proposed += len(item.draft)
            self.stats.num_accepted += kept
        if seconds is not None and plan.scheduled and all(i.num_new_tokens == 1 for i in plan.scheduled):
            self.cost.record(sum(i.num_query_tokens for i in plan.scheduled), seconds)
        if len(self.sequences) > len(self.scheduler.requests):  # some finished: forget them
            self.sequences = {r: s for r, s in self.sequences.items() if not r.status.finished}
