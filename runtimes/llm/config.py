"""Engine limits (and, re-exported, the model shape of model_config.py). Immutable after construction; derived numbers
live here as properties."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from policies.admission import AdmissionLimits
from policies.classify import LaneThresholds
from policies.multilevel import MultiLevelConfig
from runtimes.llm.model_config import ModelConfig as ModelConfig  # re-exported: the runtime's one config import
from runtimes.llm.model_config import RopeScaling as RopeScaling
from runtimes.llm.quant.weights import FLOAT_WEIGHTS, WEIGHT_CHOICES

KV_DTYPES = {**FLOAT_WEIGHTS, "fp8": torch.float8_e4m3fn}  # `kv_dtype` names besides auto


@dataclass(frozen=True)
class EngineConfig:
    """Limits of one engine instance (one replica). Validated at construction.

    `kv_cache_bytes` sizes the KV block pool; when None, `kv_cache_memory_fraction` of the device's free
    memory (CUDA) or a 1 GiB default (CPU) is used.
    """

    block_size: int = 16
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int = 512
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.5
    enable_prefix_caching: bool = True
    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: bf16 on CUDA, fp32 on CPU)
    # auto | fp32 | bf16 | fp16 | q8 | q4: how the weights are held (runtimes/llm/quant/weights.py); auto keeps a
    # GGUF's own quantization on the CPU and is `dtype` on CUDA; fp32/bf16/fp16 set `dtype` when it is auto
    weights: str = "auto"
    # auto | fp32 | bf16 | fp16 | fp8: the KV cache's dtype; auto is the model's. On the CPU an fp16 cache halves the
    # bytes the decode attention reads (its kernel widens them to fp32); on CUDA the cache is the model's dtype or fp8
    # (e4m3, no scale: half of bf16's bytes and twice the tokens)
    kv_dtype: str = "auto"
    attention_backend: str = "auto"  # auto | torch | cpu | triton
    # CUDA: decode steps replay graphs captured per batch-size bucket at start-up (runtimes/llm/cuda_graphs.py);
    # False runs every step eagerly (vLLM's enforce_eager). Nothing on the CPU.
    cuda_graphs: bool = True
    # With the graphs: a decode step whose plan is certain (every running request takes its argmax, nothing waits)
    # is launched before the previous step's tokens are read back, so the host's work overlaps the device's
    overlap_steps: bool = True
    # Batch invariance forced where it is not by construction (Triton attention and dense matmuls), refused where no
    # kernel gives it (runtimes/llm/batch_invariant.py)
    deterministic: bool = False
    scheduling: str = "fcfs"  # fcfs | multilevel (policies/multilevel.py): the waiting-queue order
    # MultiLevelConfig fields (aging_s, normal_min_share, long_prompt_tokens, max_long_running, ...)
    multilevel: Mapping[str, Any] = field(default_factory=dict)
    # policies.classify.LaneThresholds fields: how the replica's server tells a request's lane by its length
    lanes: Mapping[str, int] = field(default_factory=dict)
    max_queue_len: int | None = None  # waiting requests; more are refused (429). None: unbounded
    max_queue_wait_s: float | None = None  # a request not started after this long is refused (429)
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two, got {self.block_size}"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"),
            (self.max_model_len is None or self.max_model_len >= 1,
             f"max_model_len must be >= 1, got {self.max_model_len}"),
            (self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
             f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}"),
            (0 < self.kv_cache_memory_fraction <= 1,
             f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"),
            (self.dtype in ("auto", "float32", "float16", "bfloat16"), f"unknown dtype {self.dtype!r}"),
            (self.weights in WEIGHT_CHOICES,
             f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {self.weights!r}"),
            (self.kv_dtype == "auto" or self.kv_dtype in KV_DTYPES,
             f"kv_dtype must be one of auto, {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}"),
            (self.attention_backend in ("auto", "torch", "cpu", "triton"),
             f"unknown attention_backend {self.attention_backend!r}"),
            (self.scheduling in ("fcfs", "multilevel"),
             f"scheduling must be 'fcfs' or 'multilevel', got {self.scheduling!r}"),
            (self.scheduling == "multilevel" or not self.multilevel,
             f"multilevel options are only used with scheduling 'multilevel' (scheduling is {self.scheduling!r})"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.admission_limits()  # its own range checks
        if self.multilevel:
            self.multilevel_config()
        self.lane_thresholds()

    def lane_thresholds(self) -> LaneThresholds:
        return _build_options(LaneThresholds, self.lanes, "lanes")

    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_queue_len, self.max_queue_wait_s)

    def multilevel_config(self) -> MultiLevelConfig:
        """The multi-level policy's config; unknown option names are refused by name."""
        return _build_options(MultiLevelConfig, self.multilevel, "multilevel")

    def resolve_device(self) -> torch.device:
        """`device`; auto is CUDA when there is one."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the model's floating-point weights, activations and KV cache (on the CPU, block-format
        weights compute in fp32 activations; on CUDA in this dtype)."""
        if self.dtype == "auto":
            named = FLOAT_WEIGHTS.get(self.weights)
            if named is not None:
                return named
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for `EngineConfig.kv_dtype` (auto: the model's). On CUDA the cache is the model's dtype
    or fp8 (e4m3, which the Triton attention widens as it loads it: half the bytes of bf16); on the CPU any float
    type but fp8, which no CPU kernel reads. Another is refused by name."""
    chosen = model_dtype if kv_dtype == "auto" else KV_DTYPES[kv_dtype]
    if device.type == "cuda" and chosen not in (model_dtype, torch.float8_e4m3fn):
        raise ValueError(f"kv_dtype {kv_dtype!r} on CUDA: the cache must be in the model's dtype ({model_dtype}) or "
                         f"fp8; use auto or fp8")
    if device.type != "cuda" and chosen == torch.float8_e4m3fn:
        raise ValueError(f"kv_dtype 'fp8' on {device.type}: only the CUDA attention reads an fp8 cache; use fp16 "
                         f"(half of fp32's bytes) or auto")
    return chosen


def _build_options(options_type: Any, options: Mapping[str, Any], what: str) -> Any:
    """`options_type(**options)`, refusing unknown option names by name."""
    known = {f.name for f in dataclasses.fields(options_type)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown {what} option(s) {unknown}; known: {sorted(known)}")
    return options_type(**options)
