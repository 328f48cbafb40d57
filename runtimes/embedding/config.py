"""Encoder shape, pooling recipe and embedding-engine limits. All immutable after construction.

`EncoderConfig` comes from a Hugging Face BERT `config.json`; `PoolingConfig` from the sentence-transformers
files next to it (`modules.json`, the Pooling module's `config.json`, `sentence_bert_config.json`), so the
vectors we return are the ones sentence-transformers would return for the same model directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

PoolingMode = Literal["cls", "mean", "max"]
_POOLING_FLAGS: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
}
_UNSUPPORTED_POOLING = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                        "pooling_mode_lasttoken")


@dataclass(frozen=True)
class EncoderConfig:
    """Shape of a BERT-family encoder (absolute positions, post-LN, GELU)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> EncoderConfig:
        """From a Hugging Face `config.json` of a BERT model; other architectures are refused by name."""
        if cfg.get("model_type", "bert") != "bert":
            raise ValueError(f"unsupported encoder model_type {cfg.get('model_type')!r} (supported: bert)")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {cfg['position_embedding_type']!r}")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (supported: gelu)")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> EncoderConfig:
        return cls.from_hf_config(json.loads((path / "config.json").read_text()))


@dataclass(frozen=True)
class PoolingConfig:
    """How token states become one vector: `mode` over the attended tokens, then L2 `normalize` or not.

    `max_seq_length` is the model's input limit in tokens (special tokens included), None when the
    directory does not say (the encoder's position table is the limit then).
    """

    mode: PoolingMode = "mean"
    normalize: bool = False
    max_seq_length: int | None = None

    @classmethod
    def from_sentence_transformers_dir(cls, path: Path) -> PoolingConfig:
        """Read `modules.json` and its Pooling / Normalize modules; a plain HF directory means mean pooling,
        as sentence-transformers assumes for it."""
        bert_cfg = path / "sentence_bert_config.json"
        max_len = json.loads(bert_cfg.read_text()).get("max_seq_length") if bert_cfg.exists() else None
        max_len = None if max_len is None else int(max_len)
        modules_file = path / "modules.json"
        if not modules_file.exists():
            return cls(max_seq_length=max_len)
        modules = json.loads(modules_file.read_text())
        kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
        mode: PoolingMode = "mean"
        if "Pooling" in kinds:
            mode = _pooling_mode(json.loads((path / kinds["Pooling"]["path"] / "config.json").read_text()))
        return cls(mode=mode, normalize="Normalize" in kinds, max_seq_length=max_len)


def _pooling_mode(cfg: Mapping[str, Any]) -> PoolingMode:
    unsupported = [flag for flag in _UNSUPPORTED_POOLING if cfg.get(flag)]
    modes = [mode for flag, mode in _POOLING_FLAGS.items() if cfg.get(flag)]
    if unsupported or len(modes) != 1:
        raise ValueError(f"unsupported pooling config {dict(cfg)}: exactly one of cls, mean or max pooling is "
                         "supported")
    return modes[0]


@dataclass(frozen=True)
class EmbeddingConfig:
    """Limits of one embedding engine (one replica).

    Requests arriving within `batch_window_s` of the oldest waiting one, up to `max_batch_size` inputs, are
    encoded together, in chunks of at most `max_batch_tokens` padded tokens between which requests take turns
    (runtimes/embedding/batching.py). `max_model_len` may lower the model's own input limit (None: the model's);
    `max_request_tokens` caps one request's inputs' tokens, summed.
    """

    device: str = "auto"  # auto | cpu | cuda[:N]
    # auto: float16 on CUDA (an encoder's activations fit its range, and it keeps 3 more mantissa bits than
    # bfloat16 for the vectors), float32 on the CPU
    dtype: str = "auto"
    max_batch_size: int = 64
    # What a lone client pays in latency; under load the window has usually passed when a batch ends.
    batch_window_s: float = 0.002
    max_batch_tokens: int = 64 * 256
    max_model_len: int | None = None
    # The sum of a request's inputs' token counts (what `usage.prompt_tokens` reports; padding is the engine's
    # business and at most doubles it). 2**17 holds OpenAI's 2,048 inputs at 64 tokens each, or 512 inputs at
    # all-MiniLM's 256-token limit; a 256 x 256-token request (65,536) is served, in 4 chunks that other requests
    # interleave with. It refuses what would hold one client's answer for minutes on a CPU: 2,048 x 256 tokens
    # (524,288) is ~4 min of a 2-core CPU's encoder time. OpenAI allows 300,000 summed (its inputs run to 8,192
    # tokens); a GPU replica may raise it.
    max_request_tokens: int = 1 << 17
    min_bucket_len: int = 32  # shortest padded length of a length bucket (tokens)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.batch_window_s <= 1:
            raise ValueError(f"batch_window_s must be within [0, 1] seconds, got {self.batch_window_s}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.max_request_tokens < 1:
            raise ValueError(f"max_request_tokens must be >= 1, got {self.max_request_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.min_bucket_len < 1:
            raise ValueError(f"min_bucket_len must be >= 1, got {self.min_bucket_len}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
