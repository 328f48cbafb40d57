"""Each decoder family (runtimes/llm/model_config.FAMILIES) against transformers on the same tiny random checkpoint,
from a Hugging Face directory and from a GGUF file: the logits of a prompt match, and the engine's greedy tokens
are transformers' greedy tokens; a family the runtime does not run is refused by name, listing those it does."""

from __future__ import annotations

import pytest
import torch

from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.loader import load_model
from runtimes.llm.model_config import FAMILIES, ModelConfig
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import random_prompt, run_to_completion
from tests.runtimes.llm.families import (
    FAMILY_CONFIGS,
    GGUF_OVERRIDES,
    MIXTURES,
    hf_family_model,
    save_family_dir,
    write_family_gguf,
)

NUM_TOKENS = 24


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family(request) -> str:
    return request.param


SOURCES = [(family, source) for family in sorted(FAMILY_CONFIGS) for source in ("hf", "gguf")]


@pytest.mark.parametrize(("family", "source"), SOURCES)
def test_a_family_matches_transformers(family, source, tmp_path):
    ref = hf_family_model(family, seed=1, **(GGUF_OVERRIDES.get(family, {}) if source == "gguf" else {}))
    path = save_family_dir(ref, tmp_path / family) if source == "hf" else write_family_gguf(
        ref, tmp_path / f"{family}.gguf")
    loaded = load_model(path, torch.device("cpu"), torch.float32, progress=False)
    config = loaded.config
    assert config.family == family
    assert (config.qkv_bias, config.qk_norm) == (family in ("qwen2", "qwen2_moe", "llama"),
                                                 family in ("qwen3", "qwen3_moe"))
    assert (config.num_experts, config.experts_per_token) == ((4, 2) if family in MIXTURES else (0, 0))
    if family in MIXTURES:
        assert config.renormalize_experts == (family == "mixtral" or (family, source) == ("qwen3_moe", "gguf"))
    assert config.shared_expert_intermediate_size == (80 if family == "qwen2_moe" else 0)
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
    for model_type in ("gemma2", "olmoe", "deepseek_v3"):
        with pytest.raises(ValueError) as refused:
            ModelConfig.from_hf_config({**config, "model_type": model_type})
        assert repr(model_type) in str(refused.value) and all(f in str(refused.value) for f in FAMILIES)


@pytest.mark.parametrize(("family", "extra"), [("mistral", {"sliding_window": 64}),
                                               ("qwen2", {"use_sliding_window": True, "sliding_window": 64}),
                                               ("llama", {"mlp_bias": True}),
                                               ("qwen2_moe", {"mlp_only_layers": [1]}),
                                               ("qwen2_moe", {"decoder_sparse_step": 2}),
                                               ("qwen3_moe", {"decoder_sparse_step": 2})])
def test_what_a_family_may_add_that_the_runtime_lacks_is_refused(family, extra):
    config = {**hf_family_model(family).config.to_dict(), **extra}
    with pytest.raises(ValueError, match=r"sliding|mlp_bias|mlp_only_layers.*decoder_sparse_step") as refused:
        ModelConfig.from_hf_config(config)
    assert family in str(refused.value) or "mlp_bias" in str(refused.value)


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


def test_a_mixture_of_experts_gguf_reads_as_its_family(tmp_path):
    """Mixtral's GGUF is the llama architecture with experts; the Qwen mixtures' names there lose the underscore.
    Their sizes come from the converter's keys: a Qwen expert's own width, not the dense feed_forward_length;
    whether the chosen experts are renormalised is llama.cpp's fixed choice for the architecture."""
    from runtimes.llm.model_config import read_gguf

    for family, width in (("mixtral", 128), ("qwen3_moe", 48), ("qwen2_moe", 48)):
        _, config = read_gguf(write_family_gguf(hf_family_model(family), tmp_path / f"{family}.gguf"))
        assert (config.family, config.intermediate_size, config.num_experts) == (family, width, 4)
        assert config.renormalize_experts == (family != "qwen2_moe")  # llama.cpp's choice for the architecture


@pytest.mark.parametrize(("meta", "named"), [
    ({"general.architecture": "llama", "llama.expert_count": 8}, "llama.expert_used_count"),
    ({"general.architecture": "qwen3moe"}, "qwen3moe.expert_count"),
    ({"general.architecture": "qwen2moe", "qwen2moe.expert_count": 8}, "qwen2moe.expert_used_count"),
])
def test_a_mixture_of_experts_gguf_without_its_expert_keys_is_refused_by_name(meta, named):
    from runtimes.llm.model_config import gguf_model_config

    dense = {"block_count": 2, "context_length": 64, "embedding_length": 64, "feed_forward_length": 128,
             "attention.head_count": 4}
    arch = meta["general.architecture"]
    with pytest.raises(ValueError, match=named):
        gguf_model_config({**{f"{arch}.{key}": value for key, value in dense.items()}, **meta,
                           "tokenizer.ggml.tokens": ["a"]}, has_output=True)


@pytest.mark.parametrize("expert_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_mixtures_quantized_experts_are_read_one_expert_at_a_time(expert_type, tmp_path):
    """A GGUF whose stacked experts are stored in a float or block type: each expert's slice is dequantized on its
    own into that expert, so the logits are transformers' on the values the file stores. Qwen2-MoE at a width of 256
    (a K-quant row); the shared expert and router stay F32, as they are 2-D weights the loader reads already."""
    from tests.runtimes.llm.test_model_vs_transformers import TOKENS, _our_logits, _random_k_blocks, _reference_logits

    ref = hf_family_model("qwen2_moe", seed=3, hidden_size=256, moe_intermediate_size=256)
    encode = _random_k_blocks if expert_type.endswith("_K") else None
    path = write_family_gguf(ref, tmp_path / f"qwen2_moe-{expert_type}.gguf", expert_type, encode)
    loaded = load_model(path, torch.device("cpu"), torch.float32, progress=False)
    stored_experts_into(ref, path)
    expected = _reference_logits(ref, TOKENS)
    got = _our_logits(loaded.model, loaded.config, TOKENS, [10, 7])
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)


def stored_experts_into(ref, path) -> None:
    """Set the transformers model's experts to the values the GGUF file stores (dequantized by gguf-py itself)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    stored = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
              for t in gguf.GGUFReader(str(path)).tensors if t.name.endswith("_exps.weight")}
    assert len(stored) == 3 * ref.config.num_hidden_layers
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            experts = layer.mlp.experts
            gate, up, down = (stored[f"blk.{i}.ffn_{part}_exps.weight"] for part in ("gate", "up", "down"))
            experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([gate, up], axis=1)))
            experts.down_proj.copy_(torch.from_numpy(down))


def test_the_planner_counts_a_mixtures_experts(tmp_path):
    """The memory the planner reserves for a mixture's weights counts every expert and the shared expert (the
    parameters a replica holds: all of them, though a token uses 2 of 4), from a directory and from a GGUF file."""
    from partitioner.planning.shapes import GPU_BYTES_PER_PARAMETER, estimate_shape

    ref = hf_family_model("qwen2_moe")
    parameters = sum(p.numel() for p in ref.parameters())
    experts = sum(p.numel() for name, p in ref.named_parameters() if ".experts." in name or "shared_expert" in name)
    assert experts > parameters / 2  # the experts are most of the model: leaving them out could not pass
    for path in (save_family_dir(ref, tmp_path / "dir"), write_family_gguf(ref, tmp_path / "qwen2_moe.gguf")):
        assert estimate_shape(str(path)).weights_bytes == GPU_BYTES_PER_PARAMETER * parameters
