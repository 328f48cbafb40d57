"""The fused operations of a decoder layer: RMSNorm with the residual add, RoPE in place, SiLU times up, and the
KV-cache write (`kv_writer`). For fp32 on the CPU they are C++ (`cpu_fused.cpp`, compiled on first use like the other
CPU kernels: `applies`); on CUDA they are Triton (`triton_fused.py`: `cuda_ops`; the KV write: one launch for keys and
values). The model takes its PyTorch reference path everywhere else (other CPU dtypes, no compiler, no Triton)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog
import torch

from runtimes.cpu_extension import try_build
from runtimes.llm.attention.cpu_paged import KERNEL_CACHE_DTYPES
from runtimes.llm.attention.reference import FP8_KV, write_kv

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


def kv_writer(key: torch.Tensor, k_cache: torch.Tensor) -> Callable[..., None]:
    """What writes a step's keys and values into this cache, `(key, value, k_cache, v_cache, slot_mapping)`: the C++
    `write_kv_` (fp32 on the CPU), the Triton kernel on CUDA (one launch for both; not into an fp8 cache, whose
    rounding the reference's torch cast defines), else the reference's two index copies."""
    if writes_kv(key, k_cache):
        return _cpp_write_kv
    head_dim = key.shape[-1]
    if key.device.type == "cuda" and k_cache.dtype != FP8_KV and head_dim & (head_dim - 1) == 0 and (
            (triton_paged := _triton("attention.triton_paged")) is not None):
        return triton_paged.write_kv_triton
    return write_kv


def _cpp_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    torch.ops.multiserve_fused.write_kv_(k_cache, v_cache, key, value, slot_mapping)


def ops_for(x: torch.Tensor) -> Any:
    """The fused operations that take `x` (`rms_norm`, `add_rms_norm`, `rotary_`, `silu_mul`, the same signatures in
    both): the C++ ones for fp32 on the CPU, the Triton ones on CUDA; None: the model's reference path."""
    return torch.ops.multiserve_fused if applies(x) else cuda_ops(x)


def cuda_ops(x: torch.Tensor) -> ModuleType | None:
    """The Triton operations (`runtimes.llm.triton_fused`) for a CUDA tensor, None otherwise."""
    return _triton("triton_fused") if x.device.type == "cuda" else None


def cuda_experts(x: torch.Tensor) -> ModuleType | None:
    """The grouped-GEMM experts (`runtimes.llm.triton_experts`) for a CUDA tensor, None otherwise."""
    return _triton("triton_experts") if x.device.type == "cuda" else None


@functools.cache
def _triton(module: str) -> ModuleType | None:
    """`runtimes.llm.<module>`, a module of Triton kernels; None (logged once) where Triton cannot be imported."""
    try:
        return importlib.import_module(f"runtimes.llm.{module}")
    except ImportError as exc:  # no Triton: the reference path
        log.warning("triton_unavailable", module=module, error=repr(exc))
        return None
