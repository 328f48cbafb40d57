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
from runtimes.llm.quant.cpu import QuantLinear
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import random_prompt, run_to_completion
from tests.runtimes.llm.families import (
    FAMILY_CONFIGS,
    GGUF_OVERRIDES,
    LONGROPE_ORIGINAL,
    MIXTURES,
    VARIANTS,
    family_of,
    hf_family_model,
    save_family_dir,
    write_family_gguf,
)

NUM_TOKENS = 24


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family(request) -> str:
    return request.param


SOURCES = [(family, source) for family in [*sorted(FAMILY_CONFIGS), *VARIANTS] for source in ("hf", "gguf")]


@pytest.mark.parametrize(("family", "source"), SOURCES)
def test_a_family_matches_transformers(family, source, tmp_path):
    ref = hf_family_model(family, seed=1, **(GGUF_OVERRIDES.get(family, {}) if source == "gguf" else {}))
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
    assert config.family == family_of(family)
    assert (config.qkv_bias, config.qk_norm) == (family in ("qwen2", "qwen2_moe", "llama"),
                                                 family in ("qwen3", "qwen3_moe", "gemma3_text"))
    assert (config.num_experts, config.experts_per_token) == ((4, 2) if family in MIXTURES else (0, 0))
    if family in MIXTURES:
        assert config.renormalize_experts == (family == "mixtral" or (family, source) == ("qwen3_moe", "gguf"))
    assert config.shared_expert_intermediate_size == (80 if family == "qwen2_moe" else 0)
    # the variants' options read from either source: longrope's factors (within original_max_position_embeddings
    # every token below is at a short-factor position), the rotated dims
    assert config.rope_scaling.kind == {"phi3_longrope": "longrope", "gemma3_text": "linear"}.get(family, "none")
    # Gemma 3's local layers: their own RoPE base, the global layers' rope_theta and scaling
    if family == "gemma3_text":
        assert config.local_rope_theta == ref.config.rope_parameters["sliding_attention"]["rope_theta"]
        assert config.local_rope_layers == tuple(t == "sliding_attention" for t in types)
        assert not all(config.local_rope_layers)  # a global layer among the local ones
    else:
        assert (config.local_rope_theta, config.local_rope_layers) == (0.0, ())
    assert config.rotary_dim == (12 if family == "phi3_partial" else config.head_dim)
    # Gemma 2's caps on the attention scores and the final logits, read from either source
    caps = (ref.config.attn_logit_softcapping, ref.config.final_logit_softcapping) if family == "gemma2" else (0, 0)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == caps
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
    for model_type in ("gemma", "olmoe", "deepseek_v3"):
        with pytest.raises(ValueError) as refused:
            ModelConfig.from_hf_config({**config, "model_type": model_type})
        assert repr(model_type) in str(refused.value) and all(f in str(refused.value) for f in FAMILIES)


def test_qwen2_with_windows_on_its_upper_layers_matches_transformers(tmp_path):
    """Qwen2's `use_sliding_window` from `max_window_layers` up: a full-attention layer below a windowed one."""
    ref = hf_family_model("qwen2", seed=3, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert ref.config.layer_types == ["full_attention", "sliding_attention"]
    _matches_transformers(ref, "qwen2", "hf", tmp_path)


@pytest.mark.parametrize(("family", "extra"), [("llama", {"mlp_bias": True}),
                                               ("qwen2_moe", {"mlp_only_layers": [1]}),
                                               ("qwen2_moe", {"decoder_sparse_step": 2}),
                                               ("qwen3_moe", {"decoder_sparse_step": 2})])
def test_what_a_family_may_add_that_the_runtime_lacks_is_refused(family, extra):
    config = {**hf_family_model(family).config.to_dict(), **extra}
    with pytest.raises(ValueError, match=r"mlp_bias|mlp_only_layers.*decoder_sparse_step") as refused:
        ModelConfig.from_hf_config(config)
    assert family in str(refused.value) or "mlp_bias" in str(refused.value)


@pytest.mark.parametrize(("extra", "named"), [({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                                              ({"hidden_activation": "gelu"}, "hidden_activation"),
                                              ({"use_bidirectional_attention": True}, "use_bidirectional_attention")])
def test_what_gemma3_may_have_that_the_runtime_lacks_is_refused_by_name(extra, named):
    """Gemma 2's attention soft-capping would need the attention kernels to cap their scores."""
    config = {**hf_family_model("gemma3_text").config.to_dict(), **extra}
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_config(config)


def test_an_older_gemma3_config_reads_as_transformers_fills_it_in():
    """Before transformers 5: rope_theta, rope_local_base_freq and rope_scaling at the top, and no layer_types but
    sliding_window_pattern (every 6th layer global by default)."""
    config = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "sliding_window": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 32}
    read = ModelConfig.from_hf_config(config)
    assert read.layer_windows == (16, 16, 16, 16, 16, 0, 16)
    assert read.local_rope_layers == (True,) * 5 + (False, True)
    assert (read.rope_theta, read.local_rope_theta, read.rope_scaling.kind, read.rope_scaling.factor) == (
        1e6, 1e4, "linear", 8.0)
    assert ModelConfig.from_hf_config({**config, "sliding_window_pattern": 2}).local_rope_layers == (
        True, False) * 3 + (True,)


def test_the_planner_reads_a_familys_shape_from_its_files(tmp_path):
    """Qwen3's head_dim (32) is not hidden / heads (16): the KV bytes the planner counts follow the file's own."""
    from partitioner.planning.shapes import estimate_shape

    ref = hf_family_model("qwen3")
    for path in (save_family_dir(ref, tmp_path / "dir"), write_family_gguf(ref, tmp_path / "qwen3.gguf")):
        shape = estimate_shape(str(path))
        assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 32)


# a block format needs rows a multiple of 32 wide: the Qwen mixtures' experts (48) and shared expert (80) widened
# for the quantized route, as a released model's are
QUANTIZABLE_WIDTHS = {"qwen3_moe": {"moe_intermediate_size": 64},
                      "qwen2_moe": {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 96}}


def test_the_quantized_route_stays_close_to_fp32(family, tmp_path):
    """Each family's projections in a block format (its biases and q/k norms in fp32 beside them; a mixture's
    experts and shared expert too, its router and shared expert's gate in fp32): over a text, transformers-free, the
    quantized model's next-token choices and log-probabilities stay near the fp32 model's (the gate of
    test_quantized.py's float checkpoint: most choices the same, logits within a few percent). Q8 only: 4-bit blocks
    of these tiny random matrices are too coarse to gate (q4's gate is on the real SmolLM2)."""
    from runtimes.llm.model import Linear

    path = save_family_dir(hf_family_model(family, seed=2, **QUANTIZABLE_WIDTHS.get(family, {})), tmp_path)
    dense = load_model(path, torch.device("cpu"), torch.float32, progress=False)
    quantized = load_model(path, torch.device("cpu"), torch.float32, progress=False, weights="q8")
    assert isinstance(quantized.model.layers[0].self_attn.qkv_proj, QuantLinear)
    for layer in quantized.model.layers:
        kept = dict(layer.projections())
        mlp = {name: proj for name, proj in kept.items() if name not in ("qkv_proj", "o_proj")}
        floats = {name for name, proj in mlp.items() if not isinstance(proj, QuantLinear)}
        assert floats == ({"gate"} | ({"shared_expert_gate"} if "shared_expert_gate" in kept else set())
                          if family in MIXTURES else set())
        assert all(type(mlp[name]) is Linear and mlp[name].weight.dtype == torch.float32 for name in floats)
        assert len(mlp) - len(floats) == (2 * 4 + 2 * (family == "qwen2_moe") if family in MIXTURES else 2)
    ids = list(range(5, 40))
    (reference, routes), (logits, quantized_routes) = _logits_and_routes(dense, ids), _logits_and_routes(quantized, ids)
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    # a random router's probabilities are near uniform, so the blocks' small error may flip a token's top-k in some
    # layer: the jump that follows is a discrete choice, not the blocks' error, so the drift is gated where every
    # layer routed each token alike, and flips must be few (measured at seeds 0 and 2: 0-3 of 35 positions flip,
    # each then the worst, up to 10%, as with the experts left in fp32; elsewhere the drift is under 3%)
    same_route = (routes == quantized_routes).all(-1).all(0)  # [T]
    assert same_route.sum() >= len(ids) - 3, same_route
    drift = ((logits - reference)[same_route].abs().max() / reference.abs().max()).item()
    assert agreement >= 0.85 and drift < 0.05, (agreement, drift)  # 0.85: SmolLM2's q8 gate


def test_a_block_format_refuses_an_expert_narrower_than_its_blocks_by_name(tmp_path):
    path = save_family_dir(hf_family_model("qwen3_moe"), tmp_path)  # experts 48 wide: not a multiple of 32
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.0\.down_proj\.weight: a block format needs rows "
                                         r"a multiple of 32 wide, this one is 48"):
        load_model(path, torch.device("cpu"), torch.float32, progress=False, weights="q8")


def _logits_and_routes(loaded, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probabilities at each position, and each layer's router's top-k experts per token, sorted ([layers,
    T, k]; [0, T, 0] for a dense model)."""
    from runtimes.llm.model import MixtureOfExperts
    from tests.runtimes.llm.test_quantized import _logits

    routes: list[torch.Tensor] = []
    k = loaded.config.experts_per_token
    hooks = [layer.mlp.gate.register_forward_hook(lambda _, __, out: routes.append(out.topk(k, -1).indices.sort(-1)[0]))
             for layer in loaded.model.layers if isinstance(layer.mlp, MixtureOfExperts)]
    try:
        logits = _logits(loaded, ids)
    finally:
        for hook in hooks:
            hook.remove()
    return logits, torch.stack(routes) if routes else torch.zeros(0, len(ids), 0, dtype=torch.long)


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


@pytest.mark.parametrize(("expert_type", "kept"), [("Q8_0", "Q8_0"), ("Q4_0", "Q4_0"), ("Q4_1", "Q4_1"),
                                                     ("Q4_K", "Q8_0"), ("F16", None)])
def test_a_mixtures_block_experts_stay_in_blocks(expert_type, kept, tmp_path, monkeypatch):
    """`auto` keeps a GGUF's Q8_0 / Q4_0 / Q4_1 experts in the file's own blocks, expert by expert, as it keeps a 2-D
    weight's (the CPU kernel's panels of exactly those blocks: the experts hold the file's bytes, not fp32's four per
    value), requantizes K-quant experts to Q8_0 and leaves F16 ones in floating point; the router and shared expert,
    F32 in the file, stay in floating point. Without the kernel (each call dequantizes the rows) the logits are
    transformers' on the file's values; on the kernel, which quantizes activations to int8 per block, within the 5%
    of test_quantized.py's K-quant gate (measured: 1.6% Q8_0, 1.5% Q4_0, 1.8% Q4_1 of the largest logit)."""
    import gguf
    import numpy as np

    from runtimes.llm.model import Linear
    from runtimes.llm.quant import cpu
    from runtimes.llm.quant.formats import FORMATS, pack
    from tests.runtimes.llm.test_model_vs_transformers import TOKENS, _our_logits, _random_k_blocks, _reference_logits

    ref = hf_family_model("qwen2_moe", seed=3, hidden_size=256, moe_intermediate_size=256)  # K-quant rows: 256
    encode = _random_k_blocks if expert_type.endswith("_K") else None
    path = write_family_gguf(ref, tmp_path / f"qwen2_moe-{expert_type}.gguf", expert_type, encode)
    loaded = load_model(path, torch.device("cpu"), torch.float32, progress=False, weights="auto")
    stored_experts_into(ref, path)
    expected = _reference_logits(ref, TOKENS)
    got = _our_logits(loaded.model, loaded.config, TOKENS, [10, 7])
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()

    stacks = {t.name: t for t in gguf.GGUFReader(str(path)).tensors if t.name.endswith("_exps.weight")}
    for i, layer in enumerate(loaded.model.layers):
        mlp = layer.mlp
        assert type(mlp.gate) is Linear and type(mlp.shared_expert_gate) is Linear
        assert type(mlp.shared_expert.gate_up_proj) is Linear and type(mlp.shared_expert.down_proj) is Linear
        experts = [(e, name, proj) for e, expert in enumerate(mlp.experts)
                   for name, proj in (("gate_up", expert.gate_up_proj), ("down", expert.down_proj))]
        if kept is None:
            assert all(type(proj) is Linear for _, _, proj in experts)
            continue
        fmt = next(f for f in FORMATS.values() if f.name == kept)
        assert all(isinstance(proj, QuantLinear) and proj.fmt is fmt and proj.panels for _, _, proj in experts)
        held = sum(proj.qweight.numel() * proj.qweight.element_size() for _, _, proj in experts)
        as_fp32 = sum(4 * proj.in_features * proj.out_features for _, _, proj in experts)
        file_bytes = sum(int(stacks[f"blk.{i}.ffn_{part}_exps.weight"].n_bytes) for part in ("gate", "up", "down"))
        assert held == (file_bytes if kept == expert_type else as_fp32 * fmt.gguf_block_bytes // 128)
        assert held < 0.3 * as_fp32
        if kept != expert_type:
            continue
        for e, name, proj in experts:  # the file's blocks of this expert, in the kernel's panels
            parts = ("gate", "up") if name == "gate_up" else ("down",)
            rows = np.concatenate([pack(stacks[f"blk.{i}.ffn_{part}_exps.weight"].data[e], fmt) for part in parts])
            assert torch.equal(proj.qweight, cpu.to_panels(torch.from_numpy(rows), fmt, proj.in_features))
    if kept != expert_type:
        return
    monkeypatch.setattr(cpu, "kernel_available", lambda: False)  # the blocks as rows, dequantized for each call
    rows = load_model(path, torch.device("cpu"), torch.float32, progress=False, weights="auto")
    assert not rows.model.layers[0].mlp.experts[0].down_proj.panels
    got = _our_logits(rows.model, rows.config, TOKENS, [10, 7])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


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


def _longrope_engine(ref, tmp_path) -> LLMEngine:
    loaded = load_model(save_family_dir(ref, tmp_path), torch.device("cpu"), torch.float32, progress=False)
    return LLMEngine(loaded, EngineConfig(kv_cache_bytes=4 << 20, block_size=4, max_num_batched_tokens=16))


class _PerPositionLongrope(torch.nn.Module):
    """transformers' own longrope (its Phi3RotaryEmbedding) under the runtime's rule: each position's cos and sin
    from the short factors below original_max_position_embeddings, from the long ones after, whatever the length of
    the sequence (transformers alone takes the long ones for every position of a sequence longer than that)."""

    def __init__(self, stock: torch.nn.Module) -> None:
        super().__init__()
        self.stock = stock

    def forward(self, x, position_ids):
        short = self.stock(x, position_ids.clamp(max=LONGROPE_ORIGINAL - 1))  # a sequence within: short factors
        long = self.stock(x, position_ids)
        below = (position_ids < LONGROPE_ORIGINAL)[..., None]
        return torch.where(below, short[0], long[0]), torch.where(below, short[1], long[1])


def test_longrope_tables_are_transformers_short_factors_then_long_ones(tmp_path):
    """The cos and sin of a position below original_max_position_embeddings are transformers' for a sequence within
    it (short factors); from there on, transformers' for a longer sequence (long factors); both scaled by the
    attention factor (sqrt(1 + ln 4 / ln 64): the context is 4 times the original); read alike from the directory
    and from the GGUF file (its factors as tensors, its attention factor in the metadata)."""
    from runtimes.llm.model import RotaryEmbedding
    from runtimes.llm.model_config import read_gguf

    ref = hf_family_model("phi3_longrope")
    configs = [ModelConfig.from_hf_config(ref.config.to_dict()),
               read_gguf(write_family_gguf(ref, tmp_path / "phi3.gguf"))[1]]
    stock, x, positions = ref.model.rotary_emb, torch.zeros(1), torch.arange(4 * LONGROPE_ORIGINAL)[None]
    with torch.no_grad():
        short = [t[0, :LONGROPE_ORIGINAL, :8] for t in stock(x, positions[:, :LONGROPE_ORIGINAL])]
        long = [t[0, :, :8] for t in stock(x, positions)]
    for config in configs:
        scaling = config.rope_scaling
        assert (scaling.kind, scaling.original_max_position_embeddings) == ("longrope", LONGROPE_ORIGINAL)
        assert scaling.attention_factor == pytest.approx((1 + 1 / 3) ** 0.5)
        rope = RotaryEmbedding(config.rotary_dim, config.max_position_embeddings, config.rope_theta, scaling)
        for ours, below, above in zip((rope.cos, rope.sin), short, long, strict=True):
            assert ours.shape == (4 * LONGROPE_ORIGINAL, 8)
            assert torch.equal(ours[:LONGROPE_ORIGINAL], below)
            assert torch.equal(ours[LONGROPE_ORIGINAL:], above[LONGROPE_ORIGINAL:])
            assert not torch.allclose(ours[1:LONGROPE_ORIGINAL], above[1:LONGROPE_ORIGINAL], atol=1e-3)
        assert float(rope.cos[0, 0]) == pytest.approx(scaling.attention_factor)


def test_longrope_past_its_original_context_follows_the_per_position_rule(tmp_path):
    """A request that runs past original_max_position_embeddings (64): its logprobs and greedy tokens are those of
    transformers' model under the runtime's rule (`_PerPositionLongrope`: the keys cached below the boundary keep
    their short-factor rotation), and measurably not those of transformers itself (the long factors for every
    position once the sequence is longer), the documented deviation. The rule depends on the position alone: a
    request that stays within 64 positions gets the same tokens and logprobs alone or beside one that runs past, and
    so does the long one."""
    ref = hf_family_model("phi3_longrope", seed=3)
    ref.generation_config.eos_token_id = None
    long_prompt, short_prompt = random_prompt(0, 50), random_prompt(1, 10)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    long_alone = run_to_completion(_longrope_engine(ref, tmp_path / "a"), {"long": (long_prompt, params)})["long"]
    short_alone = run_to_completion(_longrope_engine(ref, tmp_path / "b"), {"short": (short_prompt, params)})["short"]
    both = run_to_completion(_longrope_engine(ref, tmp_path / "c"), {"long": (long_prompt, params),
                                                                     "short": (short_prompt, params)})
    for alone, name in ((long_alone, "long"), (short_alone, "short")):  # (dense fp32 matmuls: within rounding)
        assert both[name].token_ids == alone.token_ids
        assert [lp.logprob for lp in both[name].logprobs] == pytest.approx([lp.logprob for lp in alone.logprobs],
                                                                           abs=1e-5)
    assert len(long_prompt) + len(long_alone.token_ids) > LONGROPE_ORIGINAL + 20  # well past the boundary

    ids = torch.tensor([long_prompt + long_alone.token_ids])
    with torch.no_grad():
        stock = ref(ids).logits[0].log_softmax(-1)
        ref.model.rotary_emb = _PerPositionLongrope(ref.model.rotary_emb)
        rule = ref(ids).logits[0].log_softmax(-1)
    steps = range(len(long_prompt) - 1, ids.shape[1] - 1)  # the logits each output token was drawn from
    ours = [lp.logprob for lp in long_alone.logprobs]
    assert ours == pytest.approx([float(rule[i, ids[0, i + 1]]) for i in steps], abs=1e-4)
    assert long_alone.token_ids == [int(rule[i].argmax()) for i in steps]
    theirs = [float(stock[i, ids[0, i + 1]]) for i in steps]
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) > 1e-2


def test_a_released_phi3_longrope_config_reads_as_transformers_reads_it():
    """Phi-3-mini-128k's and Phi-4-mini's config.json shapes (transformers 4's `rope_scaling` with `type: su` or
    `longrope`, the pre-training context at the top level): longrope over the rotated dims, the attention factor
    from the contexts' ratio (32) unless the config gives its own."""
    base = {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
            "sliding_window": 262144}
    mini = ModelConfig.from_hf_config({**base, "rope_scaling": {
        "type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}})
    assert (mini.rope_scaling.kind, mini.rope_scaling.original_max_position_embeddings) == ("longrope", 4096)
    assert (mini.rope_scaling.short_factor, mini.rope_scaling.long_factor) == ((1.0,) * 48, (2.0,) * 48)
    assert mini.rope_scaling.attention_factor == pytest.approx(1.1902380714238083)
    assert mini.rotary_dim == mini.head_dim == 96
    phi4 = ModelConfig.from_hf_config({**base, "num_attention_heads": 24, "num_key_value_heads": 8,
                                       "partial_rotary_factor": 0.75, "rope_scaling": {
                                           "type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48,
                                           "attention_factor": 1.5}})
    assert (phi4.head_dim, phi4.rotary_dim, phi4.rope_scaling.attention_factor) == (128, 96, 1.5)


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"'yarn'.*longrope, su"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, r"'dynamic'.*default, linear, llama3, longrope"),
    ({"partial_rotary_factor": 0.5625}, r"partial_rotary_factor=0.5625.*even.*rotates 9"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}}, r"needs long_factor"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 7},
      "original_max_position_embeddings": 64}, r"short_factor has 7 values.*8 frequencies"),
])
def test_rope_the_runtime_lacks_is_refused_by_name(change, message):
    config = {**hf_family_model("llama").config.to_dict(), **change}
    config.pop("rope_parameters", None)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(config)


def test_a_gguf_with_half_of_longropes_factors_is_refused():
    from runtimes.llm.model_config import gguf_model_config

    meta = {"general.architecture": "phi3", "phi3.context_length": 256, "phi3.embedding_length": 64,
            "phi3.feed_forward_length": 128, "phi3.block_count": 2, "phi3.attention.head_count": 4,
            "phi3.rope.scaling.original_context_length": 64, "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ValueError, match=r"rope_factors_short\.weight and rope_factors_long\.weight"):
        gguf_model_config(meta, has_output=True, rope_factors={"rope_factors_long.weight": [1.0] * 8})
    config = gguf_model_config(meta, has_output=True, rope_factors={
        "rope_factors_long.weight": [2.0] * 8, "rope_factors_short.weight": [1.0] * 8})
    assert config.rope_scaling.kind == "longrope" and config.rope_scaling.attention_factor == pytest.approx(
        (1 + 1 / 3) ** 0.5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_variant_decodes_in_the_one_call_cpu_stack(variant, tmp_path, monkeypatch):
    """With the C++ attention kernel a decode step runs the whole layer stack in one C++ call (`decode_layers`),
    which rotates each head's first rotary_dim dims from the same tables: the greedy tokens are still transformers'."""
    from runtimes.llm.attention import select_attention
    from runtimes.llm.model import LlamaForCausalLM

    native: list[bool] = []
    decode = LlamaForCausalLM._decode_natively

    def spy(self, *args):
        out = decode(self, *args)
        native.append(out is not None)
        return out

    monkeypatch.setattr(LlamaForCausalLM, "_decode_natively", spy)
    ref = hf_family_model(variant, seed=4)
    cpu = torch.device("cpu")
    loaded = load_model(save_family_dir(ref, tmp_path), cpu, torch.float32, select_attention("cpu", cpu),
                        progress=False)
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=4 << 20, block_size=4, max_num_batched_tokens=16))
    prompt = random_prompt(5, 9)
    ours = run_to_completion(engine, {"p": (prompt, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                                                   ignore_eos=True))})["p"]
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours.token_ids == expected
    assert sum(native) >= NUM_TOKENS - 2  # every decode step but the prefill's


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_engine_feature_keeps_a_family_exact(family, tmp_path):
    """The engine's paths over each family, on the C++ attention kernel: a 30-token prompt prefilled in chunks of 8
    (past every test window), beside a shorter request; the same prompt again served from the prefix cache; the
    request resumed elsewhere from 9 of its tokens (a migration); decode steps replayed from captured graphs (the
    stand-in: a mixture whose experts loop runs eagerly). Every run gives transformers' greedy tokens, and no block
    leaks."""
    from tests.runtimes.llm.engine_utils import ReplayingGraph

    ref = hf_family_model(family, seed=6)
    ref.generation_config.eos_token_id = None
    cpu = torch.device("cpu")
    loaded = load_model(save_family_dir(ref, tmp_path), cpu, torch.float32, select_attention("cpu", cpu),
                        progress=False)
    prompt, other = random_prompt(11, 30), random_prompt(12, 9)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    config = EngineConfig(kv_cache_bytes=4 << 20, block_size=4, max_num_batched_tokens=8)
    engine = LLMEngine(loaded, config, new_graph=ReplayingGraph)
    first = run_to_completion(engine, {"p": (prompt, params), "o": (other, params)})["p"]
    again = run_to_completion(engine, {"again": (prompt, params)})["again"]
    assert again.num_cached_tokens >= 24  # whole blocks of the prompt from the cache
    engine.add_request("resumed", prompt, params, resume_token_ids=first.token_ids[:9])
    resumed = run_to_completion(engine, {})["resumed"]
    assert first.token_ids == again.token_ids == expected
    assert first.token_ids[:9] + resumed.token_ids == expected
    if engine.runner.graphs is not None:
        assert engine.runner.graphs.replays > 0
    else:
        assert family in MIXTURES
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
