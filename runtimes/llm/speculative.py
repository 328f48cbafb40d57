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

Not here yet: the engine's verify step (a multi-token decode over the paged cache, the rejected tokens' KV slots
handed back). Rows under a grammar are not verified this way (their matcher would have to advance along the
proposal): they decode one token at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from runtimes.llm.logits_processors import SamplingRow


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
