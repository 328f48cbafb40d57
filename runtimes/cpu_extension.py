"""Building the runtimes' C++ CPU kernels: each is one source file compiled on first use with torch's extension
loader and loaded for the torch ops it registers. A machine without a C++ compiler gets an exception here; each
caller says what it falls back to.

Builds are cached under `TORCH_EXTENSIONS_DIR` (default `~/.cache/multiserve/kernels`), one directory per build,
named by a hash of everything the binary depends on: the source, the flags, Python's and torch's versions and this
CPU's feature flags (so a `-march=native` build made on one CPU is never loaded on another that shares the cache).
A build found there is loaded directly, without importing torch's extension loader (which brings setuptools and
~4 MiB that would stay resident in every replica).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)


def build(name: str, source: Path, cflags: Sequence[str]) -> None:
    """Compile `source` with `-O3 -fopenmp` and `cflags` (or reuse its cached build) and load it. Raises when it
    cannot be built. (-fopenmp: ATen's parallel_for is inline OpenMP; the library binds to torch's libgomp.)"""
    flags = ["-O3", *cflags, "-fopenmp"]
    full_name = f"{name}_{_build_key(source, flags)}"
    directory = _cache_root() / full_name
    library = directory / f"{full_name}.so"
    if library.is_file() and not (directory / "lock").exists():  # (torch's loader holds `lock` while it builds)
        try:
            torch.ops.load_library(str(library))
            return
        except OSError as exc:  # an interrupted build: built again below
            log.warning("cpu_kernel_cache_unusable", kernel=full_name, error=repr(exc))
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    load(name=full_name, sources=[str(source)], extra_cflags=flags, is_python_module=False, verbose=False,
         build_directory=str(directory))


def try_build(name: str, source: Path, cflags: Sequence[str]) -> bool:
    """`build`, or False (logged) when this machine cannot build it: the caller's reference path then runs."""
    try:
        build(name, source, cflags)
    except Exception as exc:  # no compiler, no headers
        log.warning("cpu_kernel_unavailable", kernel=name, error=repr(exc))
        return False
    return True


def _cache_root() -> Path:
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multiserve" / "kernels"


def _build_key(source: Path, flags: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for part in (source.read_bytes(), "\0".join(flags).encode(), sys.version.encode(), torch.__version__.encode(),
                 _cpu_flags()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _cpu_flags() -> bytes:
    """The CPU's feature flags (Linux: `flags` on x86, `Features` on ARM), so that builds for different CPUs never
    share a name."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return b""
