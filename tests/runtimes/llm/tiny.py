"""Tiny random-weight Llama models for fast tests, written as a Hugging Face directory or a GGUF file.

The reference is transformers' `LlamaForCausalLM` with the same weights; the byte-level tokenizer has
the 256 byte tokens plus three ChatML control tokens, so any text encodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 2


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable spelling of each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


TOKENS = SPECIALS + _bytes_to_unicode()


def tokenizer_metadata() -> dict[str, object]:
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * 256,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": EOS_ID,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


@dataclass(frozen=True)
class TinySpec:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    init_std: float = 0.1  # larger than the default 0.02 so greedy choices are not near-ties


def hf_model(spec: TinySpec, seed: int = 0):
    """A random transformers LlamaForCausalLM (fp32, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(TOKENS), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5, rope_theta=spec.rope_theta, tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.init_std, bos_token_id=1, eos_token_id=EOS_ID, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms too, so a wrong norm mapping cannot hide behind all-ones weights
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def save_hf_dir(model, path: Path) -> Path:
    """config.json + model.safetensors + tokenizer.json, as a Hugging Face directory."""
    from runtimes.llm.tokenizer import Tokenizer

    model.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer.from_gguf_metadata(tokenizer_metadata())
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML, "add_bos_token": False}
    ))
    return path


def permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (rotate-halves RoPE rows -> interleaved pairs)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(model, path: Path, qtype_name: str = "F32", encode=None) -> Path:
    """Write `model` as a llama GGUF file, 2-D weights in `qtype_name` (norms stay F32).

    `encode(array, qtype) -> uint8 blocks` replaces gguf-py's quantizer (which lacks K-quants).
    """
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    qtype = gguf.GGMLQuantizationType[qtype_name]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    # transformers >= 5 moves rope_theta into rope_parameters; older ones keep it on the config
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
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
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if name in names:
            out = names[name]
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight
            out = f"blk.{parts[2]}.{layer['.'.join(parts[3:-1])]}.weight"
        if out.endswith("attn_q.weight"):
            array = permute_qk(array, cfg.num_attention_heads)
        elif out.endswith("attn_k.weight"):
            array = permute_qk(array, cfg.num_key_value_heads)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            blocks = quantize(array, qtype) if encode is None else encode(array, qtype)
            writer.add_tensor(out, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(out, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def roundtrip_weights(model, qtype_name: str):
    """Replace 2-D weights by their quantize->dequantize image, so the reference sees what GGUF stores."""
    import gguf
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[qtype_name]
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.ndim == 2:
                array = param.float().numpy()
                param.copy_(torch.from_numpy(dequantize(quantize(array, qtype), qtype).reshape(array.shape).copy()))
    return model


def loaded_tiny(spec: TinySpec = TinySpec(), seed: int = 0):
    """Our model with a tiny random Llama's weights, in memory (no files), as a LoadedModel."""
    from runtimes.llm.config import ModelConfig
    from runtimes.llm.loader import LoadedModel, load_state_dict
    from runtimes.llm.tokenizer import Tokenizer

    ref = hf_model(spec, seed)
    config = ModelConfig.from_hf_config(ref.config.to_dict())
    model = load_state_dict(config, ref.state_dict().items(), torch.device("cpu"), torch.float32)
    return LoadedModel(model=model, config=config, tokenizer=Tokenizer.from_gguf_metadata(tokenizer_metadata()),
                       name=f"tiny-{seed}")


def inverse_permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo `permute_qk` by index (independent of the loader's own implementation)."""
    rows = permute_qk(np.arange(weight.shape[0])[:, None], num_heads)[:, 0]
    out = np.empty_like(weight)
    out[rows] = weight
    return out


def weights_from_gguf(model, path: Path):
    """Load into the transformers `model` exactly the (dequantized) weights a GGUF file stores."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    cfg = model.config
    stored = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32) for t in reader.tensors}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            key = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}.get(name)
            if key is None:
                parts = name.split(".")
                module = ".".join(parts[3:-1])
                suffix = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
                          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}[module]
                key = f"blk.{parts[2]}.{suffix}.weight"
            array = stored[key].reshape(param.shape)
            if key.endswith("attn_q.weight"):
                array = inverse_permute_qk(array, cfg.num_attention_heads)
            elif key.endswith("attn_k.weight"):
                array = inverse_permute_qk(array, cfg.num_key_value_heads)
            param.copy_(torch.from_numpy(np.array(array, copy=True)))
    return model
