"""Which weights a model keeps in a block format, and getting them there.

`engine.weights` chooses per model: `fp32`, `bf16`, `fp16` run every weight in that dtype (GGUF blocks are
dequantized at load); `q8` and `q4` keep the projections, the embedding table and the LM head in Q8_0 / a 4-bit
format on the CPU kernel; `auto` keeps what a GGUF file has where the kernel computes on it as it is (Q8_0, Q4_0,
Q4_1), requantizes its other quantized types (K-quants, Q5_*) to Q8_0, and leaves floating-point tensors (and a
Hugging Face checkpoint) in floating point. On CUDA `auto` means bf16, and `q8` / `q4` run on the Triton kernel
(`triton_matmul.py`), which dequantizes the same blocks inside the matmul.
Norms stay in floating point whatever the choice.

The loader decides each weight's format before it allocates anything (`block_formats`), swaps the model's modules
for block-format ones holding empty buffers of the final size (`swap_modules`), then copies each checkpoint tensor
into its buffer, converted on the way when its own format differs (`as_blocks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import get_args

import numpy as np
import torch
from torch import nn

from registry.engine import EngineOptions
from runtimes.llm.quant.cpu import QuantEmbedding, QuantLinear
from runtimes.llm.quant.formats import BLOCK, Q4_0, Q4_1, Q8_0, BlockFormat, format_of, pack, quantize

WEIGHT_CHOICES: tuple[str, ...] = get_args(EngineOptions.model_fields["weights"].annotation)  # engine.weights
FLOAT_WEIGHTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BLOCK_WEIGHTS = ("q8", "q4")  # always in a block format, on any device
BLOCK_DEVICES = ("cpu", "cuda")  # where the block formats have a kernel
_GGML_FLOAT_TYPES = {0, 1, 30}  # F32, F16, BF16
# a checkpoint's projection -> the model's fused projection that holds it
FUSED_INTO = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj"}
_ATTENTION_WEIGHTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")  # an MLP's checkpoint weights (a dense one's, an expert's)


@dataclass(frozen=True)
class BlockTensor:
    """A checkpoint weight as its file stores it: `[N, bytes per row]` in GGML type `ggml_type` (a view of the
    memory-mapped file until it is copied), `in_features` values per row."""

    blocks: np.ndarray
    ggml_type: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.blocks.shape[0]), self.in_features


def check_weights(weights: str, device: torch.device) -> None:
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {weights!r}")
    if weights in BLOCK_WEIGHTS and device.type not in BLOCK_DEVICES:
        raise ValueError(f"weights {weights!r} have kernels on the CPU and CUDA only; on {device.type} use bf16, fp16 "
                         f"or fp32")


def weight_format(weights: str, ggml_type: int | None) -> BlockFormat | None:
    """The block format one weight is kept in under `weights`, given the GGML type its file stores it in (None: a
    floating-point checkpoint tensor); None keeps it in floating point."""
    native = None if ggml_type is None else format_of(ggml_type)
    if weights == "q8":
        return Q8_0
    if weights == "q4":
        return native if native in (Q4_0, Q4_1) else Q4_1
    if weights == "auto" and ggml_type is not None and ggml_type not in _GGML_FLOAT_TYPES:
        return native or Q8_0
    return None


def block_formats(weights: str, device: torch.device, num_layers: int, tied: bool,
                  source_types: Mapping[str, int | None], num_experts: int = 0,
                  shared_expert: bool = False) -> dict[str, BlockFormat]:
    """The model's weights (its own names) kept in a block format, and which. `source_types`: each checkpoint weight
    (Hugging Face names; a GGUF file's stacked experts one name per expert) -> its GGML type, None for floating
    point. A fused weight whose parts would differ takes Q8_0, which holds any of them. In a mixture of experts
    (`num_experts`), each expert's projections and the `shared_expert`'s are the layer's MLP weights: they are most
    of the model, so they go where the dense MLP's would; the router and the shared expert's gate (one row) stay in
    floating point."""
    if weights in FLOAT_WEIGHTS or (weights == "auto" and device.type != "cpu"):  # auto on CUDA: bf16
        return {}

    names = ["embed_tokens.weight", *([] if tied else ["lm_head.weight"])]
    layer_weights = [*_ATTENTION_WEIGHTS, *mlp_weights(num_experts, shared_expert)]
    names += [f"layers.{i}.{weight}.weight" for i in range(num_layers) for weight in layer_weights]
    kinds: dict[str, set[BlockFormat | None]] = {}
    for hf_name in names:
        kinds.setdefault(target_of(hf_name), set()).add(weight_format(weights, source_types.get(hf_name)))
    chosen = {name: found.pop() if len(found) == 1 else Q8_0 for name, found in kinds.items()}
    return {name: f for name, f in chosen.items() if f is not None}


def mlp_weights(num_experts: int = 0, shared_expert: bool = False) -> list[str]:
    """A layer's MLP weights that a block format may hold (checkpoint names under the layer): the dense MLP's, or a
    mixture's experts' and its shared expert's."""
    if not num_experts:
        return [f"mlp.{part}" for part in _MLP_PARTS]
    mlps = [f"mlp.experts.{e}" for e in range(num_experts)] + (["mlp.shared_expert"] if shared_expert else [])
    return [f"{mlp}.{part}" for mlp in mlps for part in _MLP_PARTS]


def target_of(hf_name: str) -> str:
    """The model weight a checkpoint weight goes into (a part of a fused projection goes into the fused one)."""
    head, _, tail = hf_name.rpartition(".")  # tail: "weight"
    prefix, _, proj = head.rpartition(".")
    return f"{prefix}.{FUSED_INTO[proj]}.{tail}" if proj in FUSED_INTO else hf_name


def swap_modules(model: nn.Module, formats: Mapping[str, BlockFormat]) -> None:
    """Replace each module whose weight `formats` names by its block-format twin, its buffer empty on the model's
    (meta) device: `to_empty` then allocates it at its final size, and the loader fills it."""
    for name, fmt in formats.items():
        path = name.removesuffix(".weight")
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr)
        width = old.embedding_dim if isinstance(old, nn.Embedding) else getattr(old, "in_features", BLOCK)
        if width % BLOCK:  # the blocks hold 32 values each: say so before loading, naming the weight
            raise ValueError(f"{name}: a block format needs rows a multiple of {BLOCK} wide, this one is {width} "
                             f"(engine.weights: a floating-point choice keeps it)")
        if isinstance(old, nn.Embedding):
            rows, width = old.num_embeddings, old.embedding_dim
            new: nn.Module = QuantEmbedding(rows, width, fmt, _empty_blocks(rows, width, fmt, old.weight.device))
        elif isinstance(old, nn.Linear):
            rows, width = old.out_features, old.in_features
            new = QuantLinear(width, rows, fmt, _empty_blocks(rows, width, fmt, old.weight.device))
        else:
            raise TypeError(f"{name}: cannot keep a {type(old).__name__}'s weight in a block format")
        setattr(parent, attr, new)


def _empty_blocks(rows: int, width: int, fmt: BlockFormat, device: torch.device) -> torch.Tensor:
    return torch.empty(rows, fmt.packed_row_bytes(width), dtype=torch.uint8, device=device)


def as_blocks(tensor: BlockTensor | torch.Tensor, fmt: BlockFormat) -> np.ndarray:
    """A checkpoint weight as the kernel's packed rows of `fmt`: its own blocks repacked when it is stored in `fmt`,
    else dequantized (if it is quantized) and quantized to `fmt`."""
    if isinstance(tensor, BlockTensor):
        if tensor.ggml_type == fmt.ggml_id:
            return pack(tensor.blocks, fmt)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(tensor.blocks, GGMLQuantizationType(tensor.ggml_type))
        return quantize(np.asarray(values, dtype=np.float32).reshape(tensor.shape), fmt)
    return quantize(tensor.detach().float().cpu().numpy(), fmt)
