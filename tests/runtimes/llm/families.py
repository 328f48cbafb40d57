"""Tiny random-weight checkpoints of each decoder family the runtime runs (runtimes/llm/model_config.FAMILIES),
built by transformers itself, written as a Hugging Face directory or as a GGUF file the way llama.cpp's converter
writes that family. The byte-level tokenizer of tests/runtimes/llm/tiny.py goes with each.

Each one exercises what its family adds: Qwen2's q/k/v biases (untied embeddings), Qwen3's per-head q/k norms with a
`head_dim` that is not hidden / heads, Mistral's layout with a sliding window shorter than prompt + output; biases
and norms are random, so a wrong mapping cannot hide behind zeros or ones; Phi-3's checkpoint stores q|k|v and
gate|up fused, as llama.cpp's GGUF does (and a window too); the mixtures of experts route each token to 2 of 4
experts, and Qwen2-MoE's shared expert (of its own size) is gated on every token. Their GGUF files stack each layer's
experts in 3-D tensors, as the converter does, in F32 or in `expert_type`. Gemma 3 has local layers around a global
one, each kind with its own RoPE base, a head_dim and an attention scale of their own; its GGUF file's norms are
1 + weight, as the converter writes them. `VARIANTS` are a family with an option of
its own: Phi-3's longrope (random short and long factors, a pre-training context of 64 positions in a context of 256)
and Phi-4-mini's partial rotary embeddings (RoPE on 12 of each head's 16 dims).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.runtimes.llm.tiny import CHATML, EOS_ID, TOKENS, permute_qk, save_hf_dir, tokenizer_metadata

FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": {"tie_word_embeddings": False, "rope_theta": 1e6},
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True, "rope_theta": 1e6},
    # sliding windows shorter than prompt + output (not a multiple of the tests' KV block size)
    "mistral": {"sliding_window": 7, "tie_word_embeddings": False},
    "phi3": {"sliding_window": 10, "tie_word_embeddings": False, "pad_token_id": 0},  # fused qkv and gate|up
    "llama": {"attention_bias": True, "tie_word_embeddings": True},  # Llama's own option: biases on q, k, v and o
    # mixtures of experts: 4 experts, top 2; the Qwen mixtures' probabilities as the router gave them, Mixtral's
    # renormalised
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
                "tie_word_embeddings": False},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 80, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "tie_word_embeddings": False, "rope_theta": 1e6},
    # Gemma 3: 3 layers, local (sliding, a window of 6) around a global one, each kind with its own RoPE base (the
    # global one linearly scaled); head_dim 24, not hidden / heads, and an attention scale of its own
    "gemma3_text": {"num_hidden_layers": 3, "head_dim": 24, "query_pre_attn_scalar": 20, "sliding_window": 6,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}},
                    "tie_word_embeddings": True, "pad_token_id": 0},
    # Gemma 2: Gemma 3's layer without q/k norms or a local RoPE base; its attention scores and final logits capped
    # low enough (2 and 3) that the caps change them
    "gemma2": {"num_hidden_layers": 3, "head_dim": 24, "query_pre_attn_scalar": 20, "sliding_window": 6,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "tie_word_embeddings": True,
               "pad_token_id": 0},
}
# a family's option, by name -> (the family, its config's overrides)
_FACTORS = np.random.default_rng(0)
LONGROPE_ORIGINAL = 64  # phi3_longrope's original_max_position_embeddings: short factors below it, long ones after
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3_longrope": ("phi3", {
        "max_position_embeddings": 4 * LONGROPE_ORIGINAL, "original_max_position_embeddings": LONGROPE_ORIGINAL,
        "rope_scaling": {"rope_type": "longrope",  # 8 frequencies: head_dim 16
                         "short_factor": _FACTORS.uniform(1.0, 2.0, 8).round(4).tolist(),
                         "long_factor": _FACTORS.uniform(2.0, 16.0, 8).round(4).tolist()}}),
    "phi3_partial": ("phi3", {"partial_rotary_factor": 0.75}),  # Phi-4-mini's
}
MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
_PERMUTED = ("llama", "mistral", "mixtral")  # llama.cpp permutes Q/K rows only for these (Mixtral is its Llama)
# the GGUF architecture of a family whose name there differs (Mixtral is llama with experts)
GGUF_ARCHS = {"gemma3_text": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# what a family's model must be for its GGUF file to say it: llama.cpp's converter writes no norm_topk_prob for
# Qwen3-MoE, whose graph always renormalises (as every released Qwen3-MoE does)
GGUF_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"norm_topk_prob": True},
    # nor, for Gemma 3, which layers are local, their RoPE base or the attention scale: llama.cpp fixes them (every
    # 6th layer global, 10000, head_dim's), so the model is 6 layers of that pattern with those
    "gemma3_text": {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 24,
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "gemma2": {"query_pre_attn_scalar": 24},  # head_dim's, as llama.cpp fixes it (every other layer sliding)
}


def family_of(name: str) -> str:
    """The family of a name of FAMILY_CONFIGS or VARIANTS."""
    return VARIANTS[name][0] if name in VARIANTS else name


def hf_family_model(family: str, seed: int = 0, **overrides: Any):
    """A random transformers model of `family` or of one of VARIANTS (fp32, eval mode): 2 layers, 4 heads, 2 KV
    heads."""
    import transformers

    variant = VARIANTS[family][1] if family in VARIANTS else {}
    family = family_of(family)
    config_class = transformers.AutoConfig.for_model(family).__class__
    fields = {"vocab_size": len(TOKENS), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": EOS_ID,
              **FAMILY_CONFIGS[family], **variant, **overrides}
    config = config_class(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + weight
                param.uniform_(-0.5, 0.5) if family in ("gemma2", "gemma3_text") else param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.uniform_(-0.5, 0.5)
    return model


def save_family_dir(model, path: Path) -> Path:
    return save_hf_dir(model, path)


_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv",
          "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused weights, as llama.cpp names them
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}  # a mixture's router, shared expert and its gate


# Gemma 3's sandwich norms, as the converter names them (its `ffn_norm` is the MLP's input norm)
_GEMMA3_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}


def _experts(name: str, tensor: torch.Tensor) -> list[tuple[str, np.ndarray]]:
    """transformers' stacked experts of one layer (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
    [E, H, I]) as the converter's 3-D GGUF tensors: [E, rows, cols] in numpy's order, gate and up apart."""
    layer = name.split(".")[2]
    array = tensor.detach().float().numpy()
    if name.endswith("down_proj"):
        return [(f"blk.{layer}.ffn_down_exps.weight", array)]
    gate, up = np.split(array, 2, axis=1)
    return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]


def write_family_gguf(model, path: Path, expert_type: str = "F32", encode=None) -> Path:
    """`model` as an F32 GGUF file of its family, as llama.cpp's converter writes it (architecture name, metadata
    keys, tensor names; Q/K rows permuted for Llama, Mistral and Mixtral only; Phi-3's RoPE dims, and its longrope
    factors as tensors with the pre-training context and attention factor in the metadata, as `Phi3MiniModel` does);
    a mixture's stacked experts in `expert_type` (`encode(array [rows, cols], qtype) -> blocks` replaces gguf-py's
    quantizer, which lacks K-quants)."""
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    family = cfg.model_type
    writer = gguf.GGUFWriter(str(path), GGUF_ARCHS.get(family, family))
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    if family == "gemma3_text":  # the global layers' RoPE, and its scaling (the local layers' is llama.cpp's own)
        rope = rope["full_attention"]
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "sliding_window", None) and family in ("mistral", "phi3", "gemma2", "gemma3_text"):  # the window
        writer.add_sliding_window(cfg.sliding_window)
    if family == "gemma2":  # as the converter writes them
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_vocab_size(cfg.vocab_size)
    if family == "phi3":
        _write_phi3_rope(writer, cfg, rope)
    if family in MIXTURES:  # the converter's keys: Mixtral's experts are feed_forward_length wide, Qwen's their own
        writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if family in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    meta = tokenizer_metadata()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_ID)
    writer.add_chat_template(CHATML)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    expert_qtype = gguf.GGMLQuantizationType[expert_type]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".mlp.experts." in name:
            for out, stacked in _experts(name, tensor):
                if expert_qtype == gguf.GGMLQuantizationType.F32:
                    writer.add_tensor(out, np.ascontiguousarray(stacked))
                    continue
                blocks = quantize(stacked, expert_qtype) if encode is None else np.stack(
                    [encode(expert, expert_qtype) for expert in stacked])
                writer.add_tensor(out, blocks, raw_dtype=expert_qtype)
            continue
        array = np.ascontiguousarray(tensor.detach().float().numpy())
        if name in names:
            out = names[name]
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight|bias
            module = ".".join(parts[3:-1])
            layer = _GEMMA3_LAYER.get(module) if family in ("gemma2", "gemma3_text") else None
            out = f"blk.{parts[2]}.{layer or _LAYER[module]}.{parts[-1]}"
        if family in ("gemma2", "gemma3_text") and name.endswith("norm.weight"):  # the converter's norm_shift
            array = array + np.float32(1.0)
        if family in _PERMUTED and ".attn_q." in out:
            array = permute_qk(array, cfg.num_attention_heads)
        elif family in _PERMUTED and ".attn_k." in out:
            array = permute_qk(array, cfg.num_key_value_heads)
        writer.add_tensor(out, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_phi3_rope(writer, cfg, rope: dict[str, Any]) -> None:
    """What llama.cpp's converter (`Phi3MiniModel`) writes of Phi-3's RoPE: the rotated dims (hidden * partial factor
    / heads), the pre-training context, and for longrope its attention factor (computed from the contexts' ratio, as
    the converter does) and the short and long factors as the tensors `rope_factors_short` and `rope_factors_long`."""
    import math

    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
    writer.add_rope_dimension_count(rope_dims)
    original = rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(original)  # the converter writes it whatever the RoPE
    if rope.get("rope_type") != "longrope":
        return
    scale = cfg.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
