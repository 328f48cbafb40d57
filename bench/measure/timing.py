"""What the measurement scripts share: one way to time a call, summarise repeats and describe the machine a number
was measured on (numbers only mean something next to a baseline measured in the same run, on the same machine)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.history import git_commit
from bench.history import machine_info as host_info


def best_time(fn: Callable[[], object], reps: int = 5) -> float:
    """The fastest of `reps` calls of `fn`, in seconds, after one warm-up call."""
    times = []
    for _ in range(reps + 1):  # the first call warms up
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def pct_ms(values: list[float], q: float) -> float:
    """The `q`th percentile of `values` (seconds) in milliseconds; NaN for none."""
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over repeated runs."""
    return {key: float(np.median([run[key] for run in runs])) for key in runs[0]}


def machine_info(**extra: Any) -> dict[str, Any]:
    """The commit and the machine a result was measured on, plus what the script adds (library versions...)."""
    return {**git_commit(), **host_info(), **extra}


def cpu_math_libraries() -> dict[str, Any]:
    """Which libraries torch's CPU math runs on here, from torch's own build and runtime reports: the instruction set
    its kernels dispatch to, the BLAS an fp32 `F.linear` calls (MKL in the PyPI wheels, which takes a slower path on
    some AMD CPUs), oneDNN (the packed weights) and the thread pools. Recorded with each result, so that two machines'
    numbers can be told apart by more than the CPU model."""
    import torch

    build = torch.__config__.show()
    runtime = torch.__config__.parallel_info()

    def after(text: str, key: str) -> str | None:
        found = re.search(re.escape(key) + r"\s*([^,\n]+)", text)
        return found.group(1).strip() if found else None

    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "blas": after(build, "BLAS_INFO="),
            "mkl": after(runtime, "Intel(R) oneAPI Math Kernel Library Version") if torch.backends.mkl.is_available()
            else None,
            "onednn": after(build, "Intel(R) MKL-DNN") if torch.backends.mkldnn.is_available() else None,
            "openmp": after(runtime, "OpenMP"), "threads": torch.get_num_threads()}


def hardware_peaks() -> dict[str, float]:
    """This machine's fp32 matmul peak and memory copy bandwidth, measured now (torch, on the CPU)."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    flops = 2 * 2048**3 / best_time(lambda: torch.mm(a, b))
    src = torch.ones(128 << 20)  # 512 MB of fp32
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / best_time(lambda: dst.copy_(src))  # read + write
    return {"matmul_gflops": flops / 1e9, "copy_gb_per_s": bandwidth / 1e9}
