"""Each decoder family (runtimes/llm/model_config.FAMILIES) against transformers on the same tiny random checkpoint,
from a Hugging Face directory and from a GGUF file: the logits of a prompt match, and the engine's greedy tokens
are transformers' greedy tokens; a family the runtime does not run is refused by name, listing those it does."""

from __future__ import annotations

import pytest
import torch

from runtimes.llm.attention import paged_attention_ref, select_attention
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.loader import load_model
from runtimes.llm.model_config import FAMILIES, ModelConfig
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import random_prompt, run_to_completion
from tests.runtimes.llm.families import (
    FAMILY_CONFIGS,
    MIXTURES,
    hf_family_model,
    save_family_dir,
    write_family_gguf,
)

NUM_TOKENS = 24


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family(request) -> str:
    return request.param


SOURCES = [(family, source) for family in sorted(FAMILY_CONFIGS) for source in ("hf", "gguf")
           if not (family in MIXTURES and source == "gguf")]


@pytest.mark.parametrize(("family", "source"), SOURCES)
def test_a_family_matches_transformers(family, source, tmp_path):
    ref = hf_family_model(family, seed=1)
    _matches_transformers(ref, family, source, tmp_path)


def _matches_transformers(ref, family, source, tmp_path):
    """The HF route through the PyTorch reference attention, the GGUF route through the CPU kernel (the engine's)."""
    path = save_family_dir(ref, tmp_path / family) if source == "hf" else write_family_gguf(
        ref, tmp_path / f"{family}.gguf")
    attention = paged_attention_ref if source == "hf" else select_attention("cpu", torch.device("cpu"))
    loaded = load_model(path, torch.device("cpu"), torch.float32, attention, progress=False)
    config = loaded.config
    window = getattr(ref.config, "sliding_window", None)
    types = getattr(ref.config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * 2
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    assert config.layer_windows == (windows if any(windows) else ())
    assert config.family == family
    assert (config.qkv_bias, config.qk_norm) == (family in ("qwen2", "llama"), family in ("qwen3", "qwen3_moe"))
    assert (config.num_experts, config.experts_per_token) == ((4, 2) if family in MIXTURES else (0, 0))
    prompts = [random_prompt(seed, 5 + 3 * seed) for seed in range(3)]
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=4 << 20, block_size=4, max_num_batched_tokens=16))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0)
    ours = run_to_completion(engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    ref.generation_config.eos_token_id = None  # as ignore_eos: EOS may be drawn and does not stop
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            mask = torch.ones(1, len(prompt), dtype=torch.long)
            expected = ref.generate(torch.tensor([prompt]), attention_mask=mask, max_new_tokens=NUM_TOKENS,
                                    do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            logits = ref(torch.tensor([prompt + ours[f"p{i}"].token_ids])).logits[0].log_softmax(-1)
        got = ours[f"p{i}"]
        # each token's logprob is transformers' for the same prefix (chunked prefill, paged KV and all)
        theirs = [float(logits[len(prompt) - 1 + j, t]) for j, t in enumerate(got.token_ids)]
        assert got.logprobs is not None
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(theirs, abs=1e-4)
        assert got.token_ids == expected, f"prompt {i} diverged"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_family_it_does_not_run_is_refused_by_name():
    config = hf_family_model("qwen2").config.to_dict()
    for model_type in ("gemma2", "qwen2_moe", "deepseek_v3"):
        with pytest.raises(ValueError) as refused:
            ModelConfig.from_hf_config({**config, "model_type": model_type})
        assert repr(model_type) in str(refused.value) and all(f in str(refused.value) for f in FAMILIES)


def test_qwen2_with_windows_on_its_upper_layers_matches_transformers(tmp_path):
    """Qwen2's `use_sliding_window` from `max_window_layers` up: a full-attention layer below a windowed one."""
    ref = hf_family_model("qwen2", seed=3, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert ref.config.layer_types == ["full_attention", "sliding_attention"]
    _matches_transformers(ref, "qwen2", "hf", tmp_path)


@pytest.mark.parametrize(("family", "extra"), [("llama", {"mlp_bias": True})])
def test_what_a_family_may_add_that_the_runtime_lacks_is_refused(family, extra):
    config = {**hf_family_model(family).config.to_dict(), **extra}
    with pytest.raises(ValueError, match=r"mlp_bias"):
        ModelConfig.from_hf_config(config)


def test_the_planner_reads_a_familys_shape_from_its_files(tmp_path):
    """Qwen3's head_dim (32) is not hidden / heads (16): the KV bytes the planner counts follow the file's own."""
    from partitioner.planning.shapes import estimate_shape

    ref = hf_family_model("qwen3")
    for path in (save_family_dir(ref, tmp_path / "dir"), write_family_gguf(ref, tmp_path / "qwen3.gguf")):
        shape = estimate_shape(str(path))
        assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 32)


def test_the_quantized_route_stays_close_to_fp32(family, tmp_path):
    """Each family's projections in a block format (its biases and q/k norms in fp32 beside them): over a text,
    transformers-free, the quantized model's next-token choices and log-probabilities stay near the fp32 model's
    (the gate of test_quantized.py's float checkpoint: most choices the same, logits within a few percent). Q8 only:
    4-bit blocks of these tiny random matrices are too coarse to gate (q4's gate is on the real SmolLM2)."""
    from runtimes.llm.quant.cpu import QuantLinear
    from tests.runtimes.llm.test_quantized import _logits

    path = save_family_dir(hf_family_model(family, seed=2), tmp_path)
    dense = load_model(path, torch.device("cpu"), torch.float32, progress=False)
    quantized = load_model(path, torch.device("cpu"), torch.float32, progress=False, weights="q8")
    assert isinstance(quantized.model.layers[0].self_attn.qkv_proj, QuantLinear)
    ids = list(range(5, 40))
    reference, logits = _logits(dense, ids), _logits(quantized, ids)
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    drift = ((logits - reference).abs().max() / reference.abs().max()).item()
    assert agreement >= 0.85 and drift < 0.05, (agreement, drift)  # 0.85: SmolLM2's q8 gate


def test_a_mixture_of_experts_gguf_is_refused_by_name():
    from runtimes.llm.model_config import gguf_model_config

    with pytest.raises(ValueError, match="mixture-of-experts GGUF"):
        gguf_model_config({"general.architecture": "llama", "llama.expert_count": 8}, has_output=True)
