"""The fused operations of a decoder layer: RMSNorm with the residual add, RoPE in place, SiLU times up (and, on
the CPU, the KV-cache write). For fp32 on the CPU they are C++ (`cpu_fused.cpp`, compiled on first use like the
other CPU kernels: `applies`); on CUDA they are Triton (`triton_fused.py`: `cuda_ops`). The model takes its
PyTorch reference path everywhere else (other CPU dtypes, no compiler, no Triton)."""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog
import torch

from runtimes.cpu_extension import try_build
from runtimes.llm.attention.cpu_paged import KERNEL_CACHE_DTYPES

_SOURCE = Path(__file__).with_name("cpu_fused.cpp")
log = structlog.get_logger(__name__)


@functools.cache
def available() -> bool:
    """Build (or reuse the cached build of) the fused operations; False, logged, when they cannot be built."""
    return try_build("multiserve_cpu_fused", _SOURCE, ["-march=native", "-ffp-contract=off"])


def applies(x: torch.Tensor) -> bool:
    """Whether the fused operations take `x`: fp32 on the CPU (the reference path takes everything else)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and available()


def writes_kv(key: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `write_kv_` takes these keys (fp32 on the CPU) into this cache (fp32 or fp16)."""
    return applies(key) and k_cache.dtype in KERNEL_CACHE_DTYPES


def ops_for(x: torch.Tensor) -> Any:
    """The fused operations that take `x` (`rms_norm`, `add_rms_norm`, `rotary_`, `silu_mul`, the same signatures in
    both): the C++ ones for fp32 on the CPU, the Triton ones on CUDA; None: the model's reference path."""
    return torch.ops.multiserve_fused if applies(x) else cuda_ops(x)


def cuda_ops(x: torch.Tensor) -> ModuleType | None:
    """The Triton operations (`runtimes.llm.triton_fused`) for a CUDA tensor, None otherwise."""
    return _triton_fused() if x.device.type == "cuda" else None


@functools.cache
def _triton_fused() -> ModuleType | None:
    try:
        from runtimes.llm import triton_fused
    except ImportError as exc:  # no Triton: the reference path
        log.warning("triton_fused_unavailable", error=repr(exc))
        return None
    return triton_fused
