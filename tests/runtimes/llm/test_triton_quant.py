"""The CUDA weight-only quantized matmul (Triton) against the blocks dequantized in PyTorch, under Triton's interpreter
on CPU tensors (with TRITON_INTERPRET=0 on a CUDA machine the same tests check the compiled kernel)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel's module is imported

import numpy as np
import pytest
import torch

from runtimes.llm.quant.formats import Q4_0, Q4_1, Q8_0, dequantize_rows, quantize
from runtimes.llm.quant.triton_matmul import quant_matmul

INTERPRET = os.environ["TRITON_INTERPRET"].lower() not in ("", "0", "false", "off", "no")
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="TRITON_INTERPRET=0 needs a CUDA device")


def _packed(rows: int, width: int, fmt, seed: int) -> torch.Tensor:
    weight = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    return torch.from_numpy(quantize(weight, fmt)).to(DEVICE)


@pytest.mark.parametrize("fmt", [Q8_0, Q4_0, Q4_1], ids=lambda f: f.name)
# K: one block (padded to two), three (padded, and not a whole step of 64), eight; M and N: below, at and past
# a tile, so every mask is exercised
@pytest.mark.parametrize("m, n, k", [(1, 10, 32), (5, 64, 96), (17, 70, 256)])
def test_matches_the_blocks_dequantized(fmt, m, n, k):
    packed = _packed(n, k, fmt, seed=k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    expected = x @ dequantize_rows(packed, fmt, k).T
    got = quant_matmul(x, packed, fmt, k)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_step_of_k_smaller_than_the_row():
    """Several K steps accumulate (block_k 32 over 256 values: eight steps)."""
    packed = _packed(20, 256, Q4_1, seed=1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    torch.testing.assert_close(quant_matmul(x, packed, Q4_1, 256, block_k=32),
                               x @ dequantize_rows(packed, Q4_1, 256).T, rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_named():
    packed = _packed(4, 64, Q8_0, seed=0)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        quant_matmul(torch.zeros(2, 32, device=DEVICE), packed, Q8_0, 64)
    with pytest.raises(ValueError, match="Q4_1 weight must be uint8"):
        quant_matmul(torch.zeros(2, 64, device=DEVICE), packed, Q4_1, 64)
