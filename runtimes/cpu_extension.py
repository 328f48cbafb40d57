"""Building the runtimes' C++ CPU kernels: each is one source file compiled on first use with torch's extension
loader (cached per machine under `TORCH_EXTENSIONS_DIR`, so `-march=native` is safe) and loaded for the torch ops
it registers. A machine without a C++ compiler gets an exception here; each caller says what it falls back to."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


def build(name: str, source: Path, cflags: Sequence[str]) -> None:
    """Compile `source` with `-O3 -fopenmp` and `cflags` (or reuse its cached build) and load it. Raises when it
    cannot be built. (-fopenmp: ATen's parallel_for is inline OpenMP; the library binds to torch's libgomp.)"""
    from torch.utils.cpp_extension import load

    load(name=name, sources=[str(source)], extra_cflags=["-O3", *cflags, "-fopenmp"], is_python_module=False,
         verbose=False)


def try_build(name: str, source: Path, cflags: Sequence[str]) -> bool:
    """`build`, or False (logged) when this machine cannot build it: the caller's reference path then runs."""
    try:
        build(name, source, cflags)
    except Exception as exc:  # no compiler, no headers
        log.warning("cpu_kernel_unavailable", kernel=name, error=repr(exc))
        return False
    return True
