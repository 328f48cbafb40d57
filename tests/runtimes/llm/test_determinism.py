"""The default engine (SmolLM2's own Q4_1 / Q8_0 blocks on the int8 kernel, `weights: auto`) gives a greedy or
seeded request the same tokens whatever runs beside it and however its prompt is computed: alone or in a batch,
prefilled whole, in chunks, or decoded token by token (so a request resumed elsewhere from its prompt plus the tokens
it had, which prefills them, continues exactly)."""

from __future__ import annotations

import pytest
import torch

from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import run_to_completion

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
TOPICS = ["photosynthesis", "the French revolution", "black holes", "baking bread", "the stock market", "volcanoes",
          "machine learning", "the Roman empire", "coffee", "quantum computing", "bees", "the moon landing"]
TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_quantized) -> list[list[int]]:
    tok = smollm2_quantized.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Tell me about {topic}."}],
                                               add_generation_prompt=True)) for topic in TOPICS]


def _engine(loaded, **overrides) -> LLMEngine:
    options = {"kv_cache_bytes": 96 << 20, "max_num_batched_tokens": 512, "max_num_seqs": 32, **overrides}
    return LLMEngine(loaded, EngineConfig(**options))


def _assert_no_leak(engine: LLMEngine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.fixture(scope="module")
def alone(smollm2_quantized, prompts) -> dict[str, list[int]]:
    """Each request on its own, in an engine of its own: the reference."""
    out = {}
    for i, ids in enumerate(prompts):
        got = run_to_completion(_engine(smollm2_quantized), {"g": (ids, GREEDY), "s": (ids, SEEDED)})
        out[f"g{i}"], out[f"s{i}"] = got["g"].token_ids, got["s"].token_ids
    return out


def test_alone_and_in_a_batch_give_the_same_tokens(smollm2_quantized, prompts, alone):
    requests = {f"g{i}": (ids, GREEDY) for i, ids in enumerate(prompts)}
    requests |= {f"s{i}": (ids, SEEDED) for i, ids in enumerate(prompts)}
    engine = _engine(smollm2_quantized)
    together = run_to_completion(engine, requests)
    assert {key: got.token_ids for key, got in together.items()} == alone
    _assert_no_leak(engine)


@pytest.mark.parametrize("budget", [7, 64])
def test_chunked_prefill_gives_the_same_tokens(smollm2_quantized, prompts, alone, budget):
    """Prompts computed a few tokens a step, next to other requests' decodes (mixed steps)."""
    requests = {f"g{i}": (ids, GREEDY) for i, ids in enumerate(prompts[:6])}
    engine = _engine(smollm2_quantized, max_num_batched_tokens=budget)
    chunked = run_to_completion(engine, requests)
    assert {key: got.token_ids for key, got in chunked.items()} == {key: alone[key] for key in requests}
    _assert_no_leak(engine)


@pytest.mark.parametrize("cut", [1, 13, 30])
def test_a_resumed_request_continues_exactly(smollm2_quantized, prompts, alone, cut):
    """Prompt + the first `cut` generated tokens, prefilled as one prompt (what migration sends the next replica),
    continues with the tokens decoding went on to give."""
    requests = {f"g{i}": (ids + alone[f"g{i}"][:cut], SamplingParams(temperature=0.0, max_tokens=TOKENS - cut,
                                                                      ignore_eos=True))
                for i, ids in enumerate(prompts)}
    engine = _engine(smollm2_quantized)
    resumed = run_to_completion(engine, requests)
    for key, got in resumed.items():
        assert got.token_ids == alone[key][cut:], key
    _assert_no_leak(engine)


def test_a_prompt_sent_again_and_the_next_turn_reuse_every_computed_token_exactly(smollm2_quantized, prompts, alone):
    """Prefix-cache hits that end inside a block copy that block's KV: the same prompt again computes only its last
    token, a conversation's next turn only its new tokens, and both give the tokens computed afresh."""
    engine = _engine(smollm2_quantized)
    first = run_to_completion(engine, {"g0": (prompts[0], GREEDY)})["g0"]
    assert first.token_ids == alone["g0"]
    again = run_to_completion(engine, {"again": (prompts[0], GREEDY)})["again"]
    assert again.num_cached_tokens == len(prompts[0]) - 1
    assert again.token_ids == alone["g0"]

    tok = smollm2_quantized.tokenizer
    follow_up = tok.encode("<|im_end|>\n<|im_start|>user\nAnd why?<|im_end|>\n<|im_start|>assistant\n")
    turn = prompts[0] + first.token_ids + follow_up
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    second = run_to_completion(engine, {"turn": (turn, params)})["turn"]
    # every token the first turn computed: its prompt and its outputs but the last (sampled, never fed back)
    assert second.num_cached_tokens == len(prompts[0]) + len(first.token_ids) - 1
    fresh = run_to_completion(_engine(smollm2_quantized, enable_prefix_caching=False), {"turn": (turn, params)})["turn"]
    assert fresh.num_cached_tokens == 0
    assert second.token_ids == fresh.token_ids
    _assert_no_leak(engine)
