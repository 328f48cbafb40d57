"""Engine limits (and, re-exported, the model shape of model_config.py). Immutable after construction; derived numbers
live here as properties."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from policies.admission import AdmissionLimits
from policies.classify import LaneThresholds
from policies.multilevel import MultiLevelConfig
from registry.engine import KV_CACHE_MEMORY_FRACTION, EngineOptions, QueueOptions, kv_cache_budget
from runtimes.cuda_memory import default_kv_bytes
from runtimes.llm.model_config import ModelConfig as ModelConfig  # re-exported: the runtime's one config import
from runtimes.llm.model_config import RopeScaling as RopeScaling
from runtimes.llm.quant.weights import FLOAT_WEIGHTS

KV_DTYPES = {**FLOAT_WEIGHTS, "fp8": torch.float8_e4m3fn}  # `kv_dtype` names besides auto


class EngineConfig(EngineOptions, QueueOptions):
    """Limits of one engine instance (one replica): the registry's engine options and the engine's side of a model's
    policy, whose names, types, bounds, defaults and rules are defined once in registry/engine.py, and what only the
    runtime sets. Validated at construction (a pydantic ValidationError, a ValueError, names the field and the limit).

    `kv_cache_bytes` sizes the KV block pool; when None, `kv_cache_budget` says what does.
    """

    kv_cache_bytes: int | None = Field(default=None, gt=0)
    kv_cache_memory_fraction: float = Field(default=KV_CACHE_MEMORY_FRACTION, gt=0, le=1)
    device: str = "auto"  # auto | cpu | cuda[:N]
    # auto: bf16 on CUDA, fp32 on CPU; `weights` fp32/bf16/fp16 set it when it is auto (`resolve_dtype`)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = "auto"
    seed: int = 0

    @classmethod
    def of(cls, engine: EngineOptions, queue: QueueOptions, **runtime: Any) -> EngineConfig:
        """The config of an engine whose options and queue the registry validated already: those are taken as they
        are, and only the runtime's own fields (`runtime`: kv_cache_bytes, device, ...) are checked here."""
        validated = {name: getattr(options, name) for options, kind in ((engine, EngineOptions), (queue, QueueOptions))
                     for name in kind.model_fields}
        return cls(**runtime).model_copy(update=validated)

    def lane_thresholds(self) -> LaneThresholds:
        return LaneThresholds(**self.lanes)

    def admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_queue_len, self.max_queue_wait_s)

    def multilevel_config(self) -> MultiLevelConfig:
        """The multi-level policy's config (its options were checked with the config's)."""
        options: dict[str, Any] = self.multilevel
        return MultiLevelConfig(**options)

    def kv_cache_budget(self, device: torch.device) -> int:
        """The KV cache's bytes on `device`, once the weights are loaded (`registry.engine.kv_cache_budget`):
        `kv_cache_bytes`; else, on CUDA, `kv_cache_memory_fraction` of what this process may still take there (the
        device's free memory, or what is left under its cap); else 1 GiB."""
        return kv_cache_budget(self.kv_cache_bytes, device=device.type, memory_fraction=self.kv_cache_memory_fraction,
                               free_bytes=lambda: default_kv_bytes(device, 1.0))

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
