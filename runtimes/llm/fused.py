"""The fused fp32 CPU operations of a decoder layer (`cpu_fused.cpp`): RMSNorm with the residual add, RoPE in
place, SiLU times up. The model uses them where they apply (`applies`) and its PyTorch reference path elsewhere
(other dtypes, other devices, or no C++ compiler here). Compiled on first use, like the other CPU kernels."""

from __future__ import annotations

import functools
from pathlib import Path

import structlog
import torch

_SOURCE = Path(__file__).with_name("cpu_fused.cpp")
log = structlog.get_logger(__name__)


@functools.cache
def available() -> bool:
    """Build (or reuse the cached build of) the fused operations; False, logged, when they cannot be built."""
    from torch.utils.cpp_extension import load

    try:
        load(name="multiserve_cpu_fused", sources=[str(_SOURCE)],
             extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"], is_python_module=False,
             verbose=False)
    except Exception as exc:  # no compiler: the reference path computes the same thing
        log.warning("fused_ops_unavailable", error=repr(exc))
        return False
    return True


def applies(x: torch.Tensor) -> bool:
    """Whether the fused operations take `x`: fp32 on the CPU (the reference path takes everything else)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and available()
