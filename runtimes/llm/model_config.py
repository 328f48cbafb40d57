"""A decoder's shape (`ModelConfig`), read from a Hugging Face `config.json` or a GGUF file's metadata, for the families
the one decoder skeleton (runtimes/llm/model.py) runs: Llama, Mistral (sliding-window attention), Phi-3 (its
checkpoint's fused qkv and gate|up are the skeleton's own; the 128k models' and Phi-3.5's longrope scaling, and
Phi-4-mini's partial rotary embeddings), Qwen2 / Qwen2.5 (biases on q, k and v; sliding windows on upper layers where
configured), Qwen3 (a per-head RMSNorm on q and k), Gemma 3's text model (`gemma3_text`: scaled embeddings, norms
around each layer's attention and MLP and scaling by 1 + weight, a GeGLU MLP, Qwen3's q/k norms, its own attention
scale, local sliding-window layers with a RoPE base of their own between global ones), Gemma 2 (Gemma 3's layer
without q/k norms or a local RoPE base, and its attention scores and final logits soft-capped), and the mixtures of
experts Mixtral, Qwen3-MoE and Qwen2-MoE (Qwen2's biases, and a shared expert beside the routed ones), from Hugging
Face directories and from GGUF files (where Mixtral is the `llama` architecture with experts, and the Qwen mixtures
are `qwen3moe` / `qwen2moe`).
Imports no torch: the planner reads a local model's shape with it in the gateway process, which holds no engine.

RoPE scaling: default, linear, llama3 (Llama 3.1's piecewise), and longrope (also named su: Phi-3's per-frequency
rescaling, with `short_factor` and `long_factor`, and cos and sin multiplied by an attention factor). transformers
picks longrope's short or long factors for a whole sequence by its current length (long once it exceeds
`original_max_position_embeddings`), which would re-rotate every cached key when a sequence crosses that length;
here the choice is per position (`RopeScaling`), identical to transformers whenever a sequence stays
within `original_max_position_embeddings`."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtimes.llm.gguf_file import GGUFFile

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `none`, `linear`, `llama3` (Llama 3.1's piecewise scaling) or `longrope` (Phi-3's).

    Longrope divides each inverse frequency by its own factor, `short_factor`'s at positions below
    `original_max_position_embeddings` and `long_factor`'s from there on, and multiplies cos and sin by
    `attention_factor`. transformers (`dynamic_rope_update`) instead picks one set for the whole sequence from its
    current length: short while it is at most `original_max_position_embeddings` tokens long, long for every
    position once it is longer. Our paged KV cache keeps keys as they were rotated, and a request's tokens must not
    depend on what else is in its batch (vLLM picks long for a whole batch once any of its positions is past the
    boundary), so the choice here is a function of the position alone: the same as transformers for a sequence that
    stays within `original_max_position_embeddings` (prompt and output), and past it, the keys below the boundary
    keep their short-factor rotation while the positions from the boundary on are rotated with the long factors
    (transformers would rotate all of them with the long ones)."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope: one divisor per rotated frequency (rotary_dim / 2 of them) each, and the scale of cos and sin
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


# Hugging Face `model_type` -> the family; GGUF `general.architecture` names the same families (`_GGUF_ARCHS`: where
# its name differs)
FAMILIES = ("gemma2", "gemma3_text", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe")  # the families whose MLP is a mixture of experts
# the MLP's gate activation: SiLU (SwiGLU), or GELU with its tanh approximation (Gemma's GeGLU)
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# GGUF `general.architecture` names that are not the family's Hugging Face name (llama.cpp drops the underscore)
_GGUF_ARCHS = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# whether llama.cpp renormalises the chosen experts' probabilities, by family, where a GGUF file does not say
# (`{arch}.expert_weights_norm`): its converter writes no such key for these, and its graphs fix the choice
_GGUF_RENORMALIZE = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True}


def unsupported_family(name: object, where: str) -> ValueError:
    return ValueError(f"unsupported {where} {name!r} (supported: {', '.join(FAMILIES)})")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of one of FAMILIES: the Llama layout, and what a family adds to it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"
    qkv_bias: bool = False  # q, k and v projections have biases (Qwen2; Llama's and Qwen3's `attention_bias`)
    o_bias: bool = False  # the output projection has a bias (Llama's and Qwen3's `attention_bias`)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3)
    # mixture of experts (MIXTURES): each layer's MLP is `num_experts` MLPs of `intermediate_size`, each
    # token taking the `experts_per_token` its router scores highest, weighted by their softmax probabilities
    # (renormalised over those chosen with `renormalize_experts`)
    num_experts: int = 0
    experts_per_token: int = 0
    renormalize_experts: bool = True
    # sliding-window attention (Mistral, Phi-3, Qwen2's upper layers): layer i's queries see the last
    # layer_windows[i] tokens (their own included); 0, or no entries, is the whole context
    layer_windows: tuple[int, ...] = ()
    # RoPE rotates the first `rotary_dim` dims of each head (neox-style within them) and passes the rest through
    # (Phi-4-mini's partial_rotary_factor 0.75); 0 means all of head_dim
    rotary_dim: int = 0
    # Qwen2-MoE's shared expert: an MLP of this size that every token takes besides its routed experts, its output
    # scaled by sigmoid(a hidden -> 1 projection of the token); 0 where the family has none
    shared_expert_intermediate_size: int = 0
    # Gemma 3: embeddings scaled by sqrt(hidden_size); the norms' sandwich (each layer's attention and MLP outputs
    # normed before they join the residual stream, beside the norms of their inputs); a GeGLU MLP (`mlp_activation`
    # gelu_tanh, else SiLU's SwiGLU); attention scaled by query_pre_attn_scalar ** -0.5 (0: head_dim's); the
    # layers `local_rope_layers` marks (its sliding ones) rotated with `local_rope_theta` and no scaling, the others
    # with rope_theta and rope_scaling; logits soft-capped to (-c, c) as tanh(x / c) * c (0: not capped); Gemma 2:
    # the attention scores capped so too (`attn_logit_softcapping`), by every attention backend
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    mlp_activation: str = "silu"
    query_pre_attn_scalar: float = 0.0
    local_rope_theta: float = 0.0
    local_rope_layers: tuple[bool, ...] = ()
    final_logit_softcapping: float = 0.0
    attn_logit_softcapping: float = 0.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if self.local_rope_layers and len(self.local_rope_layers) != self.num_layers:
            raise ValueError(f"{len(self.local_rope_layers)} local_rope_layers for {self.num_layers} layers")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation={self.mlp_activation!r} (supported: {', '.join(MLP_ACTIVATIONS)})")
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and within head_dim={self.head_dim}")
        scaling = self.rope_scaling
        if scaling.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != self.rotary_dim // 2:
                    raise ValueError(f"longrope {name} has {len(getattr(scaling, name))} values, the model rotates "
                                     f"{self.rotary_dim // 2} frequencies (rotary_dim / 2)")

    @property
    def attention_scale(self) -> float:
        """What each query-key product is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` is rotated with the local RoPE (`local_rope_theta`) rather than the global one."""
        return bool(self.local_rope_layers) and self.local_rope_layers[layer]

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window in tokens, 0 for the whole context."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def sliding_window(self) -> int:
        """The window every layer keeps to, 0 where some layer sees the whole context: how many tokens back a
        sequence's KV cache must reach (blocks before that may be freed)."""
        return min(self.layer_windows) if self.layer_windows and all(self.layer_windows) else 0

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face `config.json` of a model of one of FAMILIES."""
        family = cfg.get("model_type", "llama")
        if family not in FAMILIES:
            raise unsupported_family(family, "model_type")
        if cfg.get("mlp_bias"):
            raise ValueError("MLP biases (mlp_bias: true) are not supported")
        attention_bias = bool(cfg.get("attention_bias", False))
        num_heads = int(cfg["num_attention_heads"])
        # the Qwen mixtures' released configs say num_experts; transformers >= 5 writes num_local_experts for all
        num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0) if family in MIXTURES else 0
        qwen_moe = family in ("qwen2_moe", "qwen3_moe")
        if qwen_moe and (cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1):
            raise ValueError(f"{family} with dense layers among the sparse ones (mlp_only_layers="
                             f"{cfg.get('mlp_only_layers')}, decoder_sparse_step={cfg.get('decoder_sparse_step')}; "
                             "supported: none, 1) is not supported yet")
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        gemma = _gemma_options(cfg, family, int(cfg["num_hidden_layers"])) if family in GEMMAS else {}
        rs = cfg.get("rope_scaling") or {}
        # transformers >= 5 folds rope_theta into rope_parameters (Gemma 3's: one set per layer type, the global
        # layers' read here as every other family's)
        rp = cfg.get("rope_parameters") or {}
        if family == "gemma3_text":
            rp = rp.get("full_attention") or {}
        kind = rs.get("rope_type", rs.get("type", rp.get("rope_type", "default")))
        src = rs or rp
        # as transformers reads it: the fraction of each head RoPE rotates, the first int(head_dim * factor) dims
        rotary = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if not 0.0 < rotary <= 1.0 or int(head_dim * rotary) % 2:
            raise ValueError(f"partial_rotary_factor={rotary} must be in (0, 1] and rotate an even number of each "
                             f"head's {head_dim} dims (it rotates {int(head_dim * rotary)})")
        if kind in ("longrope", "su"):
            scaling = _longrope(cfg, src, max_positions)
        else:
            scaling = RopeScaling(
                kind={"default": "none"}.get(kind, kind),
                factor=float(src.get("factor", 1.0)),
                low_freq_factor=float(src.get("low_freq_factor", 1.0)),
                high_freq_factor=float(src.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(src.get("original_max_position_embeddings", 8192)),
            )
        if scaling.kind not in ("none", "linear", "llama3", "longrope"):
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, "
                             "longrope, su)")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["moe_intermediate_size" if qwen_moe else "intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rp.get("rope_theta", _DEFAULT_THETA.get(family, 10000.0)))),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=family,
            qkv_bias=family in ("qwen2", "qwen2_moe") or attention_bias,
            o_bias=family not in ("qwen2", "qwen2_moe") and attention_bias,
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            num_experts=num_experts,
            experts_per_token=int(cfg.get("num_experts_per_tok", 0) or 0) if num_experts else 0,
            renormalize_experts=family == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
            layer_windows=_hf_layer_windows(cfg, family, int(cfg["num_hidden_layers"]), max_positions),
            rotary_dim=int(head_dim * rotary),
            shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]) if family == "qwen2_moe" else 0,
            **gemma,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))


# a family's global RoPE base where its config gives none (transformers' default for it)
_DEFAULT_THETA = {"gemma3_text": 1_000_000.0}


GEMMAS = ("gemma2", "gemma3_text")  # the families of Gemma's layer (sandwich norms, GeGLU, scaled embeddings)


def _gemma_options(cfg: Mapping[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """What Gemma adds to the skeleton (`ModelConfig`'s Gemma fields), as transformers' `Gemma3TextConfig` and
    `Gemma2Config` read their configs. Gemma 3: the local layers' RoPE base `rope_local_base_freq` (transformers >= 5:
    `rope_parameters.sliding_attention.rope_theta`), which layers are local (`layer_types`, else every
    `sliding_window_pattern`-th layer global, 6 by default). Gemma 2: one RoPE for every layer, every other layer
    sliding (the first one so) where `layer_types` is not given, attention scores soft-capped
    (`attn_logit_softcapping`, 50 by default) and final logits too (30 by default). Refuses, naming them, the options
    the runtime lacks."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: true is not supported (supported: false, causal attention)")
    activation = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={activation!r} is not supported (supported: gelu_pytorch_tanh)")
    common = {
        "scale_embeddings": True,
        "sandwich_norms": True,
        "mlp_activation": "gelu_tanh",
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
    }
    if family == "gemma2":
        # transformers' Gemma2Config defaults where the config is silent; null is no cap
        caps = {name: float(cfg.get(name, default) or 0.0)
                for name, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))}
        return {**common, **caps}
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attn_logit_softcapping={cfg['attn_logit_softcapping']} is not supported for gemma3_text "
                         "(supported: null, as Gemma 3 has it)")
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.sliding_attention.rope_type={local['rope_type']!r} is not supported "
                         "(supported: default)")
    types = _gemma_layer_types(cfg, family, num_layers)
    return {
        **common,
        "local_rope_theta": float(cfg.get("rope_local_base_freq", local.get("rope_theta", 10_000.0))),
        "local_rope_layers": tuple(t == "sliding_attention" for t in types),
        "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 0.0),
    }


def _gemma_layer_types(cfg: Mapping[str, Any], family: str, num_layers: int) -> list[str]:
    """A Gemma's `layer_types`, or where an older config lists none, as transformers fills them in: Gemma 3 every
    `sliding_window_pattern`-th layer (6 by default) full attention and the rest sliding, Gemma 2 every other one
    (the first sliding)."""
    types = cfg.get("layer_types")
    if types is not None:
        return list(types)
    pattern = int(cfg.get("sliding_window_pattern", 6)) if family == "gemma3_text" else 2
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _longrope(cfg: Mapping[str, Any], params: Mapping[str, Any], max_positions: int) -> RopeScaling:
    """Longrope (or su) scaling from a config's rope parameters, as transformers' `_compute_longrope_parameters`
    reads them: Phi-3's top-level `original_max_position_embeddings` before the parameters' own (else the context
    itself); the attention factor the config's, else sqrt(1 + ln(factor) / ln(original)) with factor =
    max_position_embeddings / original (unless the parameters give `factor`), 1 where that factor is at most 1."""
    original = int(cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or max_positions)
    for name in ("short_factor", "long_factor"):
        if not isinstance(params.get(name), list):
            raise ValueError(f"longrope rope scaling needs {name}: a list of one number per rotated frequency")
    factor = params.get("factor")
    factor = max_positions / original if factor is None else float(factor)
    attention = params.get("attention_factor")
    return RopeScaling(kind="longrope", factor=factor, original_max_position_embeddings=original,
                       short_factor=tuple(float(f) for f in params["short_factor"]),
                       long_factor=tuple(float(f) for f in params["long_factor"]),
                       attention_factor=longrope_attention_factor(factor, original) if attention is None
                       else float(attention))


def longrope_attention_factor(factor: float, original: int) -> float:
    """The scale of longrope's cos and sin where the model does not give it (the LongRoPE paper's, transformers' and
    llama.cpp's converter's)."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


# llama.cpp's converter writes longrope's (Phi-3's) factors as these tensors; they are read into the config, not
# loaded as weights
ROPE_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def read_gguf(path: Path) -> tuple[GGUFFile, ModelConfig]:
    """A GGUF file (its metadata, and its memory-mapped tensors: no tensor data is read yet) and its model's
    config."""
    file = GGUFFile(path)
    names = frozenset(t.name for t in file.tensors)
    factors = {}
    for tensor in file.tensors:
        if tensor.name in ROPE_FACTOR_TENSORS:
            if tensor.tensor_type not in (0, 1):  # F32, F16: what llama.cpp's converter writes them in
                raise ValueError(f"GGUF tensor {tensor.name!r} has GGML type {tensor.tensor_type} (supported: F32, "
                                 "F16)")
            factors[tensor.name] = tuple(float(v) for v in tensor.data.reshape(-1))
    return file, gguf_model_config(file.metadata, has_output="output.weight" in names, tensor_names=names,
                                   rope_factors=factors)


def gguf_model_config(meta: dict[str, Any], has_output: bool, tensor_names: frozenset[str] = frozenset(),
                      rope_factors: Mapping[str, Sequence[float]] | None = None) -> ModelConfig:
    """From a GGUF file's metadata; `tensor_names` tell what the metadata does not (biases, q/k norms), and
    `rope_factors` (name -> values of the ROPE_FACTOR_TENSORS the file has) make its RoPE longrope. Mixtral is the
    `llama` architecture with `llama.expert_count`."""
    arch = meta.get("general.architecture")
    family = _GGUF_ARCHS.get(arch, arch) if isinstance(arch, str) else arch
    if family not in FAMILIES:
        raise unsupported_family(arch, "GGUF architecture")
    arch = str(arch)
    num_experts = int(meta.get(f"{arch}.expert_count") or 0)
    if arch == "llama" and num_experts:
        family = "mixtral"
    if family in MIXTURES and not num_experts:
        raise ValueError(f"GGUF metadata lacks {arch}.expert_count ({family} is a mixture of experts)")
    num_experts = num_experts if family in MIXTURES else 0

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
    scaling = RopeScaling(kind=scaling_type, factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)))
    if rope_factors:
        scaling = _gguf_longrope(meta, arch, rope_factors)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    dense_ffn = int(get("feed_forward_length"))
    # a Qwen mixture's experts have their own size (feed_forward_length is its dense MLPs'); Mixtral's are the MLP's
    expert_ffn = int(meta.get(f"{arch}.expert_feed_forward_length") or dense_ffn) if num_experts else dense_ffn
    num_layers = int(get("block_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    gemma, sliding = _gguf_gemma_options(meta, arch, family, num_layers, hidden // num_heads, head_dim) \
        if family in GEMMAS else ({}, None)
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=expert_ffn,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings=not has_output,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        family=family,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        layer_windows=_windows(num_layers, meta.get(f"{arch}.attention.sliding_window"), int(get("context_length")),
                               None if sliding is None else list(sliding)),
        rotary_dim=int(meta.get(f"{arch}.rope.dimension_count", 0)),
        num_experts=num_experts,
        experts_per_token=int(get("expert_used_count")) if num_experts else 0,
        renormalize_experts=bool(meta.get(f"{arch}.expert_weights_norm", _GGUF_RENORMALIZE.get(family, True))),
        # llama.cpp sizes a shared expert the file does not size as the dense MLP
        shared_expert_intermediate_size=int(meta.get(f"{arch}.expert_shared_feed_forward_length") or dense_ffn)
        if family == "qwen2_moe" else 0,
        **gemma,
    )


def _gguf_gemma_options(meta: dict[str, Any], arch: str, family: str, num_layers: int, hidden_per_head: int,
                        head_dim: int) -> tuple[dict[str, Any], tuple[bool, ...]]:
    """A Gemma from GGUF as llama.cpp reads it, and which of its layers slide. Its converter writes neither which
    layers are local nor (Gemma 3) their RoPE base nor the attention scale, and llama.cpp fixes them: Gemma 3 every
    6th layer global, the local base 10000, the scale hidden / heads for the 27B model (62 layers), else head_dim's;
    Gemma 2 every other layer sliding (the first so), the scale hidden / heads for its 27B model (46 layers), its caps
    `attn_logit_softcapping` and `final_logit_softcapping` as written (llama.cpp's defaults 50 and 30 where not). A
    file that writes `attention.sliding_window_pattern` (a period, or one flag per layer) or `rope.freq_base_swa` is
    read by them."""
    gemma2 = family == "gemma2"
    if not gemma2 and meta.get(f"{arch}.attn_logit_softcapping"):
        raise ValueError(f"GGUF {arch}.attn_logit_softcapping={meta[f'{arch}.attn_logit_softcapping']} is not "
                         "supported for gemma3 (supported: none, as Gemma 3 has it)")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2 if gemma2 else 6)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ValueError(f"GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} flags for "
                             f"{num_layers} layers")
        local = tuple(bool(flag) for flag in pattern)
    else:
        local = tuple(i % int(pattern) < int(pattern) - 1 for i in range(num_layers))
    options: dict[str, Any] = {
        "scale_embeddings": True,
        "sandwich_norms": True,
        "mlp_activation": "gelu_tanh",
        "query_pre_attn_scalar": float(hidden_per_head if num_layers == (46 if gemma2 else 62) else head_dim),
    }
    if gemma2:
        caps = {name: float(meta.get(f"{arch}.{name}", default) or 0.0)
                for name, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0))}
        return {**options, **caps}, local
    return {
        **options,
        "local_rope_theta": float(meta.get(f"{arch}.rope.freq_base_swa", 10_000.0)),
        "local_rope_layers": local,
        "final_logit_softcapping": float(meta.get(f"{arch}.final_logit_softcapping") or 0.0),
    }, local


def _windows(num_layers: int, window: object, context: int, sliding: list[bool] | None = None) -> tuple[int, ...]:
    """Each layer's window (`sliding`: which layers have one; all when None), or () when no layer has one that is
    shorter than the context (a window that long changes nothing)."""
    if window is None or window == 0 or (sliding is not None and not any(sliding)):  # 0: none, as transformers
        return ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window!r}")
    if window >= context:
        return ()
    layers = tuple(window if sliding is None or sliding[i] else 0 for i in range(num_layers))
    return layers if any(layers) else ()


def _hf_layer_windows(cfg: Mapping[str, Any], family: str, num_layers: int, context: int) -> tuple[int, ...]:
    """Layer windows as transformers applies them: `layer_types` where the config lists them; else Qwen's
    `use_sliding_window` from layer `max_window_layers` up; else `sliding_window` on every layer."""
    window = cfg.get("sliding_window", 4096 if family in GEMMAS else None)  # transformers' default
    types = _gemma_layer_types(cfg, family, num_layers) if family in GEMMAS else cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types must list sliding_attention or full_attention for each of the "
                             f"{num_layers} layers, got {types!r}")
        return _windows(num_layers, window, context, [t == "sliding_attention" for t in types])
    if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if not cfg.get("use_sliding_window"):
            return ()
        first = int(cfg.get("max_window_layers", num_layers))
        return _windows(num_layers, window, context, [i >= first for i in range(num_layers)])
    return _windows(num_layers, window, context)


def _gguf_longrope(meta: dict[str, Any], arch: str, factors: Mapping[str, Sequence[float]]) -> RopeScaling:
    """Longrope as llama.cpp's converter writes it for Phi-3: the factors as tensors, the pre-training context as
    `rope.scaling.original_context_length`, the scale of cos and sin as `rope.scaling.attn_factor`."""
    short, long = (factors.get(name) for name in ROPE_FACTOR_TENSORS)
    if short is None or long is None:
        raise ValueError(f"GGUF longrope needs both {' and '.join(ROPE_FACTOR_TENSORS)}, the file has only "
                         f"{', '.join(factors)}")
    original, context = (meta.get(f"{arch}.{key}") for key in ("rope.scaling.original_context_length",
                                                                "context_length"))
    if original is None or context is None:
        raise ValueError(f"GGUF longrope needs {arch}.rope.scaling.original_context_length and "
                         f"{arch}.context_length")
    factor = int(context) / int(original)
    attention = meta.get(f"{arch}.rope.scaling.attn_factor")
    return RopeScaling(kind="longrope", factor=factor, original_max_position_embeddings=int(original),
                       short_factor=tuple(short), long_factor=tuple(long),
                       attention_factor=longrope_attention_factor(factor, int(original)) if attention is None
                       else float(attention))
