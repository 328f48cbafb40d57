"""Speculative decoding's model-free parts (runtimes/llm/speculative.py): prompt lookup proposes what followed the
latest earlier occurrence of the sequence's suffix; verification with the engine's own sampler gives a greedy or
seeded request the same tokens as plain decoding, whatever is proposed, and an unseeded one the same distribution.

The "model" here is a bigram table (the next token's logits depend on the last token only), run by a plain decode
loop and by a speculative one that verifies each proposal against the table's logits at every proposed position,
as the engine's verify step will from one forward pass."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtimes.llm.logits_processors import SamplingRow
from runtimes.llm.sampler import Sampler
from runtimes.llm.sampling_params import SamplingParams
from runtimes.llm.speculative import NgramProposer, accepted, verification_rows

V = 6


def bigram_table(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=generator) * 1.5


class RandomProposer:
    """Proposes anything: verification must not care what."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        count = self.rng.randint(0, 4 if limit is None else min(4, limit))
        return [self.rng.randrange(V) for _ in range(count)]


def plain(table: torch.Tensor, sampler: Sampler, prompt: list[int], params: SamplingParams, seed: int | None,
          length: int) -> list[int]:
    out: list[int] = []
    while len(out) < length:
        row = SamplingRow(params, prompt, list(out), seed)
        out += sampler(table[(prompt + out)[-1]].unsqueeze(0), [row]).token_ids
    return out


def speculative(table: torch.Tensor, sampler: Sampler, proposer, prompt: list[int], params: SamplingParams,
                seed: int | None, length: int) -> tuple[list[int], int]:
    out: list[int] = []
    steps = 0
    while len(out) < length:
        proposal = proposer.propose(prompt + out, limit=length - len(out) - 1)
        rows = verification_rows(SamplingRow(params, prompt, list(out), seed), proposal)
        context = prompt + out + proposal
        logits = torch.stack([table[context[len(prompt) + len(out) + j - 1]] for j in range(len(proposal) + 1)])
        out += accepted(proposal, sampler(logits, rows).token_ids)
        steps += 1
    return out, steps


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    proposer = NgramProposer(k=3, max_n=3, min_n=1)
    assert proposer.propose([7, 1, 2, 3, 4, 1, 2]) == [3, 4, 1]  # [1, 2] occurred at 1: 3, 4, 1 followed
    assert proposer.propose([1, 2, 9, 5, 1, 2, 8, 5, 1, 2]) == [8, 5, 1]  # the latest of two occurrences
    assert proposer.propose([3, 2, 5, 9, 8, 2, 5, 7, 3, 2, 5]) == [9, 8, 2]  # [3, 2, 5] beats the later [2, 5]
    assert proposer.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert proposer.propose([5, 6, 5]) == [6, 5]  # fewer than k follow
    assert proposer.propose([1, 2, 1], limit=1) == [2] and proposer.propose([1, 2, 1], limit=0) == []
    assert NgramProposer(min_n=2).propose([1, 2, 3, 1]) == []  # a one-token match is below min_n
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(max_n=1, min_n=2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(1, 5), st.integers(1, 4))
def test_a_proposal_is_what_followed_an_earlier_occurrence_of_the_suffix(tokens, k, max_n):
    proposal = NgramProposer(k=k, max_n=max_n).propose(tokens)
    assert len(proposal) <= k
    if not proposal:
        return
    found = [(n, start) for n in range(max_n, 0, -1) for start in range(len(tokens) - n)
             if tokens[start:start + n] == tokens[-n:] and tokens[start + n:start + n + len(proposal)] == proposal]
    assert found, (tokens, proposal)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.lists(st.integers(1, 4), min_size=1, max_size=20),
       st.integers(1, 4), st.integers(1, 4))
def test_an_index_kept_as_the_sequence_grows_proposes_as_a_fresh_one(tokens, growth, min_n, extra):
    """The engine keeps a sequence's n-gram index from step to step (tokens arrive one or several at a time)."""
    proposer = NgramProposer(k=5, max_n=min_n + extra - 1, min_n=min_n)
    index, at = proposer.index(), 1
    for more in [*growth, len(tokens)]:
        at = min(at + more, len(tokens))
        assert proposer.propose(tokens[:at], index=index) == proposer.propose(tokens[:at])
        if at == len(tokens):
            break


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 5))
def test_an_index_built_a_few_positions_a_step_proposes_only_what_followed_and_catches_up(tokens, per_step):
    """A long sequence's older positions are indexed over several steps: meanwhile a proposal still follows a real
    earlier occurrence, and once caught up the index proposes what a fresh, whole one does."""
    import runtimes.llm.speculative as speculative

    proposer = NgramProposer(k=4, max_n=3, min_n=1)
    whole = proposer.propose(tokens)
    saved, speculative.INDEX_PER_STEP = speculative.INDEX_PER_STEP, per_step
    try:
        index = proposer.index()
        for _ in range(len(tokens) // per_step + 1):
            partial = proposer.propose(tokens, index=index)
            assert not partial or any(tokens[s:s + n] == tokens[-n:] and tokens[s + n:s + n + len(partial)] == partial
                                      for n in range(1, 4) for s in range(len(tokens) - n))
        assert proposer.propose(tokens, index=index) == whole
    finally:
        speculative.INDEX_PER_STEP = saved


def test_accepted_keeps_the_proposal_up_to_its_first_difference_then_the_sample_there():
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all kept: the bonus token after
    assert accepted([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accepted([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accepted([], [3]) == [3]
    with pytest.raises(ValueError, match="expected 3 samples"):
        accepted([1, 2], [1, 2])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=64),
    SamplingParams(temperature=0, max_tokens=64, repetition_penalty=1.3, frequency_penalty=0.5),
], ids=["greedy", "greedy with penalties"])
def test_greedy_decoding_gives_the_same_tokens_with_any_proposals(params):
    table, sampler = bigram_table(), Sampler()
    prompt = [0, 1, 2, 3, 4, 5, 0, 1, 2]
    want = plain(table, sampler, prompt, params, None, 40)
    for proposer in (NgramProposer(k=4), RandomProposer(1), RandomProposer(2)):
        got, steps = speculative(table, sampler, proposer, prompt, params, None, 40)
        assert got == want
    _, steps = speculative(table, sampler, NgramProposer(k=4), prompt, params, None, 40)
    assert steps <= 20  # 40 tokens in at most 20 verify steps: a bigram model's greedy output cycles, lookup gets ahead


def test_a_seeded_request_gets_the_same_tokens_with_any_proposals():
    table, sampler = bigram_table(3), Sampler()
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=64, presence_penalty=0.4, min_tokens=3)
    for seed in (0, 7, 12345):
        want = plain(table, sampler, prompt, params, seed, 30)
        for proposer in (NgramProposer(k=3), RandomProposer(seed)):
            assert speculative(table, sampler, proposer, prompt, params, seed, 30)[0] == want


def chi2_p_value(counts: torch.Tensor) -> float:
    """Chi-square test of homogeneity of two rows of counts (cells with fewer than 20 in all pooled)."""
    keep = counts.sum(dim=0) >= 20
    pooled = counts[:, keep]
    if not keep.all():
        pooled = torch.cat([pooled, counts[:, ~keep].sum(dim=1, keepdim=True)], dim=1)
    expected = pooled.sum(dim=0, keepdim=True) * pooled.sum(dim=1, keepdim=True) / pooled.sum()
    chi2 = ((pooled - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((pooled.shape[1] - 1) / 2), chi2 / 2))


def test_unseeded_sampling_keeps_its_distribution():
    """Joint distribution of the first three tokens, 4,000 runs each way: a chi-square test of homogeneity does not
    tell speculative from plain sampling, and does tell a broken verifier (one that keeps every proposal). The
    proposer proposes at random, so proposals are rejected and accepted alike."""
    table, runs = bigram_table(5), 4000
    params = SamplingParams(temperature=1.0, max_tokens=3)
    samplers = [Sampler(torch.Generator().manual_seed(i)) for i in range(3)]
    proposer = RandomProposer(9)

    def keep_all(proposal: list[int], sampled: list[int]) -> list[int]:
        return [*proposal, sampled[-1]]

    counts = torch.zeros(3, V ** 3)
    for _ in range(runs):
        a = plain(table, samplers[0], [0], params, None, 3)
        b = speculative(table, samplers[1], proposer, [0], params, None, 3)[0]
        proposal = proposer.propose([0], limit=2)
        rows = verification_rows(SamplingRow(params, [0], [], None), proposal)
        context = [0, *proposal]
        logits = torch.stack([table[context[j]] for j in range(len(proposal) + 1)])
        c = keep_all(proposal, samplers[2](logits, rows).token_ids)
        c += plain(table, samplers[2], [0, *c], params, None, 3 - len(c))
        for row, tokens in enumerate((a, b, c)):
            counts[row, tokens[0] * V * V + tokens[1] * V + tokens[2]] += 1
    assert chi2_p_value(counts[[0, 1]]) > 0.001
    assert chi2_p_value(counts[[0, 2]]) < 1e-6


def test_a_row_under_a_grammar_is_not_verified_by_proposal():
    row = SamplingRow(SamplingParams(), [1], [], None, grammar=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grammar"):
        verification_rows(row, [1, 2])
    rows = verification_rows(SamplingRow(SamplingParams(), [1], [5], 3), [6, 7])
    assert [list(r.output_token_ids) for r in rows] == [[5], [5, 6], [5, 6, 7]] and {r.seed for r in rows} == {3}
