"""A decoder's shape (`ModelConfig`), read from a Hugging Face `config.json` or a GGUF file's metadata, for the
families the one decoder skeleton (runtimes/llm/model.py) runs: Llama, Mistral (a sliding window only where it is
no shorter than the context), Phi-3 (its checkpoint's fused qkv and gate|up are the skeleton's own; no longrope
yet), Qwen2 / Qwen2.5 (biases on q, k and v), Qwen3 (a per-head RMSNorm on q and k), and the mixtures of experts
Mixtral, Qwen3-MoE and Qwen2-MoE (Qwen2's biases, and a shared expert beside the routed ones), from Hugging Face
directories and from GGUF files (where Mixtral is the `llama` architecture with experts, and the Qwen mixtures are
`qwen3moe` / `qwen2moe`). Imports no torch: the planner reads a local model's shape with it in the gateway process,
which holds no engine."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtimes.llm.gguf_file import GGUFFile

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `none`, `linear` or `llama3` (Llama 3.1's piecewise scaling)."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


# Hugging Face `model_type` -> the family; GGUF `general.architecture` names the same families (`_GGUF_ARCHS`: where
# its name differs)
FAMILIES = ("llama", "mistral", "mixtral", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe")  # the families whose MLP is a mixture of experts
# GGUF `general.architecture` names that are not the family's Hugging Face name (llama.cpp drops the underscore)
_GGUF_ARCHS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
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
    # Qwen2-MoE's shared expert: an MLP of this size that every token takes besides its routed experts, its output
    # scaled by sigmoid(a hidden -> 1 projection of the token); 0 where the family has none
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face `config.json` of a model of one of FAMILIES."""
        family = cfg.get("model_type", "llama")
        if family not in FAMILIES:
            raise unsupported_family(family, "model_type")
        window = cfg.get("sliding_window") if family not in ("qwen2", "qwen2_moe") or cfg.get("use_sliding_window") \
            else None
        if window is not None and int(window) < int(cfg.get("max_position_embeddings", 2048)):
            raise ValueError(f"{family} with sliding-window attention (sliding_window={window}, shorter than its "
                             "context) is not supported yet")
        rotary = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if float(rotary) != 1.0:
            raise ValueError(f"partial rotary embeddings (partial_rotary_factor={rotary}) are not supported yet")
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
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rs = cfg.get("rope_scaling") or {}
        # transformers >= 5 folds rope_theta into rope_parameters
        rp = cfg.get("rope_parameters") or {}
        kind = rs.get("rope_type", rs.get("type", rp.get("rope_type", "default")))
        src = rs or rp
        scaling = RopeScaling(
            kind={"default": "none"}.get(kind, kind),
            factor=float(src.get("factor", 1.0)),
            low_freq_factor=float(src.get("low_freq_factor", 1.0)),
            high_freq_factor=float(src.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(src.get("original_max_position_embeddings", 8192)),
        )
        if scaling.kind not in ("none", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["moe_intermediate_size" if qwen_moe else "intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rp.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=family,
            qkv_bias=family in ("qwen2", "qwen2_moe") or attention_bias,
            o_bias=family not in ("qwen2", "qwen2_moe") and attention_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            num_experts=num_experts,
            experts_per_token=int(cfg.get("num_experts_per_tok", 0) or 0) if num_experts else 0,
            renormalize_experts=family == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]) if family == "qwen2_moe" else 0,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))


def read_gguf(path: Path) -> tuple[GGUFFile, ModelConfig]:
    """A GGUF file (its metadata, and its memory-mapped tensors: no tensor data is read yet) and its model's
    config."""
    file = GGUFFile(path)
    names = frozenset(t.name for t in file.tensors)
    return file, gguf_model_config(file.metadata, has_output="output.weight" in names, tensor_names=names)


def gguf_model_config(meta: dict[str, Any], has_output: bool, tensor_names: frozenset[str] = frozenset()
                      ) -> ModelConfig:
    """From a GGUF file's metadata; `tensor_names` tell what the metadata does not (biases, q/k norms). Mixtral is
    the `llama` architecture with `llama.expert_count`."""
    arch = meta.get("general.architecture")
    family = _GGUF_ARCHS.get(arch, arch) if isinstance(arch, str) else arch
    if family not in FAMILIES:
        raise unsupported_family(arch, "GGUF architecture")
    num_experts = int(meta.get(f"{arch}.expert_count") or 0)
    if arch == "llama" and num_experts:
        family = "mixtral"
    if family in MIXTURES and not num_experts:
        raise ValueError(f"GGUF metadata lacks {arch}.expert_count ({family} is a mixture of experts)")
    num_experts = num_experts if family in MIXTURES else 0
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is not None and int(window) < int(meta.get(f"{arch}.context_length", 0)):
        raise ValueError(f"{arch} with sliding-window attention (sliding_window={window}, shorter than its context) "
                         "is not supported yet")

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
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    dense_ffn = int(get("feed_forward_length"))
    # a Qwen mixture's experts have their own size (feed_forward_length is its dense MLPs'); Mixtral's are the MLP's
    expert_ffn = int(meta.get(f"{arch}.expert_feed_forward_length") or dense_ffn) if num_experts else dense_ffn
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=expert_ffn,
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=RopeScaling(kind=scaling_type, factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0))),
        tie_word_embeddings=not has_output,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        family=family,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        num_experts=num_experts,
        experts_per_token=int(get("expert_used_count")) if num_experts else 0,
        renormalize_experts=bool(meta.get(f"{arch}.expert_weights_norm", _GGUF_RENORMALIZE.get(family, True))),
        # llama.cpp sizes a shared expert the file does not size as the dense MLP
        shared_expert_intermediate_size=int(meta.get(f"{arch}.expert_shared_feed_forward_length") or dense_ffn)
        if family == "qwen2_moe" else 0,
    )
