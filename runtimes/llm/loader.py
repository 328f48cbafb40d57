"""Load a decoder (model_config.FAMILIES) from a GGUF file or a Hugging Face directory (config.json + *.safetensors).

A GGUF file is read through `gguf_file.GGUFFile` (a memory map). Its tensors are kept in their blocks
(`quant/weights.py`) or dequantized with gguf-py (llama.cpp's own, numpy-vectorized) to fp32 one at a time and
cast to the engine's dtype as they are copied in: the model is allocated once, in its own dtype, and the load
never holds more than one checkpoint tensor in fp32 besides it. llama.cpp's converter permutes the rows of Q and K
so its interleaved RoPE works; our model uses Hugging Face's rotate-halves RoPE, so those permutations are undone
here. A mixture's experts are stacked in GGUF (`ffn_{gate,up,down}_exps`, one 3-D tensor per layer and part); each
expert's slice is yielded as that expert's weight, as the 2-D weights are: its blocks kept where its format is, else
dequantized on its own.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from registry.sources import resolve_model_path
from runtimes.llm.config import ModelConfig
from runtimes.llm.model import AttentionFn, Linear, LlamaForCausalLM, MixtureOfExperts
from runtimes.llm.model_config import GEMMAS, ROPE_FACTOR_TENSORS, read_gguf
from runtimes.llm.quant.cpu import BlockWeight
from runtimes.llm.quant.formats import BlockFormat
from runtimes.llm.quant.weights import (
    FUSED_INTO,
    BlockTensor,
    as_blocks,
    block_formats,
    check_weights,
    swap_modules,
    target_of,
)
from runtimes.llm.tokenizer import Tokenizer

Checkpoint = Iterable[tuple[str, "torch.Tensor | BlockTensor"]]


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str


def load_model(
    source: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    attention_fn: AttentionFn | None = None,
    progress: bool = True,
    weights: str | None = None,
) -> LoadedModel:
    """Load a model onto `device`: every weight in `dtype`, or, with `weights` (`engine.weights`: auto, q8, q4 on
    the CPU; see runtimes/llm/quant/weights.py), the projections, embedding and LM head in a block format."""
    path = resolve_model_path(source)
    if weights is not None:
        check_weights(weights, device)
    if path.is_dir():
        config = ModelConfig.from_hf_dir(path)
        tokenizer = Tokenizer.from_hf_dir(path)
        source_types: dict[str, int | None] = {}  # floating point throughout
        name = path.name
    else:
        reader, config = read_gguf(path)
        tokenizer = Tokenizer.from_gguf_metadata(reader.metadata)
        source_types = {part: int(t.tensor_type) for t in reader.tensors if t.name not in ROPE_FACTOR_TENSORS
                        for part in _checkpoint_names(t, config)}
        name = path.stem
    formats = {} if weights is None else block_formats(weights, device, config.num_layers,
                                                        config.tie_word_embeddings, source_types, config.num_experts,
                                                        bool(config.shared_expert_intermediate_size))
    if path.is_dir():
        tensors: Checkpoint = _unfused(_hf_tensors(path), config)
        if config.family in _NORMS_PLUS_ONE:
            tensors = _norms_plus_one(tensors)
    else:
        tensors = _unfused(_gguf_tensors(reader, config, keep_blocks=lambda hf: target_of(hf) in formats), config)
    if tokenizer.eos_token_ids and not config.eos_token_ids:
        config = replace(config, eos_token_ids=tokenizer.eos_token_ids)
    model = load_state_dict(config, tensors, device, dtype, attention_fn, progress, desc=f"loading {name}",
                            formats=formats)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, name=name)


def load_state_dict(
    config: ModelConfig,
    tensors: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    attention_fn: AttentionFn | None = None,
    progress: bool = False,
    desc: str = "loading",
    formats: dict[str, BlockFormat] | None = None,
) -> LlamaForCausalLM:
    """Build the model from (Hugging Face name, tensor) pairs without first initialising random weights. Its
    parameters are allocated on `device` directly in `dtype` (never in fp32 first: that would double the peak), and
    the weights `formats` names directly in their block format."""
    kwargs = {} if attention_fn is None else {"attention_fn": attention_fn}
    with torch.device("meta"):
        model = LlamaForCausalLM(config, **kwargs)
    swap_modules(model, formats or {})
    if device.type == "cuda":  # dense experts stacked for the grouped GEMM, here on meta: the allocation makes them
        for module in model.modules():
            if isinstance(module, MixtureOfExperts):
                module.stack_experts()
    # `to_empty` on meta tensors goes through torch's Python reference of empty_like, which imports sympy (~40 MB
    # resident in every replica); empty tensors of the same shapes are what it makes
    model = model.to(dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    _load_weights(model, tensors, config, device, dtype, progress, desc, formats or {})
    for rotary in (model.rotary, model.local_rotary):  # non-persistent buffers were created on the meta device
        if rotary is not None:
            rotary.rebuild(device)
    if device.type == "cpu":
        _store_weights_transposed(model)
        if dtype == torch.float32:
            pack_cpu_weights(model)
        for module in model.modules():  # block-format weights: into the CPU kernel's panels, one at a time
            if isinstance(module, BlockWeight):
                module.pack_for_cpu()
    return model.eval().requires_grad_(False)


def pack_cpu_weights(model: LlamaForCausalLM) -> None:
    """Give the gate|up projections and the LM head a oneDNN pre-packed (blocked) copy of their fp32 weight,
    used for batches of `model.PACKED_MIN_ROWS` rows or more. Measured on SmolLM2 (2-core AVX-512 Xeon, 2 threads)
    at 32 rows: gate|up 0.60 -> 0.46 ms, LM head 10.4 -> 8.7 ms, i.e. ~6 ms of a ~90 ms decode step; the other
    projections were slower or equal packed, and at 1 row MKL on the plain weight is as fast or faster, so
    both copies are kept (~330 MB more for SmolLM2: the gate|up weights and the tied embedding again).
    Numerics: a different fp32 summation order, ~5e-6 from MKL's. No-op where torch lacks oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return
    for module in model.modules():
        if isinstance(module, Linear) and module.packable:  # the projections the model declares packable: gate|up
            module.packed = _pack(module.weight)
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    if isinstance(head, (torch.nn.Embedding, torch.nn.Linear)):  # not one kept in a block format
        model.packed_lm_head = _pack(head.weight)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    # the batch size is oneDNN's hint for choosing the blocked layout; the packed weight serves any batch
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)


def _store_weights_transposed(model: LlamaForCausalLM) -> None:
    """Keep each projection's and the (tied) LM head's [out, in] weight in column-major memory order: same
    shape, same values, but `F.linear` then hands MKL a row-major [in, out] matrix, which its small-batch
    sgemm runs faster. Measured on SmolLM2 (2-core AVX-512 Xeon, weights streamed from memory as in a
    step): all projections + LM head at batch 32, 1 thread 181 -> 135-146 ms, 2 threads 58 -> 54 ms;
    batch 1 and 512-token prefill unchanged. A tied embedding's lookups then read strided rows (negligible)."""
    matmul_weights: list[torch.nn.Module] = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model.lm_head is None and isinstance(model.embed_tokens, torch.nn.Embedding):  # tied: the table is the head
        matmul_weights.append(model.embed_tokens)
    for module in matmul_weights:
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        module.weight = torch.nn.Parameter(weight.t().contiguous().t(), requires_grad=False)


# ----------------------------------------------------------------------------------------------- weights


def _load_weights(
    model: LlamaForCausalLM,
    tensors: Checkpoint,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool,
    desc: str,
    formats: dict[str, BlockFormat],
) -> None:
    """Copy checkpoint tensors (Hugging Face names) into the fused model; fail on anything missing or extra.
    Q, K and V (gate and up) go straight into their rows of the fused weight, so none is held back for a concat."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    params |= {name.removesuffix(".qweight") + ".weight": buffer for name, buffer in model.named_buffers()
               if name.endswith(".qweight")}  # block-format weights: their buffers take the checkpoint's blocks
    loaded: set[str] = set()
    q_rows, kv_rows, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    rows_of = {"q_proj": (0, q_rows), "k_proj": (q_rows, kv_rows), "v_proj": (q_rows + kv_rows, kv_rows),
               "gate_proj": (0, inter), "up_proj": (inter, inter)}  # a part's (first row, rows) in its fused weight
    shared = config.shared_expert_intermediate_size  # a shared expert's gate|up are of its own size
    shared_rows = {"gate_proj": (0, shared), "up_proj": (shared, shared)}
    per_layer = 9 + 3 * config.qkv_bias + config.o_bias + 2 * config.qk_norm + 2 * config.sandwich_norms
    total = 2 + (0 if config.tie_word_embeddings else 1) + per_layer * config.num_layers
    for hf_name, tensor in tqdm(tensors, total=total, desc=desc, unit="tensor", disable=not progress):
        name = _MIXTRAL_NAMES.sub(lambda m: _MIXTRAL_PARTS[m.group(0)], hf_name.removeprefix("model."))
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        prefix, proj, tail = _split(name)
        if tail == "bias" and proj in _BIASES:  # beside the projection: self_attn.qkv_bias, self_attn.o_bias
            key = f"{prefix}.{_BIASES[proj]}"
            rows = rows_of.get(proj)
        else:
            key = target_of(name)
            rows = None if key == name else (shared_rows if prefix.endswith(".shared_expert") else rows_of)[proj]
        _copy(params, key, tensor, device, dtype, formats.get(key), rows=rows, what=name)
        loaded.add(name)
    expected: dict[str, str] = {}  # checkpoint name -> how a missing one is named
    for name in params:
        prefix, proj, tail = _split(name)
        parts = [f"{prefix}.{part}.{tail}" for part, whole in FUSED_INTO.items() if whole == proj]
        if tail in _BIASES.values():
            parts = [f"{prefix}.{proj}.{part}.bias" for part, whole in _BIASES.items() if whole == tail]
        expected |= {part: f"{part} (of {name})" for part in parts} if parts else {name: name}
    missing = sorted(shown for name, shown in expected.items() if name not in loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


# Mixtral's checkpoint names for its sparse MLP -> Qwen3-MoE's (and the model's): the router and each expert's parts
_MIXTRAL_PARTS = {"block_sparse_moe.": "mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
_MIXTRAL_NAMES = re.compile("|".join(re.escape(k) for k in _MIXTRAL_PARTS))

# a projection's bias in the checkpoint -> the parameter beside the projection that holds it (model.Attention)
_BIASES = {"q_proj": "qkv_bias", "k_proj": "qkv_bias", "v_proj": "qkv_bias", "o_proj": "o_bias"}


# families whose RMSNorms scale by 1 + weight (Gemma's), where the model's scale by the weight: their checkpoints'
# norm weights get 1 added as they load. In fp32 that is the same number Gemma's norm computes (1.0 + w in fp32) and
# the same product; in a 16-bit dtype the sum is rounded to it, as llama.cpp's converter rounds it for a 16-bit file.
# llama.cpp's converter adds the 1 itself (its `norm_shift`), so GGUF norms load as they are.
_NORMS_PLUS_ONE = ("gemma2", "gemma3_text")


def _norms_plus_one(tensors: Checkpoint) -> Iterator[tuple[str, Any]]:
    for name, tensor in tensors:
        if name.endswith("norm.weight"):  # the layers' four norms, q_norm and k_norm, and the final norm
            assert isinstance(tensor, torch.Tensor)
            tensor = tensor.float() + 1.0
        yield name, tensor


def _split(name: str) -> tuple[str, str, str]:
    """`layers.3.self_attn.q_proj.bias` -> ("layers.3.self_attn", "q_proj", "bias")."""
    head, _, tail = name.rpartition(".")
    prefix, _, proj = head.rpartition(".")
    return prefix, proj, tail


def _copy(params: dict[str, torch.Tensor], name: str, tensor: torch.Tensor | BlockTensor, device: torch.device,
          dtype: torch.dtype, fmt: BlockFormat | None = None, rows: tuple[int, int] | None = None,
          what: str | None = None) -> None:
    """`tensor` into the weight `name`, or into its `rows` (first row, count) for one part of a fused weight; a
    weight kept in block format `fmt` takes the tensor's blocks, converted when the checkpoint stores others."""
    if name not in params:
        raise ValueError(f"checkpoint has an unexpected weight {what or name!r}")
    param = params[name] if rows is None else params[name].narrow(0, *rows)
    shape = tuple(tensor.shape)
    fits = shape == tuple(param.shape) if fmt is None else (
        shape[0] == param.shape[0] and fmt.packed_row_bytes(shape[1]) == param.shape[1])
    if not fits:
        expected = tuple(param.shape) if fmt is None else f"{param.shape[0]} {fmt.name} rows of {param.shape[1]} bytes"
        raise ValueError(f"weight {what or name!r} has shape {shape}, model expects {expected}")
    if fmt is not None:
        source = torch.from_numpy(as_blocks(tensor, fmt))
    else:
        assert isinstance(tensor, torch.Tensor), "blocks are only kept for a weight that takes them"
        source = tensor
    with torch.no_grad():
        param.copy_(source.to(device=device, dtype=param.dtype))


# checkpoints that store a projection fused (Phi-3): its parts, in order, and their share of the rows
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _part_names(name: str) -> list[str]:
    """A fused checkpoint weight's part names (`layers.0.self_attn.qkv_proj.weight` -> its q, k and v), else the
    name itself."""
    prefix, proj, tail = _split(name)
    return [f"{prefix}.{part}.{tail}" for part in _FUSED_PARTS[proj]] if proj in _FUSED_PARTS else [name]


def _checkpoint_names(tensor: Any, config: ModelConfig) -> list[str]:
    """The checkpoint weights (Hugging Face names) a GGUF tensor holds: a fused one's parts, a stack's experts."""
    name = _hf_name(tensor.name, config.family)
    if len(tensor.shape) == 3:
        return [_expert_name(name, expert) for expert in range(int(tensor.shape[2]))]
    return _part_names(name)


def _expert_name(stacked: str, expert: int) -> str:
    """One expert's weight in a stack of them (`layers.0.mlp.experts.gate_proj.weight`, 3 ->
    `layers.0.mlp.experts.3.gate_proj.weight`)."""
    prefix, proj, tail = _split(stacked)
    return f"{prefix}.{expert}.{proj}.{tail}"


def _unfused(tensors: Checkpoint, config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """The checkpoint with each fused weight as its parts (rows of a float tensor or of a block tensor), so that the
    loader sees one layout whatever the file's: a part goes back into its rows of the model's fused weight."""
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    rows = {"qkv_proj": (q, kv, kv), "gate_up_proj": (inter, inter)}
    for name, tensor in tensors:
        parts = _part_names(name)
        if len(parts) == 1:
            yield name, tensor
            continue
        sizes = rows[_split(name)[1]]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"weight {name!r} has {tensor.shape[0]} rows, the model expects {sum(sizes)}")
        start = 0
        for part, size in zip(parts, sizes, strict=True):
            if isinstance(tensor, BlockTensor):
                yield part, BlockTensor(tensor.blocks[start:start + size], tensor.ggml_type, tensor.in_features)
            else:
                yield part, tensor[start:start + size]
            start += size


def _from_numpy(array: np.ndarray) -> torch.Tensor:
    """A tensor over `array`, which may be a read-only view of the memory map: the loader only copies from it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _hf_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, handle.get_tensor(key)


# ----------------------------------------------------------------------------------------------- GGUF


_GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj",
    # a mixture: the router, the experts (stacked: `_gguf_tensors` yields each expert's slice), a shared expert and
    # its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 3's sandwich norms, as llama.cpp names them (its `ffn_norm` is the MLP's input norm, as Llama's is)
_GGUF_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# llama.cpp's converter permutes Q and K rows for its interleaved RoPE in these families only (Mixtral is its Llama;
# Qwen's is the rotate-halves RoPE Hugging Face uses, and its converter leaves the rows as they are)
_PERMUTED_QK = ("llama", "mistral", "mixtral")


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's converter permutation of Q/K rows (interleaved-pair RoPE -> rotate-halves)."""
    out_dim = weight.shape[0]
    return (
        weight.reshape(num_heads, out_dim // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _hf_name(gguf_name: str, family: str = "llama") -> str:
    """A GGUF tensor's Hugging Face name (`blk.3.attn_q.weight` -> `layers.3.self_attn.q_proj.weight`); Phi-3's
    `ffn_up` is its fused gate|up, Gemma's `ffn_norm` the norm before its MLP (`pre_feedforward_layernorm`)."""
    if family == "phi3" and re.fullmatch(r"blk\.\d+\.ffn_up\.weight", gguf_name):
        return gguf_name.replace("blk.", "layers.").replace("ffn_up", "mlp.gate_up_proj")
    if family in GEMMAS and (match := re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)) \
            and match.group(2) in _GGUF_GEMMA_NORMS:
        return f"layers.{match.group(1)}.{_GGUF_GEMMA_NORMS[match.group(2)]}.weight"
    if gguf_name in _GGUF_NAMES:
        return _GGUF_NAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        raise ValueError("GGUF rope_freqs (Llama 3.1 rope scaling) is not supported yet")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}.{match.group(3)}"


def _float_values(data: np.ndarray, tensor_type: int) -> np.ndarray:
    """A GGUF tensor's values (or one expert's slice of them) as fp32: F32 ones as they are (a view of the memory
    map), F16 converted, BF16 and quantized ones through gguf-py (imported only then: a replica that keeps every
    quantized tensor's blocks never loads it)."""
    if tensor_type in (0, 1):  # F32, F16
        return data.astype(np.float32, copy=False)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(data, GGMLQuantizationType(tensor_type)), dtype=np.float32)


def _gguf_tensors(reader: Any, config: ModelConfig,
                  keep_blocks: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, tensor) for each GGUF tensor: dequantized to fp32, or, where `keep_blocks(name)`, its
    blocks as the file stores them (`BlockTensor`, a view of the memory map). Q and K rows are un-permuted; a
    mixture's stacked experts come out one expert at a time (`layers.N.mlp.experts.E.gate_proj.weight`), each
    expert's slice kept in blocks or dequantized as `keep_blocks` says of that expert's name."""
    for tensor in reader.tensors:
        if tensor.name in ROPE_FACTOR_TENSORS:  # longrope's factors: read into the config (`read_gguf`)
            continue
        name = _hf_name(tensor.name, config.family)
        kind = name.rsplit(".", 2)[-2]
        if len(tensor.shape) == 3:  # [n_expert, rows, cols] in numpy's order, the converter's stack of the experts
            if tensor.data.shape[0] != config.num_experts:
                raise ValueError(f"GGUF tensor {tensor.name!r} stacks {tensor.data.shape[0]} experts, the model has "
                                 f"{config.num_experts}")
            for expert, data in enumerate(tensor.data):  # each a view of the memory map until it is copied
                expert_name = _expert_name(name, expert)
                if keep_blocks(expert_name):
                    yield expert_name, BlockTensor(data, int(tensor.tensor_type), int(tensor.shape[0]))
                else:
                    yield expert_name, _from_numpy(_float_values(data, int(tensor.tensor_type)))
            continue
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(kind) \
            if config.family in _PERMUTED_QK else None
        if keep_blocks(name):
            blocks = tensor.data if heads is None else unpermute_qk(tensor.data, heads)
            yield name, BlockTensor(blocks, int(tensor.tensor_type), int(tensor.shape[0]))
            continue
        array = _float_values(tensor.data, int(tensor.tensor_type))
        if heads is not None:
            array = unpermute_qk(array, heads)
        if kind == "shared_expert_gate":  # [1, hidden] as transformers holds it, whether the file kept the 1 or not
            array = array.reshape(1, -1)
        yield name, _from_numpy(array)  # F32 tensors come back as read-only views of the memory map
