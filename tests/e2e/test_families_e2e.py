"""Each decoder family served by `multiserve serve` from a `{path}` source with `weights: fp32`, one worker each:
greedy completions through the official client are transformers' on the same checkpoint (a directory for Qwen2,
Mistral, Qwen3-MoE, Qwen2-MoE and Gemma 3, a GGUF file for Qwen3, Phi-3, Mixtral and Gemma 2). Mistral's and Phi-3's
sliding windows, and Gemma's local layers, are shorter than prompt + output."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

from model_pool.launcher import free_port
from runtimes.llm.tokenizer import Tokenizer
from tests.e2e.conftest import Gateway, running_gateway
from tests.runtimes.llm.engine_utils import random_prompt
from tests.runtimes.llm.families import GGUF_OVERRIDES, hf_family_model, save_family_dir, write_family_gguf
from tests.runtimes.llm.tiny import tokenizer_metadata

SOURCES = {"qwen2": "dir", "qwen3": "gguf", "mistral": "dir", "phi3": "gguf", "qwen3_moe": "dir", "qwen2_moe": "dir",
           "mixtral": "gguf", "gemma3_text": "dir", "gemma2": "gguf"}
MODEL = """\
  - name: {name}
    type: completion
    source: {{path: {path}}}
    device: cpu
    engine: {{weights: fp32, block_size: 16, kv_cache_gib: 0.01, max_model_len: 256, max_num_seqs: 4}}
"""
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, dict]]:
    root = tmp_path_factory.mktemp("families")
    refs, models = {}, []
    for family, kind in SOURCES.items():
        # a GGUF file says less than a config: a model it can describe (GGUF_OVERRIDES)
        overrides = GGUF_OVERRIDES.get(family, {}) if kind == "gguf" else {}
        ref = refs[family] = hf_family_model(family, seed=5, **overrides)
        path = save_family_dir(ref, root / family) if kind == "dir" else write_family_gguf(ref, root / f"{family}.gguf")
        models.append(MODEL.format(name=family, path=path))
    port = free_port()
    registry = f"gateway: {{host: 127.0.0.1, port: {port}}}\nmodels:\n" + "".join(models)
    with running_gateway(root, registry, port, root) as gateway:
        yield gateway, refs


@pytest.mark.parametrize("family", list(SOURCES))
def test_greedy_completions_are_transformers(served, family):
    gateway, refs = served
    ref = refs[family]
    ref.generation_config.eos_token_id = None
    tokenizer = Tokenizer.from_gguf_metadata(tokenizer_metadata())
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for seed in range(2):
            prompt = random_prompt(seed, 6 + seed)
            reply = client.completions.create(model=family, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True})
            with torch.no_grad():
                expected = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=int),
                                        max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0)[0, len(prompt):]
            assert reply.choices[0].text == tokenizer.decode(expected.tolist()), (family, seed)
            assert reply.usage.completion_tokens == NUM_TOKENS
