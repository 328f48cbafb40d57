"""Tests for the vectorized sampler (runtimes/llm/sampler.py)."""

from __future__ import annotations

import math

import pytest
import torch

from runtimes.llm.logits_processors import SamplingRow
from runtimes.llm.sampler import Sampler
from runtimes.llm.sampling_params import SamplingParams


def row(
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    eos: tuple[int, ...] = (),
    **params: object,
) -> SamplingRow:
    p = SamplingParams(**params)  # type: ignore[arg-type]
    return SamplingRow(p, list(prompt), list(output), p.seed, eos)


def probs_logits(probs: list[float], batch: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().expand(batch, -1).clone()  # [batch, V]


def counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float()


# --- greedy -----------------------------------------------------------------------------------------


def test_greedy_is_argmax_on_fast_and_full_paths() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(-1).tolist()
    fast = Sampler()(logits, [row(temperature=0.0) for _ in range(6)])
    assert fast.token_ids == expected and fast.logprobs is None
    full = Sampler()(logits, [row(temperature=0.0, logprobs=0) for _ in range(6)])
    assert full.token_ids == expected


def test_greedy_row_unaffected_by_other_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 100, generator=gen)
    greedy = row(temperature=0.0, presence_penalty=0.5, output=(3, 4))
    alone = Sampler()(logits[5:6], [greedy]).token_ids[0]
    others = [row(temperature=1.3, top_p=0.8), row(seed=5), row(top_k=3, logprobs=2), row(min_p=0.2)]
    rows = [*others, row(temperature=0.7), greedy, row(repetition_penalty=1.5, prompt=(1,)), row()]
    assert Sampler(torch.Generator().manual_seed(2))(logits, rows).token_ids[5] == alone


def test_bfloat16_logits_and_input_not_mutated() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    before = logits.clone()
    out = Sampler()(logits, [row(temperature=0.0, repetition_penalty=2.0, prompt=(0,), logprobs=1)] * 3)
    assert torch.equal(logits, before)
    assert out.logprobs is not None and all(math.isfinite(v) for v in out.logprobs)


# --- seeded reproducibility -------------------------------------------------------------------------


def _run_seeded(seed_params: dict[str, object], position: int | None, steps: int = 20) -> list[int]:
    """Sample `steps` tokens for one seeded request, alone (position None) or inside a mixed batch of 8."""
    logits_gen = torch.Generator().manual_seed(123)
    sampler = Sampler(torch.Generator().manual_seed(position or 0))
    target = row(prompt=(1, 2, 3), **seed_params)
    others = [
        row(temperature=0.0),
        row(seed=999),
        row(top_p=0.5, temperature=0.8),
        row(top_k=5, logprobs=3),
        row(min_p=0.1, presence_penalty=1.0),
        row(repetition_penalty=1.3, prompt=(7,)),
        row(temperature=2.0, min_tokens=5, eos=(0,)),
    ]
    batch = [target] if position is None else [*others[:position], target, *others[position:]]
    tokens = []
    for _ in range(steps):
        logits = torch.randn(8, 200, generator=logits_gen)  # same target logits in every scenario
        idx = 0 if position is None else position
        step_logits = logits[:1] if position is None else torch.roll(logits, shifts=position, dims=0)
        out = sampler(step_logits, batch)
        tokens.append(out.token_ids[idx])
        for r, t in zip(batch, out.token_ids, strict=True):
            r.output_token_ids.append(t)  # type: ignore[attr-defined]
    return tokens


@pytest.mark.parametrize(
    "seed_params",
    [{"seed": 42}, {"seed": 42, "top_p": 0.9, "top_k": 50, "frequency_penalty": 0.5, "temperature": 0.7}],
)
def test_seeded_row_reproducible_alone_or_at_any_batch_position(seed_params: dict[str, object]) -> None:
    alone = _run_seeded(seed_params, None)
    assert alone == _run_seeded(seed_params, None)
    for position in (0, 3, 7):
        assert _run_seeded(seed_params, position) == alone, position


def test_different_seeds_give_different_sequences() -> None:
    logits = torch.zeros(1, 1000)  # flat: every token equally likely
    runs = []
    for seed in (1, 2):
        r = row(seed=seed)
        tokens = []
        for _ in range(20):
            tokens.append(Sampler()(logits, [r]).token_ids[0])
            r.output_token_ids.append(tokens[-1])  # type: ignore[attr-defined]
        runs.append(tokens)
    assert runs[0] != runs[1]
    assert len(set(runs[0])) > 10  # each position draws fresh noise: not one token over and over


def test_seeded_token_is_a_function_of_seed_and_position_only() -> None:
    """What makes a resumed request exact: the token at output position k depends on the seed, k and the logits,
    not on the earlier outputs' values, nor on the sampler (a fresh one on another replica) or its history."""
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(11))
    used = Sampler(torch.Generator().manual_seed(1))
    for _ in range(3):
        used(logits, [row(seed=7, temperature=0.9)])  # some history on this sampler
    first = used(logits, [row(seed=7, temperature=0.9, output=(1, 2, 3))]).token_ids[0]
    assert Sampler()(logits, [row(seed=7, temperature=0.9, output=(9, 9, 9))]).token_ids[0] == first
    at_positions = [Sampler()(logits, [row(seed=7, temperature=0.9, output=(0,) * k)]).token_ids[0]
                    for k in range(12)]
    assert len(set(at_positions)) > 6  # positions draw unrelated noise


# --- top-k / top-p / min-p ---------------------------------------------------------------------------


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(4))
    out = Sampler(torch.Generator().manual_seed(0))(logits, [row(top_k=1, temperature=1.5)] * 16)
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.999}])  # topk-only path and sorting path
def test_top_k_samples_only_from_k_best(extra: dict[str, object]) -> None:
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(5)).expand(2000, -1)
    best = set(logits[0].topk(4).indices.tolist())
    rows = [row(top_k=4, temperature=3.0, **extra)] * 1000 + [row(temperature=3.0)] * 1000
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    assert set(out.token_ids[:1000]) == best  # all k reached, nothing else
    assert not set(out.token_ids[1000:]) <= best  # unrestricted rows in the same batch are not masked


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.999}])
def test_top_k_larger_than_vocab_keeps_everything(extra: dict[str, object]) -> None:
    logits = probs_logits([0.4, 0.3, 0.2, 0.1], batch=500)
    out = Sampler(torch.Generator().manual_seed(0))(logits, [row(top_k=100, **extra)] * 500)
    assert set(out.token_ids) == {0, 1, 2, 3}


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    logits = probs_logits([0.05, 0.5, 0.15, 0.3], batch=2000)
    out = Sampler(torch.Generator().manual_seed(0))(logits, [row(top_p=0.7)] * 2000)
    assert set(out.token_ids) == {1, 3}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    logits = probs_logits([0.15, 0.3, 0.05, 0.5], batch=2000)
    out = Sampler(torch.Generator().manual_seed(0))(logits, [row(min_p=0.35)] * 2000)  # threshold 0.175
    assert set(out.token_ids) == {1, 3}


# --- temperature / distribution ----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    base = torch.tensor([1.0, 2.0, 0.0, 1.5])
    n = 4000
    out = Sampler(torch.Generator().manual_seed(7))(base.expand(n, -1), [row(temperature=temperature)] * n)
    empirical = counts(out.token_ids, 4) / n
    expected = torch.softmax(base / temperature, dim=-1)
    assert torch.allclose(empirical, expected, atol=0.03), (empirical, expected)


# --- penalties ----------------------------------------------------------------------------------------


def _all_logprobs(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """Full logprob vector of one greedy row, read back from top_logprobs (vocab <= 20)."""
    out = Sampler()(logits, [r])
    assert out.top_logprobs[0] is not None
    lp = torch.empty(logits.shape[1])
    for tok, value in out.top_logprobs[0][: logits.shape[1]]:
        lp[tok] = value
    return lp


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0]])
    r = row(prompt=(0,), output=(1, 1), repetition_penalty=2.0, temperature=0.0, logprobs=5)
    expected = torch.tensor([1.0, -4.0, 1.0, 0.5, -1.0])  # tokens 0 and 1 seen, others untouched
    assert torch.allclose(_all_logprobs(logits, r), torch.log_softmax(expected, -1), atol=1e-6)
    # The penalty changes the greedy choice: token 0 (2.0 -> 1.0) falls below token 2 (1.5).
    assert Sampler()(torch.tensor([[2.0, -2.0, 1.5]]), [row(prompt=(0,), repetition_penalty=2.0,
                                                            temperature=0.0)]).token_ids == [2]


def test_presence_and_frequency_penalties_exact() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    r = row(prompt=(3, 3), output=(0, 0, 2), frequency_penalty=0.5, presence_penalty=0.25,
            temperature=0.0, logprobs=4)
    # token 0: count 2 -> -(0.5*2 + 0.25); token 2: count 1 -> -(0.5 + 0.25); prompt-only token 3 untouched.
    expected = torch.tensor([1.0 - 1.25, 2.0, 3.0 - 0.75, 0.5])
    assert torch.allclose(_all_logprobs(logits, r), torch.log_softmax(expected, -1), atol=1e-6)


def test_negative_presence_penalty_raises_logits() -> None:
    logits = torch.tensor([[1.0, 1.5]])
    out = Sampler()(logits, [row(output=(0,), presence_penalty=-1.0, temperature=0.0)])
    assert out.token_ids == [0]


# --- min_tokens -----------------------------------------------------------------------------------------


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 4.0, 5.0]])  # eos=3 best, stop id 2 second
    kw = {"eos": (3,), "min_tokens": 2, "stop_token_ids": (2,), "temperature": 0.0}
    assert Sampler()(logits, [row(output=(1,), **kw)]).token_ids == [1]
    assert Sampler()(logits, [row(output=(1, 1), **kw)]).token_ids == [3]
    assert Sampler()(logits, [row(output=(1,), ignore_eos=True, **kw)]).token_ids == [3]
    # Random rows too, and the suppressed tokens get logprob -inf.
    out = Sampler(torch.Generator().manual_seed(0))(
        logits.expand(500, -1), [row(eos=(3,), min_tokens=1, stop_token_ids=(2,), logprobs=4)] * 500
    )
    assert set(out.token_ids) == {0, 1}
    assert out.top_logprobs[0] is not None
    assert dict(out.top_logprobs[0])[3] == float("-inf")


# --- logprobs ---------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_penalised_logits_before_temperature() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(8))
    r = row(temperature=0.3, top_k=10, top_p=0.9, output=(5,), frequency_penalty=1.0, logprobs=5)
    out = Sampler(torch.Generator().manual_seed(0))(logits, [r])
    penalised = logits[0].clone()
    penalised[5] -= 1.0
    ref = torch.log_softmax(penalised, -1)
    top = out.top_logprobs[0]
    assert top is not None and out.logprobs is not None
    assert [t for t, _ in top[:5]] == ref.topk(5).indices.tolist()
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert torch.allclose(torch.tensor([v for _, v in top]), ref[[t for t, _ in top]], atol=1e-6)
    assert out.logprobs[0] == pytest.approx(ref[out.token_ids[0]].item(), abs=1e-6)


def test_sampled_token_reported_when_outside_top_n() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(9)).expand(300, -1) * 0.1
    ref = torch.log_softmax(logits[0], -1)
    rows = [row(logprobs=2)] * 150 + [row(logprobs=0)] * 150
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    outside = 0
    for i, tok in enumerate(out.token_ids):
        top = out.top_logprobs[i]
        assert top is not None
        n = 2 if i < 150 else 0
        assert [t for t, _ in top[:n]] == ref.topk(n).indices.tolist()
        assert tok in [t for t, _ in top]
        assert len(top) == (n if tok in ref.topk(n).indices.tolist() else n + 1)
        outside += len(top) > n
        assert dict(top)[tok] == pytest.approx(ref[tok].item(), abs=1e-6)
    assert outside > 100  # flat distribution: the sampled token is usually not in the top 2


def test_no_logprobs_requested_gives_none() -> None:
    out = Sampler()(torch.randn(2, 10), [row(), row(top_p=0.5)])
    assert out.logprobs is None and out.top_logprobs == [None, None]


# --- mixed batch ------------------------------------------------------------------------------------


def test_mixed_batch_in_one_call() -> None:
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(10))
    rows = [
        row(temperature=0.0),
        row(seed=3),
        row(top_p=0.3),
        row(logprobs=3, temperature=0.0),
        row(top_k=2, min_p=0.05, repetition_penalty=1.2, prompt=(1, 2)),
        row(logprobs=0, seed=4, presence_penalty=0.3, output=(9,)),
    ]
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    assert len(out.token_ids) == 6 and all(0 <= t < 500 for t in out.token_ids)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[3] == logits[3].argmax().item()
    assert out.token_ids[4] in logits[4].topk(2).indices.tolist()
    assert out.logprobs is not None and len(out.logprobs) == 6
    assert [t is None for t in out.top_logprobs] == [True, True, True, False, True, False]
    assert out.top_logprobs[3] is not None and len(out.top_logprobs[3]) == 3
    assert out.top_logprobs[5] == [(out.token_ids[5], out.logprobs[5])]
    # The seeded row reproduces its token alone.
    alone = Sampler()(logits[1:2], [row(seed=3)]).token_ids[0]
    assert out.token_ids[1] == alone


# --- logit_bias -------------------------------------------------------------------------------------


def test_logit_bias_bans_and_forces_tokens_per_row() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0]] * 3)  # [3, V]: token 0 is the argmax of every row
    out = Sampler()(logits, [row(temperature=0.0), row(temperature=0.0, logit_bias={0: -100.0}),
                             row(temperature=0.0, logit_bias={3: 100.0, 2: 0.5})])
    assert out.token_ids == [0, 1, 3]


def test_logit_bias_shifts_the_distribution_and_the_reported_logprobs() -> None:
    logits = probs_logits([0.25, 0.25, 0.25, 0.25])
    out = Sampler()(logits, [row(temperature=1.0, seed=3, logprobs=4, logit_bias={1: math.log(3.0)})])
    top = dict(out.top_logprobs[0] or [])
    assert top[1] == pytest.approx(math.log(0.5)) and top[0] == pytest.approx(math.log(1 / 6))


def test_random_rows_take_what_they_need_from_the_host_in_one_copy(monkeypatch) -> None:
    """Temperature, top-k, top-p, min-p, seeded and unseeded rows next to a greedy one: every number the random rows'
    sampling needs reaches the logits' device through one `upload` (on CUDA a copy that does not wait), and nothing
    else makes a tensor on a device from host values."""
    from runtimes.llm import sampler as sampler_module

    uploads: list[int] = []
    real_upload, real_tensor = sampler_module.upload, torch.tensor

    def counting_upload(columns, device):
        uploads.append(len(columns))
        return real_upload(columns, device)

    def tensor_without_device(*args, **kwargs):
        assert kwargs.get("device") is None, "a host-to-device tensor outside the one upload"
        return real_tensor(*args, **kwargs)

    rows = [row(temperature=0.0), row(temperature=0.7, top_k=5), row(temperature=1.2, top_p=0.8, seed=3),
            row(temperature=0.9, min_p=0.1), row(temperature=1.0, top_k=8, top_p=0.9)]
    logits = torch.randn(len(rows), 64, generator=torch.Generator().manual_seed(4))
    expected = Sampler(torch.Generator().manual_seed(9))(logits, rows).token_ids
    monkeypatch.setattr(sampler_module, "upload", counting_upload)
    monkeypatch.setattr(torch, "tensor", tensor_without_device)
    got = Sampler(torch.Generator().manual_seed(9))(logits, rows).token_ids
    assert uploads == [7] and got == expected
    assert got[0] == logits[0].argmax().item()
