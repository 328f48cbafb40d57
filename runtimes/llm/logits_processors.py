"""Edits to a batch's logits before a token is drawn, as processors applied in one place (`Sampler`).

A processor is one kind of edit: a logit bias, the repetition penalty, presence and frequency penalties, tokens
suppressed until `min_tokens`, the tokens a request's grammar does not allow (constrained decoding). Each says which
rows want it (`wants`), from what the row carries, and edits all of them in one batched call on the logits' device
(`apply`, in place on the `[B, V]` fp32 logits). The order of the processors is the order of the edits (see
`BUILTIN_PROCESSORS`).

A row that no processor wants, and that asks for no logprobs, needs nothing but its logits: the sampler's fast paths
(the all-greedy argmax; tokens left on the device for a step launched ahead) take exactly those rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from runtimes.llm.grammar import FixedMask, GrammarMatcher, allocate_bitmask, apply_bitmask
from runtimes.llm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """One row of the batch: the sequence to sample the next token for."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # The sequence's seed (the request's `seed`, plus the sample's index when n > 1), or None: unseeded. Its noise
    # for the next token is keyed by (seed, len(output_token_ids)).
    seed: int | None
    # Suppressed with params.stop_token_ids while len(output_token_ids) < params.min_tokens
    # (EOS is not suppressed when params.ignore_eos, as in vLLM: it does not stop the sequence then).
    eos_token_ids: tuple[int, ...] = ()
    # constrained decoding: the tokens its grammar allows next (a verified position's: computed ahead, speculative.py)
    grammar: GrammarMatcher | FixedMask | None = None
    max_tokens: int | None = None  # the sequence's budget of output tokens (None: unknown)


class LogitsProcessor(Protocol):
    """One kind of edit to the logits, for the rows that want it."""

    def wants(self, row: SamplingRow) -> bool:
        """Whether this row's next token needs the edit (cheap: asked for every row of every step). Once false for a
        row it must stay false at the row's later tokens: a step launched ahead samples from the logits alone."""
        ...

    def apply(self, logits: torch.Tensor, rows: Sequence[int], batch: Sequence[SamplingRow]) -> None:
        """Edit `logits` `[B, V]` (fp32, a copy the sampler owns) in place, at the batch rows `rows` (those that want
        it, ascending); `batch` is every row of the batch."""
        ...


class LogitBias:
    """OpenAI's `logit_bias`: each (token id, bias) added to the row's logit. Ids were checked against the vocabulary
    when the request was accepted (SamplingParams.check_vocab)."""

    def wants(self, row: SamplingRow) -> bool:
        return bool(row.params.logit_bias)

    def apply(self, logits: torch.Tensor, rows: Sequence[int], batch: Sequence[SamplingRow]) -> None:
        biased = [(i, batch[i].params.logit_bias) for i in rows]
        row_idx, tok_idx = flat_index([(i, [t for t, _ in bias]) for i, bias in biased], logits.device)
        values = torch.tensor([b for _, bias in biased for _, b in bias], dtype=logits.dtype, device=logits.device)
        logits.index_put_((row_idx, tok_idx), values, accumulate=True)


class RepetitionPenalty:
    """vLLM's `repetition_penalty` over the prompt and the output: a seen token's positive logit divided by it, a
    negative one multiplied, so the penalty always lowers it."""

    def wants(self, row: SamplingRow) -> bool:
        return row.params.repetition_penalty != 1.0

    def apply(self, logits: torch.Tensor, rows: Sequence[int], batch: Sequence[SamplingRow]) -> None:
        seen = torch.zeros_like(logits, dtype=torch.bool)  # [B, V]: token in prompt or output
        pairs = [(i, ids) for i in rows for ids in (batch[i].prompt_token_ids, batch[i].output_token_ids)]
        seen[flat_index(pairs, logits.device)] = True
        penalty = _column([r.params.repetition_penalty for r in batch], logits.device)  # [B, 1]
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits))


class PresenceFrequencyPenalty:
    """OpenAI's presence and frequency penalties, over the output only: minus presence once a token occurred, minus
    frequency times its count."""

    def wants(self, row: SamplingRow) -> bool:
        return bool(row.params.presence_penalty or row.params.frequency_penalty)

    def apply(self, logits: torch.Tensor, rows: Sequence[int], batch: Sequence[SamplingRow]) -> None:
        counts = torch.zeros_like(logits)  # [B, V]: occurrences in the output
        row_idx, tok_idx = flat_index([(i, batch[i].output_token_ids) for i in rows], logits.device)
        counts.index_put_((row_idx, tok_idx), torch.ones_like(tok_idx, dtype=logits.dtype), accumulate=True)
        freq = _column([r.params.frequency_penalty for r in batch], logits.device)  # [B, 1]
        presence = _column([r.params.presence_penalty for r in batch], logits.device)  # [B, 1]
        logits -= freq * counts + presence * (counts > 0)  # other rows: minus exact zeros


class MinTokens:
    """`min_tokens`: EOS (unless `ignore_eos`) and `stop_token_ids` get logit -inf while the output is shorter. A row
    short of its minimum wants this even with nothing to suppress, so that "wanted by no processor" stays true at
    every later token once it is true (a step launched ahead relies on it)."""

    def wants(self, row: SamplingRow) -> bool:
        return len(row.output_token_ids) < row.params.min_tokens

    def apply(self, logits: torch.Tensor, rows: Sequence[int], batch: Sequence[SamplingRow]) -> None:
        pairs = [(i, ids) for i in rows if (ids := suppressed_ids(batch[i]))]
        if pairs:
            logits[flat_index(pairs, logits.device)] = _NEG_INF


class GrammarMask:
    """Constrained decoding (`SamplingParams.structured`): tokens the row's grammar does not allow next get -inf. Each
    matcher fills its row of one bitmask on the host (what a grammar allows is host work), applied in one call on the
    logits' device. A JSON output near the end of its budget is allowed only its closing plan's next token
    (runtimes/llm/grammar/closing.py)."""

    def wants(self, row: SamplingRow) -> bool:
        return row.grammar is not None

    def apply(self, logits: torch.Tensor, rows: Sequence[int], batch: Sequence[SamplingRow]) -> None:
        bitmask = allocate_bitmask(len(rows), logits.shape[1])
        for at, i in enumerate(rows):
            row = batch[i]
            assert row.grammar is not None
            remaining = None if row.max_tokens is None else row.max_tokens - len(row.output_token_ids)
            row.grammar.fill_bitmask(bitmask, at, remaining)
        apply_bitmask(logits, bitmask, rows)


def suppressed_ids(row: SamplingRow) -> tuple[int, ...]:
    """The token ids `MinTokens` suppresses for this row's next token."""
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return ()
    return (*(() if p.ignore_eos else row.eos_token_ids), *p.stop_token_ids)


# The built-ins, in their order: the bias first (OpenAI adds it to the model's logits), then the penalties (which
# scale by sign, so they see the biased logit), then suppression and the grammar's mask (nothing may lift a token
# either takes away).
BUILTIN_PROCESSORS: tuple[LogitsProcessor, ...] = (
    LogitBias(), RepetitionPenalty(), PresenceFrequencyPenalty(), MinTokens(), GrammarMask())


def flat_index(pairs: Sequence[tuple[int, Sequence[int]]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token ids) pairs -> (row indices, token indices) `[N]` long tensors for indexing a [B, V]."""
    row_idx = [torch.full((len(ids),), i, dtype=torch.long) for i, ids in pairs]
    tok_idx = [torch.as_tensor(ids, dtype=torch.long) for _, ids in pairs]
    return torch.cat(row_idx).to(device), torch.cat(tok_idx).to(device)


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [B, 1]
