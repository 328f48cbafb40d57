"""The model check's families part (tests/gpu/check_model.py): decoder families beyond Llama's layer, run by the
engine on the check's device against transformers on the same device, and the experts' grouped GEMM against the
per-expert loop.

* `families.<family>`: a windowed dense family (Mistral, its sliding window of 7 shorter than every prompt +
  output) and a mixture of experts (Qwen3-MoE: 4 experts, top 2), tiny random checkpoints built by transformers
  (tests/runtimes/llm/families.py, as the CPU suite's) and loaded from a Hugging Face directory, fp32. The engine
  runs them on the Triton attention backend (KV blocks of 16, chunked prefill), with decode steps replayed from
  graphs (CUDA graphs; on `--device cpu` the CPU suite's stand-in), three prompts together, greedy, 16 tokens:
  token-exact with transformers' `generate` (or the first difference a near-tie: the two tokens' logprobs within
  2 x LOGPROB_TOL under transformers), every token's logprob within LOGPROB_TOL of transformers' for the same
  prefix, at least NEW_TOKENS / 2 decode steps replayed, no KV block leaked. The mixture's experts must run stacked,
  through the grouped GEMM (the loop reads counts on the host, which a CUDA graph cannot capture); on `--device
  cpu` the check stacks them (the loader does on CUDA only) and the model takes the grouped GEMM on CPU tensors
  (Triton's interpreter), so the dry run runs the path the GPU will.
* `experts.<dtype>`: `triton_experts.grouped_experts` against `MixtureOfExperts.loop` on one layer (16 experts, top
  4, hidden 512, intermediate 768 on CUDA), at 1, 8 and 512 tokens (both tile heights), agreeing per element as the
  attention kernels must (tests/gpu/verdicts.py: fp32 2e-4 + 4 eps |ref|, bf16 2 eps + 4 eps |ref|); on CUDA fp32
  and bf16, with the loop's and the grouped GEMM's time at 512 tokens reported, not judged. On `--device cpu` tiny
  shapes, fp32 and fp16 (Triton's interpreter cannot run a bf16 `tl.dot`), timed nothing.

Importing this module needs what the GPU host has (torch, triton, transformers) and no test tools; Triton's mode
(`TRITON_INTERPRET`) must be set before it is imported, as check_model.py does.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from runtimes.llm import fused
from runtimes.llm.attention import select_attention
from runtimes.llm.config import EngineConfig, ModelConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.loader import LoadedModel, load_model
from runtimes.llm.model import DecoderLayer, MixtureOfExperts
from runtimes.llm.sampling_params import SamplingParams
from tests.gpu.common import Reporter, fmt, time_ms
from tests.gpu.verdicts import compare
from tests.runtimes.llm.engine_utils import ReplayingGraph, random_prompt, run_to_completion
from tests.runtimes.llm.families import hf_family_model, save_family_dir

FAMILIES = ("mistral", "qwen3_moe")
PROMPT_LENS = (5, 23, 40)
NEW_TOKENS = 16
BLOCK_SIZE = 16
# fp32 on both sides: the two differ in summation order only (~1e-6 here); a wrong mask, window or expert is off by
# 1e-2 or more
LOGPROB_TOL = 2e-4


def check_families(rep: Reporter, device: str) -> None:
    """Each of FAMILIES, then the grouped GEMM, each a result (an exception fails only its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            rep.guarded(f"families.{family}", lambda f=family: check_family(rep, f, device, Path(tmp)))
    # fp16 only on CPU, where the interpreter cannot run bf16 dots: on CUDA it is bf16's code at a third kernel
    # compile's cost, and the CPU suite checks it (tests/runtimes/llm/test_triton_experts.py)
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32, torch.float16):
        rep.guarded(f"experts.{_label(dtype)}", lambda d=dtype: check_grouped_experts(rep, d, device))


def check_family(rep: Reporter, family: str, device: str, tmp: Path) -> None:
    ref = hf_family_model(family, seed=1)
    path = save_family_dir(ref, tmp / family)
    ref = ref.to(device)
    ref.generation_config.eos_token_id = None  # as ignore_eos: EOS may be drawn and does not stop
    loaded = load_model(path, torch.device(device), torch.float32, select_attention("triton", torch.device(device)),
                        progress=False)
    mixtures = [layer.mlp for layer in _layers(loaded) if isinstance(layer.mlp, MixtureOfExperts)]
    if device == "cpu":  # the loader stacks experts on CUDA only: here the dry run stacks them itself
        for mixture in mixtures:
            mixture.stack_experts()
    stacked = all(m.stacked is not None and m.grouped_applies() for m in mixtures)
    prompts = [random_prompt(seed, n) for seed, n in enumerate(PROMPT_LENS)]
    with _grouped_experts_on_cpu(device):
        tokens, logprobs, replays = _engine_run(loaded, prompts, device)
    rows: list[dict[str, Any]] = []
    worst = 0.0
    ok = True
    for i, prompt in enumerate(prompts):
        theirs = _hf_greedy(ref, prompt, device)
        with torch.no_grad():  # transformers' logprob of each of our tokens after our prefix
            logits = ref(torch.tensor([prompt + tokens[i]], device=device)).logits[0].float().log_softmax(-1)
        expected = [float(logits[len(prompt) - 1 + j, t]) for j, t in enumerate(tokens[i])]
        err = max((abs(a - b) for a, b in zip(logprobs[i], expected, strict=True)), default=0.0)
        worst = max(worst, err)
        row: dict[str, Any] = {"prompt": i, "equal": tokens[i] == theirs, "logprob_max_err": err}
        if tokens[i] != theirs:
            j = next((k for k, (a, b) in enumerate(zip(tokens[i], theirs, strict=False)) if a != b),
                     min(len(tokens[i]), len(theirs)))
            row["first_difference"] = j
            if j < min(len(tokens[i]), len(theirs)):
                gap = abs(float(logits[len(prompt) - 1 + j, tokens[i][j]] - logits[len(prompt) - 1 + j, theirs[j]]))
                row.update(ours_token=tokens[i][j], ref_token=theirs[j], gap=gap, near_tie=gap <= 2 * LOGPROB_TOL)
                ok = ok and gap <= 2 * LOGPROB_TOL
            else:
                ok = False
        rows.append(row)
    exact = sum(1 for r in rows if r["equal"])
    windows = loaded.config.layer_windows
    ok = ok and worst <= LOGPROB_TOL and replays >= NEW_TOKENS // 2
    if family == "mistral":  # the window must be in force, and shorter than every prompt + output
        ok = ok and bool(windows) and all(0 < w < n + NEW_TOKENS for w in windows for n in PROMPT_LENS)
    if mixtures:  # the grouped GEMM, not the loop (which reads counts on the host: no CUDA graph can capture it)
        ok = ok and stacked
    rep.report(f"families.{family}", ok,
               fmt(exact_prompts=f"{exact}/{len(prompts)}", logprob_max_err=worst, graph_replays=replays,
                   windows=",".join(map(str, windows)) or "none", experts_stacked=stacked if mixtures else "n/a"),
               family=family, prompts=rows, prompt_lens=PROMPT_LENS, new_tokens=NEW_TOKENS, graph_replays=replays,
               layer_windows=windows, experts_stacked=stacked, logprob_tol=LOGPROB_TOL)


@contextmanager
def _grouped_experts_on_cpu(device: str) -> Iterator[None]:
    """On `--device cpu`, stacked experts run through the grouped GEMM on CPU tensors too (Triton's interpreter), so
    the dry run takes the path a CUDA model takes (the model keeps the loop on the CPU otherwise)."""
    if device != "cpu":
        yield
        return
    from runtimes.llm import triton_experts

    cuda_experts = fused.cuda_experts
    fused.cuda_experts = lambda x: triton_experts
    try:
        yield
    finally:
        fused.cuda_experts = cuda_experts


def _layers(loaded: LoadedModel) -> list[DecoderLayer]:
    return [layer for layer in loaded.model.layers if isinstance(layer, DecoderLayer)]


def _engine_run(loaded: LoadedModel, prompts: list[list[int]], device: str
                ) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens and their logprobs for each prompt, all in one engine with decode graphs, and how many decode
    steps were replays."""
    config: ModelConfig = loaded.config
    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=len(prompts),
                                            kv_cache_bytes=64 * BLOCK_SIZE * config.kv_bytes_per_token(torch.float32),
                                            max_num_batched_tokens=32, cuda_graphs=True),
                       new_graph=ReplayingGraph if device == "cpu" else None)
    if engine.runner.graphs is None:
        raise RuntimeError("the engine captured no decode graphs")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    done = run_to_completion(engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    if engine.kv.num_free_blocks != engine.kv.num_blocks:
        raise RuntimeError(f"KV blocks leaked: {engine.kv.num_blocks - engine.kv.num_free_blocks}")
    logprobs = []
    for i in range(len(prompts)):
        got = done[f"p{i}"].logprobs
        if got is None:
            raise RuntimeError(f"prompt {i}: no logprobs came back")
        logprobs.append([lp.logprob for lp in got])
    return [done[f"p{i}"].token_ids for i in range(len(prompts))], logprobs, engine.runner.graphs.replays


def _hf_greedy(model: torch.nn.Module, prompt: list[int], device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())


def check_grouped_experts(rep: Reporter, dtype: torch.dtype, device: str) -> None:
    from runtimes.llm import triton_experts

    cuda = device == "cuda"
    experts, top_k, hidden, inter = (16, 4, 512, 768) if cuda else (4, 2, 64, 48)
    counts = (1, 8, 512) if cuda else (1, 9)  # 512 x 4 picks: the prefill's taller tiles
    cfg = ModelConfig.from_hf_config({**hf_family_model("qwen3_moe").config.to_dict(), "hidden_size": hidden,
                                      "moe_intermediate_size": inter, "num_experts": experts,
                                      "num_experts_per_tok": top_k})
    torch.manual_seed(0)
    moe = MixtureOfExperts(cfg)
    with torch.no_grad():  # gate, up ~ N(0, 1) for x ~ N(0, 1); each expert's output ~ N(0, 1)
        for expert in moe.experts:
            expert.gate_up_proj.weight.normal_(0, hidden ** -0.5)
            expert.down_proj.weight.normal_(0, inter ** -0.5)
        moe.gate.weight.normal_(0, hidden ** -0.5)
    moe = moe.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if not moe.stack_experts():
        raise RuntimeError("the experts could not be stacked")
    worst: dict[int, Any] = {}
    ok = True
    with torch.no_grad():
        for tokens in counts:
            x = torch.randn(tokens, hidden, device=device).to(dtype)
            agreement = compare(moe.grouped(x, triton_experts), moe.loop(x), dtype)
            worst[tokens] = {"max_abs_err": agreement.max_abs_err, "err_over_bound": agreement.err_over_bound}
            ok = ok and agreement.ok
        timing: dict[str, float] = {}
        if cuda:
            x = torch.randn(counts[-1], hidden, device=device).to(dtype)
            timing = {"loop_ms": time_ms(lambda: moe.loop(x), device, iters=20),
                      "grouped_ms": time_ms(lambda: moe.grouped(x, triton_experts), device, iters=20)}
    label = _label(dtype)
    rep.report(f"experts.{label}", ok,
               fmt(err_over_bound=max(w["err_over_bound"] for w in worst.values()), **timing),
               dtype=label, experts=experts, top_k=top_k, hidden=hidden, intermediate=inter, tokens=worst, **timing)


def _label(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
