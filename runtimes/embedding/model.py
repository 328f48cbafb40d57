"""A BERT-family encoder in plain PyTorch, sentence-transformers pooling, and the safetensors loader.

We write the encoder ourselves (embeddings with position and token-type tables, post-LN layers, GELU or ReLU;
about 200 lines) rather than load it through transformers: the runtime then depends only on torch,
safetensors and tokenizers, and transformers / sentence-transformers stay test-only references
(tests/runtimes/embedding checks our vectors against sentence-transformers'). Inference only: no dropout.
BERT and RoBERTa / XLM-RoBERTa share the layers; RoBERTa's position ids start after its padding id
(runtimes/embedding/model_config.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from runtimes.embedding.model_config import EncoderConfig, PoolingConfig


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' `gelu_new` (NewGELUActivation), written out as it writes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# `hidden_act` -> the function transformers' ACT2FN gives for it
ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf) GELU: GELUActivation
    "gelu_new": _gelu_new,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GELUTanh
    "relu": F.relu,  # nn.ReLU
}


def position_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    """[B, S] position ids. BERT: 0, 1, 2, ... RoBERTa: HF's `create_position_ids_from_input_ids`, real tokens
    counted from padding_idx + 1 and padding_idx at its pad tokens. Our batches pad with a placeholder id under
    the mask rather than the pad id, so the mask marks padding too; for a tokenizer's ids that is the same."""
    if padding_idx is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    real = (input_ids != padding_idx) & attention_mask.bool()  # [B, S]
    return torch.cumsum(real, dim=1) * real + padding_idx


class Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.padding_idx = cfg.padding_idx
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # input_ids, attention_mask: [B, S]; one segment per input, so every token has token type 0.
        positions = position_ids(input_ids, attention_mask, self.padding_idx)  # [B, S]
        x = self.word(input_ids) + self.position(positions) + self.token_type.weight[0]  # [B, S, H]
        return self.norm(x)


class EncoderLayer(nn.Module):
    """Post-LN: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        hidden = cfg.hidden_size
        self.qkv = nn.Linear(hidden, 3 * hidden)  # query, key and value fused into one matmul
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(hidden, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, hidden)
        self.ffn_norm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        self.act = ACTIVATION_FUNCTIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        # x: [B, S, H]; key_mask: [B, 1, 1, S] bool, True where a key is a real token.
        batch, seq_len, hidden = x.shape
        qkv = self.qkv(x).view(batch, seq_len, 3, self.num_heads, self.head_dim)  # [B, S, 3, nH, D]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, nH, S, D]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # [B, nH, S, D]
        attn = attn.transpose(1, 2).reshape(batch, seq_len, hidden)  # [B, S, H]
        x = self.attn_norm(x + self.attn_out(attn))
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


class BertEncoder(nn.Module):
    """Token ids and attention mask in, last hidden states out."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # input_ids, attention_mask: [B, S] (mask 1 for real tokens, 0 for padding) -> [B, S, H]
        key_mask = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
        x = self.embeddings(input_ids, attention_mask)
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, cfg: PoolingConfig) -> torch.Tensor:
    """Sentence vectors from token states, as sentence-transformers' Pooling (+ Normalize) modules compute them.

    hidden: [B, S, H]; attention_mask: [B, S] -> [B, H]
    """
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
    if cfg.mode == "cls":
        pooled = hidden[:, 0]
    elif cfg.mode == "mean":
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    elif cfg.mode == "max":
        pooled = hidden.masked_fill(mask == 0, -1e9).max(1).values
    else:
        raise ValueError(f"unknown pooling mode {cfg.mode!r}")
    return F.normalize(pooled, p=2, dim=1) if cfg.normalize else pooled


# Hugging Face BertModel / RobertaModel names -> ours, applied in order (longer, more specific patterns first).
_RENAMES = (
    ("encoder.layer.", "layers."),
    ("attention.output.dense.", "attn_out."),
    ("attention.output.LayerNorm.", "attn_norm."),
    ("intermediate.dense.", "ffn_in."),
    ("output.dense.", "ffn_out."),
    ("output.LayerNorm.", "ffn_norm."),
    ("embeddings.word_embeddings.", "embeddings.word."),
    ("embeddings.position_embeddings.", "embeddings.position."),
    ("embeddings.token_type_embeddings.", "embeddings.token_type."),
    ("embeddings.LayerNorm.", "embeddings.norm."),
)
# The pooler (BERT's NSP head, unused by sentence vectors), buffers older checkpoints saved, and the heads of a
# task model's checkpoint (BertForMaskedLM's `cls.`, RobertaForMaskedLM's `lm_head.`): transformers' AutoModel
# ignores them too.
_UNUSED = ("pooler.", "embeddings.position_ids", "embeddings.token_type_ids", "cls.", "lm_head.")
_QKV = ("query", "key", "value")


def hf_state_dict(tensors: dict[str, torch.Tensor], cfg: EncoderConfig) -> dict[str, torch.Tensor]:
    """Rename a BertModel / RobertaModel checkpoint's tensors to ours and fuse each layer's query/key/value.
    Names may carry the task model's prefix (`bert.`, `roberta.`), as transformers accepts."""
    tensors = {name.removeprefix(cfg.weight_prefix): tensor for name, tensor in tensors.items()}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith(_UNUSED) or ".attention.self." in name:
            continue
        for old, new in _RENAMES:
            name = name.replace(old, new)
        state[name] = tensor
    for i in range(cfg.num_layers):
        prefix = f"encoder.layer.{i}.attention.self"
        for kind in ("weight", "bias"):
            parts = [_tensor(tensors, f"{prefix}.{p}.{kind}") for p in _QKV]
            state[f"layers.{i}.qkv.{kind}"] = torch.cat(parts, 0)  # [3H, H] or [3H]
    return state


def _tensor(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    found = tensors.get(name)
    if found is None:
        raise KeyError(f"checkpoint has no tensor {name!r}")
    return found


def load_encoder(path: Path, device: torch.device, dtype: torch.dtype) -> BertEncoder:
    """The encoder of a Hugging Face BERT-family directory (`config.json`, `model.safetensors`), in eval mode."""
    cfg = EncoderConfig.from_hf_dir(path)
    state = hf_state_dict(load_file(str(path / "model.safetensors")), cfg)
    with torch.device("meta"):
        model = BertEncoder(cfg)
    model.load_state_dict(state, strict=True, assign=True)  # names must match exactly: nothing left random
    return model.to(device=device, dtype=dtype).eval()
