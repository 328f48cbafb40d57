"""Attention over a paged KV cache: metadata, a PyTorch reference path and Triton kernels."""

from runtimes.llm.attention.metadata import AttentionMetadata
from runtimes.llm.attention.reference import paged_attention_ref, write_kv

__all__ = ["AttentionMetadata", "paged_attention_ref", "write_kv"]
