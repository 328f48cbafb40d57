"""The fused Triton operations for CUDA against the PyTorch reference in model.py, under Triton's interpreter on
CPU tensors (with TRITON_INTERPRET=0 on a CUDA machine the same tests check the compiled kernels)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported

import pytest
import torch
import torch.nn.functional as F

from runtimes.llm import triton_fused
from runtimes.llm.config import RopeScaling
from runtimes.llm.model import RotaryEmbedding

INTERPRET = os.environ["TRITON_INTERPRET"].lower() not in ("", "0", "false", "off", "no")
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="TRITON_INTERPRET=0 needs a CUDA device")
# fp32 agrees to float rounding. bf16 may differ by a rounding step of its own per conversion, and Triton's
# interpreter truncates fp32 -> bf16 where a GPU rounds to nearest, so two steps are allowed there.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = list(TOL)


def _reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 96])  # a power of two, and one the block masks
def test_norm_with_and_without_the_residual(dtype, width):
    torch.manual_seed(0)
    weight = torch.empty(width, device=DEVICE).uniform_(0.5, 1.5).to(dtype)
    x = (torch.randn(5, width, device=DEVICE) * 3).to(dtype)
    residual = torch.randn(5, width, device=DEVICE).to(dtype)
    assert _close(triton_fused.rms_norm(x, weight, 1e-5), _reference_norm(x, weight, 1e-5), dtype)
    stream = residual.clone()
    out = triton_fused.add_rms_norm(x, stream, weight, 1e-5)
    total = x + residual
    exact = dtype == torch.float32 or not INTERPRET  # the sum rounds as the reference's does (not truncated)
    assert torch.equal(stream, total) if exact else _close(stream, total, dtype)
    assert _close(out, _reference_norm(total, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_inside_the_fused_projection(dtype):
    torch.manual_seed(1)
    rope = RotaryEmbedding(16, 64, 10000.0, RopeScaling())
    qkv = torch.randn(4, (3 + 1 + 1) * 16, device=DEVICE).to(dtype)
    cos, sin = rope.lookup(torch.tensor([0, 7, 8, 63]))
    qk = qkv[:, : 4 * 16].view(4, 4, 16)
    expected = RotaryEmbedding.rotate(qk.clone(), cos.to(DEVICE), sin.to(DEVICE))
    v_before = qkv[:, 4 * 16 :].clone()
    triton_fused.rotary_(qk, cos.squeeze(1).to(DEVICE), sin.squeeze(1).to(DEVICE))
    assert _close(qkv[:, : 4 * 16].view(4, 4, 16), expected, dtype) and torch.equal(qkv[:, 4 * 16 :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_times_up_across_column_blocks(dtype):
    gate_up = (torch.randn(3, 2 * 40, device=DEVICE) * 4).to(dtype)
    gate, up = gate_up.split(40, dim=-1)
    assert _close(triton_fused.silu_mul(gate_up, block=16), F.silu(gate) * up, dtype)  # 3 column blocks


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="differ in shape"):
        triton_fused.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="unit stride"):
        triton_fused.rotary_(torch.zeros(2, 8, 3).transpose(1, 2), torch.zeros(2, 1), torch.zeros(2, 1))


def test_the_model_takes_them_where_a_cuda_tensor_would(monkeypatch):
    """The model's CUDA dispatch, run here by handing CPU tensors to the Triton operations (interpreted): the
    logits equal the reference path's."""
    from runtimes.llm import fused
    from runtimes.llm.attention import AttentionMetadata
    from runtimes.llm.loader import load_state_dict
    from runtimes.llm.model_runner import allocate_kv_caches
    from tests.runtimes.llm.test_model_vs_transformers import BLOCK_SIZE
    from tests.runtimes.llm.tiny import TinySpec, hf_model

    if not INTERPRET:
        pytest.skip("checks the dispatch on CPU tensors through the interpreter")
    ref = hf_model(TinySpec())
    model = load_state_dict(_config(ref), ref.state_dict().items(), torch.device("cpu"), torch.float32)

    def logits() -> torch.Tensor:
        caches = allocate_kv_caches(model.config, 8, BLOCK_SIZE, torch.float32, torch.device("cpu"))
        meta = AttentionMetadata.build([9], [9], [list(range(8))], BLOCK_SIZE)
        with torch.inference_mode():
            return model.compute_logits(model(torch.arange(3, 12), torch.arange(9), caches, meta))

    monkeypatch.setattr(fused, "applies", lambda x: False)
    reference = logits()
    calls = []

    def cuda_ops(x):
        calls.append(x.shape)
        return triton_fused

    monkeypatch.setattr(fused, "cuda_ops", cuda_ops)
    assert torch.allclose(logits(), reference, rtol=1e-4, atol=1e-4) and len(calls) >= 4 * model.config.num_layers


def _config(ref):
    from runtimes.llm.config import ModelConfig

    return ModelConfig.from_hf_config(ref.config.to_dict())
