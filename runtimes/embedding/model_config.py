"""What an embedding model directory says about its encoder and its pooling, read the way transformers and
sentence-transformers read it. Imports no torch: the registry's check reads a local embedding model with it in the
gateway process, which holds no engine (partitioner/planning/shapes.py's `family_problems`).

`EncoderConfig` comes from a Hugging Face `config.json` of the BERT family: BERT itself (MiniLM, BGE, E5, GTE) and
RoBERTa / XLM-RoBERTa (multilingual-e5, bge-m3's dense vectors), which differ from BERT only in where their
position ids start. `PoolingConfig` comes from the sentence-transformers files next to it (`modules.json`, the
Pooling module's `config.json`, `sentence_bert_config.json`). Anything else is refused by name when read, with the
values we support, rather than served with vectors that differ from the reference's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# Hugging Face `model_type`s the encoder runs. RoBERTa's position ids start after its padding id (below).
MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
_ROBERTA_TYPES = ("roberta", "xlm-roberta")
# The checkpoint prefix transformers strips when a base model is loaded from a task model's file (its
# `base_model_prefix`): `bert.` for BERT, `roberta.` for both RoBERTa types.
_WEIGHT_PREFIX = {"bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta."}
# `hidden_act` values, each computed as transformers' ACT2FN computes it (runtimes/embedding/model.py):
# gelu is the exact (erf) GELU, gelu_new the tanh approximation written out, gelu_pytorch_tanh torch's tanh GELU.
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
POSITION_EMBEDDING_TYPES = ("absolute",)

PoolingMode = Literal["cls", "mean", "max"]
POOLING_MODES: tuple[PoolingMode, ...] = ("cls", "mean", "max")
# sentence-transformers' older Pooling config: one boolean per mode (what most published models carry)
_LEGACY_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# sentence-transformers modules (the last part of modules.json's `type`) whose work we do
MODULES = ("Transformer", "Pooling", "Normalize")


def _supported(field: str, value: object, supported: tuple[str, ...]) -> ValueError:
    return ValueError(f"unsupported {field} {value!r} (supported: {', '.join(supported)})")


@dataclass(frozen=True)
class EncoderConfig:
    """Shape of a BERT-family encoder: absolute positions, post-LN layers, one of `ACTIVATIONS`.

    `padding_idx` is RoBERTa's: its position ids are HF's `create_position_ids_from_input_ids`, counting real
    tokens from padding_idx + 1, so the first padding_idx + 1 rows of the position table are never an input's.
    None for BERT, whose positions are 0, 1, 2, ...
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    model_type: str = "bert"
    padding_idx: int | None = None

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        if self.model_type not in MODEL_TYPES:
            raise _supported("encoder model_type", self.model_type, MODEL_TYPES)
        if self.hidden_act not in ACTIVATIONS:
            raise _supported("hidden_act", self.hidden_act, ACTIVATIONS)
        if (self.padding_idx is None) != (self.model_type not in _ROBERTA_TYPES):
            raise ValueError(f"padding_idx is set for RoBERTa types only (model_type {self.model_type!r}, "
                             f"padding_idx {self.padding_idx!r})")
        if self.max_input_len < 1:
            raise ValueError(f"max_position_embeddings={self.max_position_embeddings} leaves no position for a "
                             f"token after padding_idx={self.padding_idx}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_input_len(self) -> int:
        """The longest input the position table holds, special tokens included (RoBERTa's 514 rows: 512)."""
        return self.max_position_embeddings - (0 if self.padding_idx is None else self.padding_idx + 1)

    @property
    def weight_prefix(self) -> str:
        """The prefix a task model's checkpoint puts before the encoder's tensor names (`bert.`, `roberta.`)."""
        return _WEIGHT_PREFIX[self.model_type]

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> EncoderConfig:
        """From a Hugging Face `config.json`; another architecture, relative positions or another activation is
        refused by name, listing what is supported."""
        model_type = cfg.get("model_type", "bert")
        if model_type not in MODEL_TYPES:
            raise _supported("encoder model_type", model_type, MODEL_TYPES)
        position_type = cfg.get("position_embedding_type", "absolute")
        if position_type not in POSITION_EMBEDDING_TYPES:
            raise _supported("position_embedding_type", position_type, POSITION_EMBEDDING_TYPES)
        hidden_act = cfg.get("hidden_act", "gelu")
        if not isinstance(hidden_act, str) or hidden_act not in ACTIVATIONS:
            raise _supported("hidden_act", hidden_act, ACTIVATIONS)
        roberta = model_type in _ROBERTA_TYPES
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            hidden_act=hidden_act,
            model_type=model_type,
            padding_idx=int(cfg.get("pad_token_id", 1)) if roberta else None,  # RobertaConfig's default pad: 1
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
        as sentence-transformers assumes for it. A module we do not run (a Dense projection, say) is refused:
        the vectors would not be the model's."""
        max_len = max_seq_length(path)
        modules_file = path / "modules.json"
        if not modules_file.exists():
            return cls(max_seq_length=max_len)
        modules = json.loads(modules_file.read_text())
        kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
        unknown = [m["type"] for m in modules if m["type"].rsplit(".", 1)[-1] not in MODULES]
        if unknown:
            raise ValueError(f"modules.json: unsupported sentence-transformers module(s) {', '.join(unknown)} "
                             f"(supported: {', '.join(MODULES)})")
        if kinds.get("Transformer", {}).get("path", "") != "":
            raise ValueError(f"modules.json: the Transformer module's path must be the directory itself (\"\"), "
                             f"got {kinds['Transformer']['path']!r}")
        if "Pooling" not in kinds:
            raise ValueError("modules.json has no Pooling module: it gives token vectors, not one per input")
        mode = pooling_mode(json.loads((path / kinds["Pooling"]["path"] / "config.json").read_text()))
        return cls(mode=mode, normalize="Normalize" in kinds, max_seq_length=max_len)


def pooling_mode(cfg: Mapping[str, Any]) -> PoolingMode:
    """The mode of a sentence-transformers Pooling `config.json`: its `pooling_mode` (a name, or a list of one),
    or the older per-mode flags (none set: mean), as sentence-transformers reads them. Several modes at once (their
    vectors concatenated) and the other modes are refused, naming the supported ones."""
    given = cfg.get("pooling_mode")
    if given is None:
        given = [mode for flag, mode in _LEGACY_POOLING_FLAGS.items() if cfg.get(flag)] or ["mean"]
    modes = [given] if isinstance(given, str) else list(given)
    for mode in POOLING_MODES:
        if modes == [mode]:
            return mode
    raise ValueError(f"unsupported pooling mode {modes[0] if len(modes) == 1 else modes!r} (supported: exactly one "
                     f"of {', '.join(POOLING_MODES)})")


def sentence_bert_config(path: Path) -> dict[str, Any]:
    """The Transformer module's `sentence_bert_config.json` ({} when absent)."""
    file = path / "sentence_bert_config.json"
    return json.loads(file.read_text()) if file.exists() else {}


def max_seq_length(path: Path) -> int | None:
    """The input limit sentence-transformers applies: `sentence_bert_config.json`'s max_seq_length, else the
    tokenizer's `model_max_length` (what sentence-transformers 3+ saves instead); None when neither says. The
    encoder's position table caps it either way (runtimes/embedding/engine.py)."""
    given = sentence_bert_config(path).get("max_seq_length")
    if given is None:
        tokenizer_cfg = path / "tokenizer_config.json"
        if tokenizer_cfg.exists():
            given = json.loads(tokenizer_cfg.read_text()).get("model_max_length")
    return None if given is None else int(given)


def lowercases_inputs(path: Path) -> bool:
    """Whether sentence-transformers lowercases texts before tokenizing them (`do_lower_case`)."""
    return bool(sentence_bert_config(path).get("do_lower_case", False))


def check_encoder_dir(path: Path) -> None:
    """Read what the runtime reads before loading weights: raises ValueError naming what it does not run."""
    EncoderConfig.from_hf_dir(path)
    PoolingConfig.from_sentence_transformers_dir(path)
