"""The real SmolLM2-135M-Instruct: greedy generation equals transformers' token for token."""

from __future__ import annotations

import pytest
import torch

from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import run_to_completion

pytestmark = pytest.mark.slow

RAW_PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
CHATS = [
    [{"role": "user", "content": "Explain in detail how photosynthesis works."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name two planets."},
        {"role": "assistant", "content": "Mars and Venus."},
        {"role": "user", "content": "Now write a short poem about Jupiter."},
    ],
]
NUM_TOKENS = 40


@pytest.fixture(scope="module")
def prompts(smollm2_loaded) -> list[list[int]]:
    tok = smollm2_loaded.tokenizer
    texts = RAW_PROMPTS + [tok.apply_chat_template(c, add_generation_prompt=True) for c in CHATS]
    return [tok.encode(t) for t in texts]


def test_greedy_equals_transformers(smollm2_loaded, smollm2_reference, prompts):
    ref_model, ref_tok = smollm2_reference
    # Same prompt ids from both tokenizers, chat template included.
    for chat, ids in zip(CHATS, prompts[len(RAW_PROMPTS) :], strict=True):
        ref_ids = ref_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ref_ids = ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") else ref_ids
        assert list(ref_ids) == ids
    engine = LLMEngine(smollm2_loaded, EngineConfig(kv_cache_bytes=64 << 20, max_num_batched_tokens=64))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
    ours = run_to_completion(engine, {f"p{i}": (ids, params) for i, ids in enumerate(prompts)})
    eos = ref_model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    for i, ids in enumerate(prompts):
        got = ours[f"p{i}"].token_ids
        assert len(got) >= 32, "pick prompts with long answers: the check must cover 32+ tokens"
        # transformers' greedy generation is, token by token, its argmax after the prompt and the tokens before:
        # one forward pass over the prompt and our tokens gives all those argmaxes at once (the logits at position
        # j choose token j + 1), where generate() made 40 one-token passes per prompt, most of this test's time.
        # Ours equals what generate() gives iff each of our tokens is transformers' choice after the same prefix
        # and ours stops where generate() would: at its first EOS, else after NUM_TOKENS.
        with torch.no_grad():
            logits = ref_model(torch.tensor([ids + got])).logits[0, len(ids) - 1 : -1]
        expected = logits.argmax(-1).tolist()
        first_diff = next((j for j, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
        assert first_diff is None, f"prompt {i} diverged at token {first_diff}: ours {got}, transformers' {expected}"
        assert not eos & set(got[:-1]) and (len(got) == NUM_TOKENS or got[-1] in eos), f"prompt {i} stopped wrong"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_batch_invariance_real_model(smollm2_loaded, prompts):
    """A request's greedy and seeded outputs are the same alone and among 31 others of mixed lengths."""
    tok = smollm2_loaded.tokenizer
    config = EngineConfig(kv_cache_bytes=96 << 20, max_num_batched_tokens=256, max_num_seqs=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    target = prompts[2]
    alone = run_to_completion(LLMEngine(smollm2_loaded, config), {"g": (target, greedy), "s": (target, seeded)})
    others = {}
    for i in range(30):
        text = f"Story {i}: " + " ".join(["once upon a time"] * (1 + i % 7))
        others[f"o{i}"] = (tok.encode(text), SamplingParams(temperature=0.7, max_tokens=8 + i % 17, ignore_eos=True))
    crowd_requests = {**others, "g": (target, greedy), "s": (target, seeded)}
    crowd = run_to_completion(LLMEngine(smollm2_loaded, config), crowd_requests)
    assert crowd["g"].token_ids == alone["g"].token_ids
    assert crowd["s"].token_ids == alone["s"].token_ids
