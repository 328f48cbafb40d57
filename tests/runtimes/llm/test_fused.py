"""The fused fp32 CPU operations against the PyTorch reference path they replace in the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtimes.llm import fused
from runtimes.llm.config import RopeScaling
from runtimes.llm.model import RMSNorm, RotaryEmbedding

OPS = torch.ops.multiserve_fused
fused.available()  # builds and registers OPS, whichever test runs first


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_norms_and_the_residual_add():
    assert fused.available()
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(7, 96) * 4, torch.randn(7, 96)
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert _close(OPS.rms_norm(x, norm.weight, 1e-5), reference)
    stream = residual.clone()
    normed = OPS.add_rms_norm(x, stream, norm.weight, 1e-5)
    assert torch.equal(stream, x + residual)  # updated in place, exactly the reference's sum
    total = x + residual
    assert _close(normed, norm.weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5)))
    with torch.no_grad():
        fused_pair = norm.add_forward(x, residual.clone())
    assert _close(fused_pair[0], normed) and torch.equal(fused_pair[1], total)


def test_rotary_in_place_on_the_fused_projection():
    """q and k rotated inside the q|k|v output (a strided view), v untouched, as `RotaryEmbedding.rotate` does."""
    torch.manual_seed(1)
    rope = RotaryEmbedding(16, 64, 10000.0, RopeScaling())
    qkv = torch.randn(5, (4 + 2 + 2) * 16)
    positions = torch.tensor([0, 3, 9, 10, 63])
    cos, sin = rope.lookup(positions)
    qk_view = qkv[:, : 6 * 16].view(5, 6, 16)
    expected = RotaryEmbedding.rotate(qk_view.clone(), cos, sin)
    v_before = qkv[:, 6 * 16 :].clone()
    OPS.rotary_(qk_view, cos.squeeze(1), sin.squeeze(1))
    assert _close(qkv[:, : 6 * 16].view(5, 6, 16), expected) and torch.equal(qkv[:, 6 * 16 :], v_before)


def test_partial_rotary_in_place_on_a_view_of_each_heads_first_dims():
    """A partial RoPE (12 of 16 dims, Phi-4-mini's 0.75) through the same kernel, given each head's first 12 dims as
    a view: those rotated as `RotaryEmbedding.rotate` rotates them, the other 4 of each head and v untouched."""
    torch.manual_seed(2)
    rope = RotaryEmbedding(12, 64, 10000.0, RopeScaling())
    qkv = torch.randn(5, (4 + 2 + 2) * 16)
    cos, sin = rope.lookup(torch.tensor([0, 3, 9, 10, 63]))
    qk = qkv[:, : 6 * 16].view(5, 6, 16)
    expected, before = RotaryEmbedding.rotate(qk.clone(), cos, sin), qkv.clone()
    assert torch.equal(expected[..., 12:], qk[..., 12:]) and not torch.allclose(expected[1:, :, :12], qk[1:, :, :12])
    OPS.rotary_(qk[..., :12], cos, sin)
    assert _close(qk, expected) and torch.equal(qkv[:, 6 * 16 :], before[:, 6 * 16 :])


def test_silu_times_up():
    gate_up = torch.randn(9, 2 * 40) * 5
    gate_up[0, :40] = torch.linspace(-120, 120, 40)  # past where exp over- and underflows
    gate, up = gate_up.split(40, dim=-1)
    assert _close(OPS.silu_mul(gate_up), F.silu(gate) * up)


def test_other_dtypes_take_the_reference_path():
    assert fused.applies(torch.zeros(2, 2)) and not fused.applies(torch.zeros(2, 2, dtype=torch.bfloat16))


def test_each_device_and_cache_gets_its_kv_writer():
    """C++ for fp32 on the CPU, the reference for other CPU caches; on CUDA the one-launch Triton kernel, except into
    an fp8 cache (its rounding is the reference's torch cast) or at a head size the kernel cannot take."""
    from types import SimpleNamespace

    from runtimes.llm.attention.reference import write_kv
    from runtimes.llm.attention.triton_paged import write_kv_triton

    key = torch.zeros(3, 2, 16)
    assert fused.kv_writer(key, torch.zeros(4, 4, 2, 16)) is fused._cpp_write_kv
    assert fused.kv_writer(key, torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16)) is write_kv

    def cuda(shape, dtype):  # device and shape are all kv_writer reads of a CUDA tensor
        return SimpleNamespace(device=torch.device("cuda"), shape=shape, dtype=dtype)

    bf16 = cuda((3, 2, 16), torch.bfloat16)
    assert fused.kv_writer(bf16, cuda((4, 4, 2, 16), torch.bfloat16)) is write_kv_triton
    assert fused.kv_writer(bf16, cuda((4, 4, 2, 16), torch.float8_e4m3fn)) is write_kv
    assert fused.kv_writer(cuda((3, 2, 80), torch.bfloat16), cuda((4, 4, 2, 80), torch.bfloat16)) is write_kv


def test_write_kv_from_views_of_the_fused_projection():
    from runtimes.llm.attention import write_kv

    torch.manual_seed(2)
    qkv = torch.randn(3, (4 + 2 + 2) * 8)
    k = qkv[:, 32:48].view(3, 2, 8)
    v = qkv[:, 48:].view(3, 2, 8)
    slots = torch.tensor([5, 0, 17])
    fused_k, fused_v = torch.zeros(4, 6, 2, 8), torch.zeros(4, 6, 2, 8)
    ref_k, ref_v = torch.zeros(4, 6, 2, 8), torch.zeros(4, 6, 2, 8)
    OPS.write_kv_(fused_k, fused_v, k, v, slots)
    write_kv(k, v, ref_k, ref_v, slots)
    assert torch.equal(fused_k, ref_k) and torch.equal(fused_v, ref_v)
    with pytest.raises(RuntimeError, match="slot 24 is outside the cache"):
        OPS.write_kv_(fused_k, fused_v, k, v, torch.tensor([0, 1, 24]))
    half_k, half_v = torch.zeros(4, 6, 2, 8, dtype=torch.float16), torch.zeros(4, 6, 2, 8, dtype=torch.float16)
    ref_k, ref_v = torch.zeros_like(half_k), torch.zeros_like(half_v)
    OPS.write_kv_(half_k, half_v, k, v, slots)  # an fp16 cache: rounded to nearest, as torch converts
    write_kv(k, v, ref_k, ref_v, slots)
    assert torch.equal(half_k, ref_k) and torch.equal(half_v, ref_v)


@pytest.mark.parametrize(("weights", "cache_dtype"),
                         [(None, torch.float32), ("q8", torch.float32), ("q4", torch.float32), ("q4", torch.float16)])
@pytest.mark.parametrize("batch", [1, 9])  # 9: past PACKED_MIN_ROWS, where fp32's gate|up takes its packed copy
def test_a_decode_step_in_one_call_equals_the_layers_one_by_one(tmp_path, monkeypatch, weights, cache_dtype, batch):
    """`decode_layers` (the whole layer stack of a decode step in C++) against the model's layers called from Python:
    the same kernels in the same order, so bit-identical hidden states and KV caches, step after step."""
    from runtimes.llm.attention import AttentionMetadata, select_attention
    from runtimes.llm.loader import load_model
    from runtimes.llm.model import LlamaForCausalLM
    from runtimes.llm.model_runner import allocate_kv_caches
    from tests.runtimes.llm.tiny import TinySpec, hf_model, save_hf_dir

    cpu = torch.device("cpu")
    path = save_hf_dir(hf_model(TinySpec(hidden_size=64, intermediate_size=96, num_layers=3)), tmp_path)
    model = load_model(path, cpu, torch.float32, select_attention("auto", cpu), progress=False, weights=weights).model
    one_call = LlamaForCausalLM._decode_natively
    taken: list[bool] = []

    def run(native: bool) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        def decide(self, *args):
            out = one_call(self, *args) if native else None
            taken.append(out is not None)
            return out

        monkeypatch.setattr(LlamaForCausalLM, "_decode_natively", decide)
        caches = allocate_kv_caches(model.config, 4 * batch, 8, cache_dtype, cpu)
        tables = [[4 * i + j for j in range(4)] for i in range(batch)]
        generator = torch.Generator().manual_seed(3)
        ids = torch.randint(0, model.config.vocab_size, (batch, 20), generator=generator)
        hidden = []
        with torch.inference_mode():
            meta = AttentionMetadata.build([12] * batch, [12] * batch, tables, 8)
            model(ids[:, :12].reshape(-1), torch.arange(12).repeat(batch), caches, meta)  # prefill: the layers
            for pos in range(12, 20):  # decode steps
                meta = AttentionMetadata.build([1] * batch, [pos + 1] * batch, tables, 8)
                hidden.append(model(ids[:, pos], torch.full((batch,), pos), caches, meta))
        return hidden, caches

    native_hidden, native_caches = run(True)
    assert taken == [False] + [True] * 8  # the prefill took the layers; every decode step the one call
    layer_hidden, layer_caches = run(False)
    assert all(torch.equal(a, b) for a, b in zip(native_hidden, layer_hidden, strict=True))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(native_caches, layer_caches, strict=True))


def test_the_one_call_is_not_taken_off_its_kernels(tmp_path):
    """bf16 activations or the reference attention keep the layers' path (the one call only has fp32 CPU kernels)."""
    from runtimes.llm.attention import AttentionMetadata, paged_attention_ref
    from runtimes.llm.loader import load_model
    from runtimes.llm.model_runner import allocate_kv_caches
    from tests.runtimes.llm.tiny import TinySpec, hf_model, save_hf_dir

    cpu = torch.device("cpu")
    path = save_hf_dir(hf_model(TinySpec()), tmp_path)
    meta = AttentionMetadata.build([1], [1], [[0]], 8)
    for dtype, attention in ((torch.float32, paged_attention_ref), (torch.bfloat16, None)):
        model = load_model(path, cpu, dtype, attention, progress=False).model
        caches = allocate_kv_caches(model.config, 1, 8, dtype, cpu)
        x = model.embed_tokens(torch.tensor([3]))
        assert model._decode_natively(x, model.rotary.lookup(torch.tensor([0])), caches, meta) is None
