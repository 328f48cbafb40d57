"""A model's `engine:` section: what kind of engine its replicas run and within which limits. Two kinds, chosen by the
model's `type`: chat and completion models run the paged-KV LLM engine (`EngineSpec`), embedding models the encoder
engine (`EmbeddingEngineSpec`), which keeps no KV cache and so takes none of the KV options. The worker builds its
runtime config from these as they are (registry/launch.py carries them to it): they are validated here, once.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from registry.errors import FieldProblems, Problem, pydantic_problems
from registry.fields import (
    MAX_BLOCK_SIZE,
    MAX_GIB,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MAX_REQUEST_TOKENS,
    Frozen,
)


class EngineSpec(Frozen):
    """The LLM engine's limits (runtimes/llm/config.py's EngineConfig)."""

    block_size: int = Field(default=16, ge=1, le=MAX_BLOCK_SIZE, strict=True)
    max_num_seqs: int = Field(default=64, ge=1, le=MAX_NUM_SEQS, strict=True)
    # None: the model's own context length
    max_model_len: int | None = Field(default=None, ge=1, le=MAX_MODEL_LEN, strict=True)
    max_num_batched_tokens: int = Field(default=512, ge=1, le=MAX_NUM_BATCHED_TOKENS, strict=True)
    # None: the partitioner's plan sizes it (a GPU), else the engine (1 GiB on a CPU)
    kv_cache_gib: float | None = Field(default=None, gt=0, le=MAX_GIB)
    enable_prefix_caching: bool = True
    # how the weights are held: auto keeps a GGUF's own quantization on the CPU (bf16 on CUDA); q8 and q4 quantize
    # to 8 or 4 bits (CPU or CUDA); fp32, bf16, fp16 dequantize (runtimes/llm/quant/weights.py)
    weights: Literal["auto", "fp32", "bf16", "fp16", "q8", "q4"] = "auto"
    # the KV cache's dtype: auto is the model's; fp16 on the CPU halves the cache's memory and the bytes its
    # attention reads; on CUDA the cache is the model's dtype or fp8 (e4m3: half of bf16's bytes, CUDA only)
    kv_dtype: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    # CUDA: decode steps replay graphs captured per batch-size bucket at start-up; false runs every step eagerly
    # (vLLM's enforce_eager). Nothing on the CPU
    cuda_graphs: bool = True
    # CUDA, with cuda_graphs: greedy decode steps launched before the previous step's tokens are read back, so the
    # host's scheduling and detokenizing overlap the device's step (never under a time-slice share)
    overlap_steps: bool = True
    # every kernel computes a row the same way whatever else is in the batch, so a greedy or seeded request gives the
    # same tokens alone or among others (runtimes/llm/batch_invariant.py). The CPU's block-weight kernels are so
    # already; on CUDA it changes the attention and dense-matmul kernels (slower); a replica whose weights or
    # attention backend have no such kernel fails to start, naming this field
    deterministic: bool = False

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):  # the range is the field's
            raise ValueError(f"must be a power of two, got {value}")
        return value


class EmbeddingEngineSpec(Frozen):
    """The encoder engine's limits (runtimes/embedding/config.py's EmbeddingConfig); None: the engine's default."""

    max_num_seqs: int | None = Field(default=None, ge=1, le=MAX_NUM_SEQS, strict=True)  # inputs in one batch
    max_model_len: int | None = Field(default=None, ge=1, le=MAX_MODEL_LEN, strict=True)  # below the model's own
    batch_window_s: float | None = Field(default=None, ge=0, le=1.0)  # how long a lone input waits for company
    # padded tokens of one chunk of work; requests take turns between chunks
    max_batch_tokens: int | None = Field(default=None, ge=1, le=MAX_NUM_BATCHED_TOKENS, strict=True)
    # one request's inputs' tokens, summed; more is refused with a 400 naming `input`
    max_request_tokens: int | None = Field(default=None, ge=1, le=MAX_REQUEST_TOKENS, strict=True)


_KV_ONLY = frozenset(EngineSpec.model_fields) - frozenset(EmbeddingEngineSpec.model_fields)


def engine_for_type(model_type: str, value: Any) -> EngineSpec | EmbeddingEngineSpec:
    """The `engine:` section of a model of `model_type`, validated as its kind; raises FieldProblems naming each
    field at fault (`block_size: not used by embedding models ...`)."""
    kind: type[EngineSpec] | type[EmbeddingEngineSpec]
    kind = EmbeddingEngineSpec if model_type == "embedding" else EngineSpec
    if isinstance(value, kind):  # validated already (a launch built from a registry entry)
        return value
    if isinstance(value, (EngineSpec, EmbeddingEngineSpec)):
        value = value.model_dump(exclude_unset=True)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise FieldProblems([Problem("", f"must be a mapping of engine options, got {type(value).__name__}")])
    if kind is EmbeddingEngineSpec:
        unused = sorted(set(value) & _KV_ONLY)
        if unused:
            why = "not used by embedding models (an encoder keeps no KV cache and runs no decode steps)"
            raise FieldProblems([Problem(name, why) for name in unused])
    try:
        return kind.model_validate(value)
    except ValidationError as exc:
        raise FieldProblems(pydantic_problems(exc, sorted(kind.model_fields))) from None
