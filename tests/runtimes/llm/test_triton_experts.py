"""The experts' grouped GEMM for CUDA (runtimes/llm/triton_experts.py) against the per-expert loop of
`MixtureOfExperts`, under Triton's interpreter on CPU tensors (with TRITON_INTERPRET=0 on a CUDA machine the same
tests check the compiled kernels), and the stacked storage it reads: each expert's weight a view of one tensor per
projection, through `.to()` and the loader's allocation on the meta device. fp32 and fp16 only here: Triton's
interpreter cannot run a bf16 `tl.dot` (the GPU check compares bf16 on CUDA)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported

import pytest
import torch
from torch import nn

from runtimes.llm import fused, triton_experts
from runtimes.llm.model import Linear, MixtureOfExperts
from runtimes.llm.model_config import ModelConfig
from runtimes.llm.quant.cpu import QuantLinear
from runtimes.llm.quant.formats import Q8_0
from tests.runtimes.llm.families import MIXTURES, hf_family_model

INTERPRET = os.environ["TRITON_INTERPRET"].lower() not in ("", "0", "false", "off", "no")
DEVICE = "cpu" if INTERPRET else "cuda"
# fp32: the summation order differs from the loop's matmuls; fp16: a rounding step of gate, up, the activation or
# the output (each rounded where the loop rounds it) at values up to ~8
TOL = {torch.float32: 2e-5, torch.float16: 1e-2}


def mixture(family: str = "qwen3_moe", dtype: torch.dtype = torch.float32, seed: int = 0,
            **overrides) -> MixtureOfExperts:
    """A layer's experts in `family`'s shape (4 experts, top 2, hidden 64), random weights of std 0.2."""
    cfg = ModelConfig.from_hf_config(hf_family_model(family, **overrides).config.to_dict())
    torch.manual_seed(seed)
    moe = MixtureOfExperts(cfg)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.2)
    return moe.to(device=DEVICE, dtype=dtype).eval().requires_grad_(False)


def grouped(moe: MixtureOfExperts, x: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    weights, chosen = moe.route(x)
    chosen, slots = chosen.sort(-1)
    assert moe.stacked is not None
    return triton_experts.grouped_experts(x, *moe.stacked, chosen, weights.gather(-1, slots), block_m)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want.float().abs().max().item()), err


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("block_m", [None, 16, 64])
def test_the_grouped_gemm_is_the_loop(dtype, tokens, block_m):
    """One token (most experts empty), a few, and more than a tile per expert; both tile heights."""
    moe = mixture(dtype=dtype)
    x = torch.randn(tokens, 64, device=DEVICE).to(dtype)
    want = moe.loop(x)
    assert moe.stack_experts()
    assert_close(grouped(moe, x, block_m), want, dtype)
    assert_close(moe.grouped(x, triton_experts), want, dtype)


@pytest.mark.parametrize(("top_k", "experts"), [(1, 4), (3, 8)])
def test_other_widths_and_choices_per_token(top_k, experts):
    """An intermediate size and a hidden size that no tile divides (72, 40), 1 and 3 experts per token."""
    moe = mixture("mixtral", num_local_experts=experts, num_experts_per_tok=top_k, hidden_size=40,
                  intermediate_size=72, num_attention_heads=2, num_key_value_heads=1)
    x = torch.randn(29, 40, device=DEVICE)
    want = moe.loop(x)
    moe.stack_experts()
    assert_close(moe.grouped(x, triton_experts), want, torch.float32)


def test_every_token_on_one_expert_spans_several_tiles():
    """70 tokens routed to expert 2 alone: 5 tiles of 16 rows for one expert, the others empty."""
    moe = mixture()
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[2] = 1.0
        moe.gate.weight[0] = 0.5  # expert 0 second for every token (top 2)
    x = torch.rand(70, 64, device=DEVICE) + 0.1  # positive: the router's order holds for every token
    _, chosen = moe.route(x)
    assert chosen.unique().tolist() == [0, 2]
    want = moe.loop(x)
    moe.stack_experts()
    assert_close(grouped(moe, x, block_m=16), want, torch.float32)


def test_no_tokens():
    moe = mixture()
    moe.stack_experts()
    assert grouped(moe, torch.zeros(0, 64, device=DEVICE)).shape == (0, 64)


def test_shapes_that_do_not_fit_are_refused_by_name():
    moe = mixture()
    moe.stack_experts()
    assert moe.stacked is not None
    gate_up, down = moe.stacked
    x = torch.randn(3, 64, device=DEVICE)
    chosen = torch.zeros(3, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="down"):
        triton_experts.grouped_experts(x, gate_up, down[:, :, :10], chosen, torch.ones(3, 2, device=DEVICE))
    with pytest.raises(ValueError, match="weights"):
        triton_experts.grouped_experts(x, gate_up, down, chosen, torch.ones(3, 1, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        triton_experts.grouped_experts(x.double(), gate_up, down, chosen, torch.ones(3, 2, device=DEVICE))


# --- the stacked storage ----------------------------------------------------------------------------------------


def test_stacking_makes_each_experts_weights_views_of_one_tensor():
    """No second copy: each expert's weights are slices of the stacks, same values, same names in the state dict;
    the loop's result is bit-identical before and after."""
    moe = mixture()
    x = torch.randn(9, 64, device=DEVICE)
    before, state = moe.loop(x), {k: v.clone() for k, v in moe.state_dict().items()}
    assert moe.stack_experts()
    assert moe.stacked is not None
    gate_up, down = moe.stacked
    assert gate_up.shape == (4, 2 * 48, 64) and down.shape == (4, 64, 48)
    for e, expert in enumerate(moe.experts):
        assert expert.gate_up_proj.weight.data_ptr() == gate_up[e].data_ptr()
        assert expert.down_proj.weight.data_ptr() == down[e].data_ptr()
    assert moe.state_dict().keys() == state.keys()
    assert all(torch.equal(moe.state_dict()[k], v) for k, v in state.items())
    assert torch.equal(moe.loop(x), before)
    with torch.no_grad():  # a write through an expert's weight is a write into the stack
        moe.experts[3].down_proj.weight.fill_(7.0)
    assert bool((down[3] == 7.0).all()) and not bool((down[2] == 7.0).any())


def test_to_keeps_the_experts_stacked():
    """`.to(dtype)` converts the stacks, and the experts' weights are views of the new ones (converted one expert at
    a time, they would be separate tensors beside a stale stack)."""
    moe = mixture()
    x = torch.randn(6, 64, device=DEVICE)
    moe.stack_experts()
    half = moe.to(torch.float16)
    assert half.stacked is not None and half.stacked[0].dtype == torch.float16
    assert half.experts[1].gate_up_proj.weight.data_ptr() == half.stacked[0][1].data_ptr()
    assert half.gate.weight.dtype == torch.float16
    assert_close(half.grouped(x.half(), triton_experts), half.loop(x.half()), torch.float16)


def test_stacked_on_meta_the_allocation_makes_the_stacks():
    """What the loader does on CUDA: stack on the meta device, then allocate; the checkpoint's per-expert copies
    land in the stacks."""
    source = mixture()
    cfg = ModelConfig.from_hf_config(hf_family_model("qwen3_moe").config.to_dict())
    with torch.device("meta"):
        moe = MixtureOfExperts(cfg)
    assert moe.stack_experts()
    moe = moe.to(torch.float32)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=DEVICE))
    assert moe.stacked is not None and moe.stacked[0].device.type == DEVICE
    params = dict(moe.named_parameters())
    with torch.no_grad():
        for name, tensor in source.state_dict().items():
            params[name].copy_(tensor)
    assert torch.equal(moe.stacked[1][2], source.experts[2].down_proj.weight)
    x = torch.randn(11, 64, device=DEVICE)
    assert torch.equal(moe.loop(x), source.loop(x))


def test_block_format_experts_stay_unstacked_and_loop():
    """An expert kept in a block format (or any projection that is not a dense Linear) leaves the layer unstacked,
    so the per-expert loop runs it; batch-invariant `matmul`s keep the loop too."""
    moe = mixture()
    moe.experts[1].down_proj = QuantLinear(48, 64, Q8_0, torch.zeros(64, Q8_0.packed_row_bytes(48),
                                                                       dtype=torch.uint8, device=DEVICE))
    assert not moe.stack_experts() and moe.stacked is None and not moe.grouped_applies()
    plain = mixture()
    plain.experts[0].gate_up_proj = nn.Linear(64, 96, bias=False)  # not the model's Linear
    assert not plain.stack_experts()
    stacked = mixture()
    assert stacked.stack_experts() and stacked.grouped_applies()
    for expert in stacked.experts:
        assert isinstance(expert.gate_up_proj, Linear)
        expert.gate_up_proj.matmul = torch.matmul  # as batch_invariant.apply sets every dense projection's
    assert not stacked.grouped_applies()


def test_the_cpu_forward_is_the_loop_even_stacked():
    moe = mixture()
    x = torch.randn(5, 64, device=DEVICE)
    want = moe(x)
    moe.stack_experts()
    assert fused.cuda_experts(x) is (None if DEVICE == "cpu" else triton_experts)
    if DEVICE == "cpu":
        assert torch.equal(moe(x), want)


@pytest.mark.parametrize("family", MIXTURES)
def test_each_mixture_through_the_grouped_gemm_matches_its_loop(family, monkeypatch):
    """The whole layer as the model runs it on CUDA (routing, each token's choices in ascending expert order, a
    shared expert added last), here with the kernels taken on CPU tensors too."""
    moe = mixture(family)
    x = torch.randn(13, 64, device=DEVICE)
    want = moe(x)
    moe.stack_experts()
    monkeypatch.setattr(fused, "cuda_experts", lambda t: triton_experts)
    assert_close(moe(x), want, torch.float32)
