"""Attention over a paged KV cache: metadata, a PyTorch reference path, a CPU kernel and Triton kernels."""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from runtimes.llm.attention.metadata import AttentionMetadata
from runtimes.llm.attention.reference import paged_attention_ref, write_kv

__all__ = ["AttentionMetadata", "paged_attention_ref", "reads_only_device_metadata", "select_attention", "write_kv"]

log = structlog.get_logger(__name__)


def select_attention(name: str, device: torch.device) -> Callable:
    """The attention function for a backend name (auto | torch | cpu | triton) on `device`.

    auto: Triton on CUDA; on CPU the C++ kernel, or the reference when it cannot be built (no
    compiler), with a warning. Naming `cpu` or `triton` explicitly fails loudly instead.
    """
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from runtimes.llm.attention.triton_paged import paged_attention_triton

        return paged_attention_triton
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        from runtimes.llm.attention.cpu_paged import load_kernel, paged_attention_cpu

        try:
            load_kernel()
        except (RuntimeError, OSError) as exc:  # torch's loader reports a failed build as RuntimeError
            if name == "cpu":
                raise
            log.warning("cpu attention kernel unavailable, using the PyTorch reference", error=str(exc))
            return paged_attention_ref
        return paged_attention_cpu
    return paged_attention_ref


# The backends whose decode path reads sequence lengths, block tables and query offsets only from the metadata's
# device tensors (never its host tuples, and no grid sized from them), so a decode step through them can be captured
# once and replayed over new values (runtimes/llm/cuda_graphs.py). The reference reads `seq_lens_host`.
_DEVICE_METADATA_ONLY = frozenset({
    "runtimes.llm.attention.triton_paged.paged_attention_triton",
    "runtimes.llm.attention.triton_paged.paged_attention_triton_invariant",
    "runtimes.llm.attention.cpu_paged.paged_attention_cpu",
})


def reads_only_device_metadata(fn: Callable) -> bool:
    """Whether the attention function `fn` may be captured in a decode graph (see `_DEVICE_METADATA_ONLY`)."""
    return f"{fn.__module__}.{fn.__qualname__}" in _DEVICE_METADATA_ONLY
