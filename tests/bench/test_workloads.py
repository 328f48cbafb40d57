"""Prompt lengths without a tokenizer, built-in workloads and their seeded plans."""

import random

import pytest

from bench.prompts import TokenFit
from bench.workloads import BUILTIN, parse_length, plan_requests, with_lengths
from partitioner.simulate.workload import LengthDist


def test_fit_from_probes_inverts_to_words():
    fit = TokenFit.from_probes([(32, 50), (160, 242)])  # 1.5 tokens/word + 2 tokens of template
    assert fit.tokens_per_word == pytest.approx(1.5)
    assert fit.overhead_tokens == pytest.approx(2.0)
    assert fit.words_for(302) == 200


def test_fit_refuses_probes_that_do_not_grow():
    with pytest.raises(ValueError, match="do not grow"):
        TokenFit.from_probes([(32, 8), (160, 8)])


def test_byte_level_fit_hits_target_lengths():
    """With a byte-level tokenizer a word costs its length + 1 (the space): the fit should land near the target."""
    from bench.prompts import words_text

    rng = random.Random(0)
    probes = [(w, len(words_text(w, rng))) for w in (32, 160)]
    fit = TokenFit.from_probes(probes)
    plans = plan_requests(with_lengths(BUILTIN["chat"], parse_length("fixed:400"), None), 20, fit, rng)
    assert all(abs(len(p.prompt) - 400) < 60 for p in plans)


def test_plans_are_reproducible_from_the_seed():
    fit = TokenFit()
    first = plan_requests(BUILTIN["mixed"], 30, fit, random.Random(5))
    assert plan_requests(BUILTIN["mixed"], 30, fit, random.Random(5)) == first
    assert plan_requests(BUILTIN["mixed"], 30, fit, random.Random(6)) != first


def test_mixed_draws_both_kinds():
    plans = plan_requests(BUILTIN["mixed"], 200, TokenFit(), random.Random(1))
    long_ones = sum(p.num_prompt_tokens_target >= 1500 for p in plans)
    assert 20 <= long_ones <= 60  # 20 % of 200, give or take


def test_shared_prefix_prompts_start_with_one_of_few_documents():
    plans = plan_requests(BUILTIN["shared-prefix"], 40, TokenFit(), random.Random(2), documents_seed=9)
    heads = {p.prompt.split("\n\nQuestion:")[0] for p in plans}
    assert len(heads) == BUILTIN["shared-prefix"].num_documents
    assert len({p.prompt for p in plans}) == 40  # the questions differ
    assert all(p.num_prompt_tokens_target == 1024 + 32 for p in plans)


@pytest.mark.parametrize(("text", "dist"), [
    ("fixed:256", LengthDist("fixed", value=256)),
    ("uniform:20:120", LengthDist("uniform", low=20, high=120)),
    ("lognormal:128:0.6:16:512", LengthDist("lognormal", median=128, sigma=0.6, low=16, high=512)),
    ("lognormal:128:0.6", LengthDist("lognormal", median=128, sigma=0.6, low=1, high=1 << 20))])
def test_parse_length(text, dist):
    assert parse_length(text) == dist


@pytest.mark.parametrize("text", ["fixed", "uniform:1", "poisson:3", "fixed:abc", "fixed:0"])
def test_parse_length_names_the_format(text):
    with pytest.raises(ValueError, match="length"):
        parse_length(text)


def test_bench_draws_the_requests_it_drew_before_the_vocabulary_was_shared():
    def drawn(text: str) -> list[tuple[int, int]]:
        workload = with_lengths(BUILTIN["chat"], parse_length(text), parse_length(text))
        return [(r.num_prompt_tokens_target, r.max_tokens) for r in plan_requests(workload, 6, TokenFit(),
                                                                                 random.Random(3))]

    assert drawn("lognormal:200:0.9") == [(223, 307), (126, 247), (978, 122), (23, 74), (428, 121), (136, 60)]
    assert drawn("lognormal:150:0.4:20:400") == [(157, 181), (330, 201), (400, 155), (150, 137), (210, 279),
                                                 (98, 81)]
