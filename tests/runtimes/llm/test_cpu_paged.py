"""The CPU decode kernel (C++, built on first use) against the PyTorch reference."""

import pytest
import torch

from runtimes.llm.attention import select_attention
from runtimes.llm.attention.cpu_paged import load_kernel, paged_attention_cpu
from runtimes.llm.attention.metadata import AttentionMetadata
from runtimes.llm.attention.reference import paged_attention_ref
from tests.runtimes.llm.paged_case import paged_case

SCENARIOS = {
    "decode": ([1] * 6, [1, 5, 16, 23, 40, 300]),
    "mixed": ([1, 9, 1, 4], [13, 9, 30, 20]),  # decodes next to a prefill and a chunked prefill
    "prefill": ([7, 20], [7, 20]),
}


def _case(query_lens: list[int], seq_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int,
          head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """`paged_case` with the query as a strided view, as the model's fused q|k|v projection gives it."""
    query, k_cache, v_cache, meta, valid = paged_case(query_lens, seq_lens, block_size, num_heads, num_kv_heads,
                                                      head_dim, torch.float32)
    return torch.cat([query, torch.zeros_like(query)], dim=1)[:, :num_heads], k_cache, v_cache, meta, valid


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim"),
                         [(16, 9, 3, 64), (4, 4, 4, 32), (8, 8, 2, 128)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])  # fp16: widened as it is read
def test_matches_reference(scenario: str, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           cache_dtype: torch.dtype) -> None:
    query_lens, seq_lens = SCENARIOS[scenario]
    query, k_cache, v_cache, meta, valid = _case(query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    scale = head_dim**-0.5
    out = paged_attention_cpu(query, k_cache, v_cache, meta, scale)
    # The reference gathers whole blocks and pads decodes to the longest, so it must not see NaN.
    k_ref, v_ref = (torch.where(valid[:, :, None, None], c, 0) for c in (k_cache, v_cache))
    ref_meta = AttentionMetadata.build(query_lens, seq_lens, [list(t) for t in meta.block_tables.tolist()],
                                       block_size)
    expected = paged_attention_ref(query, k_ref, v_ref, ref_meta, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_other_dtypes_take_the_reference() -> None:
    query, k_cache, v_cache, meta, valid = _case([1, 1], [5, 17], 16, 4, 2, 16)
    k_cache, v_cache = (torch.where(valid[:, :, None, None], c, 0).bfloat16() for c in (k_cache, v_cache))
    out = paged_attention_cpu(query.bfloat16(), k_cache, v_cache, meta, 0.25)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()


def test_auto_backend_on_cpu_is_the_kernel() -> None:
    load_kernel()
    assert select_attention("auto", torch.device("cpu")) is paged_attention_cpu
    assert select_attention("torch", torch.device("cpu")) is paged_attention_ref
