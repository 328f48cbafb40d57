"""Llama-family decoder in plain PyTorch, run over a packed batch of tokens from many sequences.

There is no padding and no batch dimension: token `t` of the batch carries its own position and its
own KV-cache slot (see `AttentionMetadata`). Projections are fused (q|k|v and gate|up) so one GEMM
serves each; the loaders split checkpoints' separate matrices into these.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from runtimes.llm import fused
from runtimes.llm.attention import AttentionMetadata, paged_attention_ref
from runtimes.llm.attention.cpu_paged import KERNEL_CACHE_DTYPES, decode_rows, paged_attention_cpu
from runtimes.llm.config import ModelConfig, RopeScaling
from runtimes.llm.quant.cpu import QuantEmbedding, QuantLinear


class AttentionFn(Protocol):
    """A paged attention backend (runtimes/llm/attention): query [T, H, D] over the caches -> [T, H, D]."""

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor: ...


# `decode_layers`' per-layer arguments: norm weights, projection weights, their packed copies, their kernels (0: dense
# fp32, else the GGML type of a block format's panels)
DecodeWeights = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None], list[int]]


@dataclass
class PartialForward:
    """Where a forward pass stopped between layers: the next layer to run and the hidden state before it."""

    next_layer: int
    x: torch.Tensor
    residual: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor]
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # the local layers' (Gemma 3), where they differ


class StepInterrupted(BaseException):  # a cancellation, like asyncio.CancelledError, not an error
    """Raised between layers when the step's `interrupt()` says an urgent arrival should not wait for it; `partial`
    is where the step stands (the model's `PartialForward`, wrapped by the model runner), so it can be finished
    later.

    A BaseException, as cancellations are, so that error handling (the fault isolation's bisect-and-rerun) lets it
    through to the engine, which either finishes the step after the arrival's or drops it (its requests then
    compute the same tokens again, overwriting the KV it wrote part-way; the prefix cache only indexes blocks of
    completed steps).
    """

    def __init__(self, partial: object = None) -> None:
        super().__init__()
        self.partial = partial


# Batches of at least this many rows use a CPU pre-packed weight where the loader made one (see `Linear`).
PACKED_MIN_ROWS = 8


def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T, through oneDNN's pre-packed copy of `weight` when there is one and the batch is large
    enough for its blocked layout to pay (at a single row MKL on the plain weight is as fast or faster)."""
    if packed is not None and x.shape[0] >= PACKED_MIN_ROWS and x.is_cpu:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return F.linear(x, weight)


class Linear(nn.Linear):
    """`nn.Linear` (no bias) that may also hold `packed`: oneDNN's blocked copy of its weight, which the CPU
    loader sets on the largest projections (`loader.pack_cpu_weights`). It is an opaque tensor, neither a
    parameter nor a buffer, so state dicts and `.to()` see only the plain weight. `matmul`, when set, computes
    x @ weight.T instead (`engine.deterministic`: runtimes/llm/batch_invariant.py)."""

    packable = False  # whether the CPU loader packs it (set on gate|up, the largest)
    packed: torch.Tensor | None = None
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul is not None:
            return self.matmul(x, self.weight)
        return packed_linear(x, self.weight, self.packed)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        if (ops := fused.ops_for(x)) is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 whatever the weights' dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and the next norm in one pass where the
        fused operations apply (`residual` is then updated in place)."""
        if (ops := fused.ops_for(x)) is not None:
            return ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self.forward(residual), residual


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling, long: bool = False
                  ) -> torch.Tensor:  # [R/2]
    """The inverse frequencies of the `rotary_dim` dims RoPE rotates; longrope's with its long factors if `long`,
    else its short ones."""
    # on the CPU whatever the default device: arithmetic on meta tensors (where the loader builds the model) goes
    # through torch's Python references, whose first use imports torch._dynamo and Triton (~65 MB resident)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    if scaling.kind == "longrope":  # each frequency divided by its own factor, in transformers' order of operations
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32, device="cpu")
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves), the layout Hugging Face checkpoints use, over the first `rotary_dim` dims of
    each head (all of them but where a model's RoPE is partial, e.g. Phi-4-mini's); the rest pass through.

    Its tables are one row per position, so a position's rotation never depends on the rest of its sequence or
    batch: longrope takes its short factors below `original_max_position_embeddings` and its long ones from there on
    (model_config.RopeScaling says how that differs from transformers past the boundary)."""

    cos: torch.Tensor  # [P, R/2]
    sin: torch.Tensor

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        self.rotary_dim, self.max_positions, self.theta, self.scaling = rotary_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.rebuild(torch.device("cpu"))

    def rebuild(self, device: torch.device) -> None:
        """(Re)compute the fp32 tables on `device` (the CPU at construction, wherever the model is built; the loader
        then calls this with the model's device)."""
        inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, R/2]
        if self.scaling.kind == "longrope":
            boundary = self.scaling.original_max_position_embeddings
            long_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, long=True).to(device)
            freqs = torch.cat((freqs[:boundary], positions[boundary:, None] * long_freq[None, :]))
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling.kind == "longrope":  # transformers' attention scaling, on cos and sin
            cos, sin = cos * self.scaling.attention_factor, sin * self.scaling.attention_factor
        self.cos, self.sin = cos, sin

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for this step's positions, looked up once and shared by every layer: 2 x [T, R/2]."""
        return self.cos[positions], self.sin[positions]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x: [T, heads, D]
        """x rotated over its first R = 2 * cos.shape[-1] dims, the rest as they are."""
        rotated = 2 * cos.shape[-1]
        if rotated < x.shape[-1]:
            return torch.cat((RotaryEmbedding.rotate(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # over every head
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, attention_fn: AttentionFn, window: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = window  # sliding-window attention: the tokens a query sees, its own included (0: all)
        self.rotary_dim = cfg.rotary_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        # what a family adds (runtimes/llm/model_config.py): biases, kept beside the projections (which may hold their
        # weight in a block format), and Qwen3's per-head norms of q and k
        self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size)) if cfg.qkv_bias else None
        self.o_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.o_bias else None
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope
        self.attention_fn = attention_fn
        self.scale = cfg.attention_scale
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2's cap on the attention scores (0: none)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin of this step's positions: 2 x [T, R/2]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, KVH, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        # RoPE on q and k together, one pass over [T, Hq + KVH, D]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((_per_head(self.q_norm, q), _per_head(self.k_norm, k)), dim=1)
        if (ops := fused.ops_for(qkv)) is not None:
            # in place, in qkv; a partial RoPE's view of each head's first rotary_dim dims keeps the strides the
            # kernels walk heads and tokens by, and they rotate the halves of what they are given
            ops.rotary_(qk if self.rotary_dim == self.head_dim else qk[..., : self.rotary_dim], *rope)
        else:
            qk = self.rope.rotate(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, Hq, D], [T, KVH, D]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        fused.kv_writer(k, k_cache)(k, v, k_cache, v_cache, meta.slot_mapping)
        if self.window or self.softcap:
            out = self.attention_fn(q, k_cache, v_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        else:
            out = self.attention_fn(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        out = self.o_proj(out.reshape(num_tokens, self.q_size))
        return out if self.o_bias is None else out + self.o_bias


def _per_head(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:  # [T, heads, D]
    """An RMSNorm over each head's D values."""
    return norm(x.reshape(-1, x.shape[-1])).view(x.shape)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: the config's unless given (a shared expert has its own)."""
        super().__init__()
        self.intermediate_size = inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.gate_up_proj.packable = True
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)
        self.gelu = cfg.mlp_activation == "gelu_tanh"  # Gemma's GeGLU (no fused kernel: the plain ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if (ops := fused.ops_for(gate_up)) is not None:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MixtureOfExperts(nn.Module):
    """A sparse MLP (Mixtral, Qwen3-MoE, Qwen2-MoE): the router's softmax over `num_experts`, each token's top
    `experts_per_token` (their probabilities renormalised to sum to 1 where the family does), and the weighted sum
    of those experts' outputs. The tokens are grouped by expert, so each expert runs once a step over all of its
    tokens; a token's contributions are added in ascending expert order whatever its batch. A shared expert
    (Qwen2-MoE) runs on every token, scaled by sigmoid(shared_expert_gate(x)), and is added to that sum last, as
    transformers adds it.

    On CUDA, experts whose projections are all dense `Linear`s can be *stacked* (`stack_experts`, which the loader
    does on CUDA): one [E, 2I, H] gate|up and one [E, H, I] down tensor per layer, each expert's weight a view of its
    slice, so the experts' memory is held once. A step then runs them as two grouped GEMM launches
    (runtimes/llm/triton_experts.py) instead of the per-expert loop, without reading anything back to the host (so
    decode steps can be captured as CUDA graphs). Everywhere else, and for block-format experts or a model in its
    batch-invariant form, the loop runs."""

    # (gate_up [E, 2I, H], down [E, H, I]) that every expert's weights are views of; not a parameter or buffer, so
    # state dicts and the loader see each expert's weight under its own name, as before
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        experts = [MLP(cfg) for _ in range(cfg.num_experts)]
        for expert in experts:  # no second (oneDNN-packed) copy of every expert: each sees a few rows a step
            expert.gate_up_proj.packable = False
        self.experts = nn.ModuleList(experts)
        self.top_k = cfg.experts_per_token
        self.renormalize = cfg.renormalize_experts
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(cfg, shared) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's routing weights (fp32) and chosen experts, [T, k] each, in the router's order."""
        probs = self.gate(x).float().softmax(-1)  # [T, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        if self.grouped_applies() and (kernels := fused.cuda_experts(x)) is not None:
            out = self.grouped(x, kernels)
        else:
            out = self.loop(x)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def loop(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        """The routed experts' sum, one expert at a time (each over all of its tokens); reads the counts on the
        host."""
        weights, chosen = self.route(x)
        weights = weights.to(x.dtype).flatten()
        flat = chosen.flatten()  # [T * k]: token t's choices at t * k ...
        order = flat.argsort(stable=True)  # grouped by expert, each group in token order
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                picks = order[start:start + count]
                tokens = picks // self.top_k
                out.index_add_(0, tokens, expert(x[tokens]) * weights[picks, None])
                start += count
        return out

    def grouped(self, x: torch.Tensor, kernels: ModuleType) -> torch.Tensor:  # [T, H]
        """The routed experts' sum as `kernels.grouped_experts` computes it over the stacked weights: each token's
        choices in ascending expert order, so its terms are added in the loop's order."""
        assert self.stacked is not None, "grouped needs stack_experts first"
        weights, chosen = self.route(x)
        chosen, slots = chosen.sort(-1)
        return kernels.grouped_experts(x, *self.stacked, chosen, weights.gather(-1, slots))

    def grouped_applies(self) -> bool:
        """Stacked, and not in the batch-invariant form (`batch_invariant.apply` gives every dense projection its
        fixed-tile `matmul`, which only the loop calls)."""
        return self.stacked is not None and cast(MLP, self.experts[0]).gate_up_proj.matmul is None

    def _projections(self) -> list[tuple[nn.Module, str]]:
        return [(proj, part) for expert in cast(list[MLP], self.experts)
                for proj, part in ((expert.gate_up_proj, "gate_up"), (expert.down_proj, "down"))]

    def stack_experts(self) -> bool:
        """Move the experts' weights into one stacked tensor per projection, each expert's weight becoming a view of
        its slice (values kept; on the meta device, where the loader builds the model, nothing is copied and the
        allocation that follows makes the stacks). False, changing nothing, where an expert's projection is not a
        dense `Linear` (a block format) or the experts differ in dtype or device."""
        if self.stacked is not None:
            return True
        projections = self._projections()
        if not all(type(proj) is Linear for proj, _ in projections):
            return False
        weights = [cast(Linear, proj).weight for proj, _ in projections]
        if len({(w.dtype, w.device) for w in weights}) != 1:
            return False
        self.stacked = (torch.stack(weights[0::2]), torch.stack(weights[1::2]))
        self._bind_views(weights[0].requires_grad)
        return True

    def _bind_views(self, requires_grad: bool) -> None:
        assert self.stacked is not None
        for e, expert in enumerate(cast(list[MLP], self.experts)):
            expert.gate_up_proj.weight = nn.Parameter(self.stacked[0][e], requires_grad=requires_grad)
            expert.down_proj.weight = nn.Parameter(self.stacked[1][e], requires_grad=requires_grad)

    def _apply(self, fn, recurse=True):  # .to(), .float(), the loader's allocation: keep the experts stacked
        """Stacked, `fn` applies to the two stacks, whose new slices the experts' weights become (applied to each
        expert's weight, it would make E separate tensors and leave the stacks behind); the rest as usual."""
        if self.stacked is None:
            return super()._apply(fn, recurse)
        held = [(proj, proj._parameters.pop("weight")) for proj, _ in self._projections()]
        try:
            super()._apply(fn, recurse)
        except BaseException:
            for proj, weight in held:
                proj._parameters["weight"] = weight
            raise
        self.stacked = (fn(self.stacked[0]), fn(self.stacked[1]))
        self._bind_views(held[0][1].requires_grad)
        return self


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, attention_fn: AttentionFn, window: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, attention_fn, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | MixtureOfExperts = MixtureOfExperts(cfg) if cfg.num_experts else MLP(cfg)
        # Gemma's sandwich: post_attention_layernorm then norms the attention's output alone, and these the MLP's
        # input (after the residual add, Llama's post_attention_layernorm) and its output
        sandwich = cfg.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if sandwich else None

    def projections(self) -> tuple[tuple[str, nn.Module], ...]:
        """The weights a step multiplies by, by name, in `decode_layers`' order (a mixture's router, then each
        expert's, then its shared expert's and that one's gate)."""
        attn, mlp = self.self_attn, self.mlp
        attention = (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj))
        if isinstance(mlp, MixtureOfExperts):
            experts: list[tuple[str, nn.Module]] = [
                (f"experts.{i}.{name}", proj) for i, e in enumerate(cast(list[MLP], mlp.experts))
                for name, proj in (("gate_up_proj", e.gate_up_proj), ("down_proj", e.down_proj))]
            if mlp.shared_expert is not None and mlp.shared_expert_gate is not None:
                shared = mlp.shared_expert
                experts += [("shared_expert.gate_up_proj", shared.gate_up_proj),
                            ("shared_expert.down_proj", shared.down_proj),
                            ("shared_expert_gate", mlp.shared_expert_gate)]
            return (*attention, ("gate", mlp.gate), *experts)
        return (*attention, ("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj))

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the add of the MLP output to the stream is
        left to the next norm, which does it in the same pass (as vLLM's layers do)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        attention = self.self_attn(h, rope, kv_cache, meta)
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            h, residual = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(attention), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm.add_forward(attention, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (tied to the embeddings when the config says so): the one
    decoder skeleton; a family's additions (model_config.FAMILIES) are options of its attention."""

    packed_lm_head: torch.Tensor | None = None  # oneDNN copy of the LM head's weight (CPU loader), see `Linear`
    logits_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # a dense head's, see `Linear`

    def __init__(self, cfg: ModelConfig, attention_fn: AttentionFn = paged_attention_ref) -> None:
        super().__init__()
        self.config = cfg
        # no random init: every loader overwrites the table (and a normal_ on the meta device, where the loader
        # builds the model, costs a one-time ~1 s of torch imports)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3's local (sliding) layers rotate with a base of their own and no scaling
        self.local_rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.local_rope_theta,
                                            RopeScaling()) if any(cfg.local_rope_layers) else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.local_rotary if self.local_rotary is not None and cfg.local_rope(i) else self.rotary,
                         attention_fn, cfg.window(i))
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        interrupt: Callable[[], bool] | None = None,
    ) -> torch.Tensor:  # [T, H] final hidden states
        """`interrupt`, asked after each layer but the last (not inside the one-call decode stack, which is short):
        True stops the step with StepInterrupted, whose `partial` `resume` takes."""
        x = self.embed_tokens(input_ids).to(self.norm.weight.dtype)  # a block-format table dequantizes to fp32
        if self.config.scale_embeddings:
            x = x * _embedding_scale(self.config.hidden_size, x.dtype)
        rope = self.rotary.lookup(positions)
        if (native := self._decode_natively(x, rope, kv_caches, meta)) is not None:
            return self.norm.add_forward(*native)[0]
        local = None if self.local_rotary is None else self.local_rotary.lookup(positions)
        return self.resume(PartialForward(0, x, None, rope, local), kv_caches, meta, interrupt)

    def resume(
        self,
        at: PartialForward,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        interrupt: Callable[[], bool] | None = None,
    ) -> torch.Tensor:  # [T, H] final hidden states
        """The layers from `at.next_layer` on (the rest of a pass that stopped there, over the same batch and KV
        cache), then the final norm; `interrupt` as in `forward`."""
        x, residual, last = at.x, at.residual, len(self.layers) - 1
        for i in range(at.next_layer, last + 1):
            rope = at.local_rope if at.local_rope is not None and self.config.local_rope(i) else at.rope
            x, residual = self.layers[i](x, residual, rope, kv_caches[i], meta)
            if interrupt is not None and i < last and interrupt():
                raise StepInterrupted(PartialForward(i + 1, x, residual, at.rope, at.local_rope))
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]

    def _decode_natively(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step's whole layer stack in one C++ call (`decode_layers` in cpu_fused.cpp): the same kernels in
        the same order as `DecoderLayer.forward`, so the same result, without its Python dispatch (at batch 1 about a
        third of the step). Returns (last MLP output, residual), or None where that call does not apply: a step with
        a prefill, anything but fp32 activations on the CPU with the C++ attention kernel (over an fp32 or fp16 cache),
        a projection it has no kernel for."""
        layers = cast(list[DecoderLayer], self.layers)
        cfg = self.config
        if cfg.qkv_bias or cfg.o_bias or cfg.qk_norm or cfg.num_experts or cfg.sandwich_norms or cfg.scale_embeddings:
            return None  # the one-call stack is Llama's layer only
        if not (meta.is_pure_decode and layers and fused.applies(x) and kv_caches[0][0].dtype in KERNEL_CACHE_DTYPES
                and layers[0].self_attn.attention_fn is paged_attention_cpu):
            return None
        if (stack := self._decode_weights) is None:
            return None
        rows = decode_rows(meta)
        assert rows is not None  # a pure decode step
        k_caches, v_caches = zip(*kv_caches, strict=True)
        return torch.ops.multiserve_fused.decode_layers(
            x, *rope, *stack, list(k_caches), list(v_caches), meta.slot_mapping, rows.rows,
            rows.block_tables, rows.seq_lens, [cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size],
            cfg.rms_norm_eps, layers[0].self_attn.scale, PACKED_MIN_ROWS, list(cfg.layer_windows))

    @functools.cached_property
    def _decode_weights(self) -> DecodeWeights | None:
        """`decode_layers`' per-layer arguments (norm weights; projection weights, packed copies and kinds), or
        None where a projection has no kernel there. Gathered on the first decode step (walking the modules costs
        ~0.5 ms) and again after `.to()` and the like (`_apply`)."""
        norms: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []
        packed: list[torch.Tensor | None] = []
        kinds: list[int] = []
        for layer in cast(list[DecoderLayer], self.layers):
            norms += (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            for _, proj in layer.projections():
                if isinstance(proj, QuantLinear) and proj.panels:
                    weights.append(proj.qweight)
                    packed.append(None)
                    kinds.append(proj.fmt.ggml_id)
                elif isinstance(proj, Linear) and proj.weight.dtype == torch.float32:
                    weights.append(proj.weight)
                    packed.append(proj.packed)
                    kinds.append(0)
                else:
                    return None
        return norms, weights, packed, kinds

    def _apply(self, fn, recurse=True):  # .to(), .float(), ...: new tensors
        self.__dict__.pop("_decode_weights", None)
        return super()._apply(fn, recurse)

    def set_attention(self, attention_fn: AttentionFn) -> None:
        """Every layer's attention function (a backend, or its batch-invariant form)."""
        for layer in cast(list[DecoderLayer], self.layers):
            layer.self_attn.attention_fn = attention_fn

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        logits = self._logits(hidden)
        if cap := self.config.final_logit_softcapping:  # as transformers' Gemma: within (-cap, cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, QuantEmbedding):  # a tied head kept in a block format
            return head.project(hidden).float()
        if isinstance(head, QuantLinear):
            return head(hidden).float()
        if self.logits_matmul is not None:
            return self.logits_matmul(hidden, head.weight).float()
        return packed_linear(hidden, head.weight, self.packed_lm_head).float()


@functools.cache
def _embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """Gemma's embedding scale, sqrt(hidden_size) rounded to the activations' dtype as transformers rounds it (to
    bf16, sqrt(3072) = 55.43 becomes 55.5), as a Python number: multiplying by it costs no tensor of its own (and
    none made inside a CUDA graph's capture)."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype))
