"""Our model and engine against transformers on the GPU, with random weights in real models' shapes.

Shapes: SmolLM2-135M (hidden 576, 30 layers, 9 heads, 3 KV heads, head 64, intermediate 1536, vocab 49152, tied
embeddings) and Llama-3-8B cut to 4 of its 32 layers (hidden 4096, 32 heads, 8 KV heads, head 128, intermediate
14336, vocab 128256, untied): every per-layer kernel shape of the real model, at an eighth of the weights. For
each shape, transformers' LlamaForCausalLM in fp32 is the truth, and in fp32 and bf16:

* `logits`: our model (paged KV cache, the Triton attention the engine selects on CUDA) over prompt + continuation,
  fed as a chunked prefill of the prompts together and then one batched decode step per token, against the fp32
  truth on the same tokens. fp32: max error <= 2e-3 x the logits' std. bf16: no more than twice the error of
  transformers' own bf16 model (max and mean) plus 2e-3 (2e-4) x std.
* `fp8_kv.logits` (bf16 only): the same logits with an fp8 (e4m3) KV cache, `kv_dtype: fp8`: mean error at most
  16x the bf16 cache's plus 2e-3 x std. The bound is derived, not calibrated: e4m3 keeps 3 mantissa bits to bf16's
  7, so its rounding of K and V is at most 16x coarser (the CPU's tiny shapes give 3.7x and 4.3x); the max error
  and argmax agreement are reported.
* `graphs`: the same engine with its decode steps replayed from CUDA graphs (the default) and run eagerly
  (`cuda_graphs=False`), greedy and seeded requests (temperature 1, the noise drawn on the device) in one run each:
  token-identical, and at least NEW_TOKENS - 1 steps replayed (on `--device cpu` through the tests' CPU stand-in
  for a graph, so the dry run checks replays too). Two engines per shape and dtype, one capturing graphs.
* `greedy`: our LLMEngine (scheduler, chunked prefill, sampler) decoding the prompts together, greedy, against
  transformers' `generate` in the same dtype. Token-exact, except that where the two first differ the truth must
  call it a near-tie: the two tokens' fp32 logits closer than the sum of the two models' 99.9th-percentile logit
  errors measured above (ours capped at what the logits criterion allows; plus 1e-4 x std).

* `deterministic` (bf16, the first shape): `engine.deterministic: true` (runtimes/llm/batch_invariant.py): each
  prompt's greedy tokens alone equal its tokens among the others, and the run's time against the default kernels'.
* `families.mistral`, `families.qwen3_moe`, `experts.<dtype>` (tests/gpu/family_parity.py): a windowed dense family
  and a mixture of experts, tiny checkpoints from Hugging Face directories, run by the engine (Triton attention,
  decode graphs) against transformers on the same device in fp32, token-exact and by logprobs; the experts' grouped
  GEMM against the per-expert loop.

Weights are N(0, (2 / sqrt(hidden))^2) (logits of std ~2, few near-ties) with norm weights in [0.5, 1.5], as in
tests/runtimes/llm/tiny.py. `--device cpu`: two tiny shapes on CPU, to try the script without a GPU.
"""

from __future__ import annotations

import copy
import math
import os
import random
import sys
import time

from tests.gpu.common import Reporter, Shape, fmt, parse_args, timed

ARGS = parse_args(__doc__ or "")
DEVICE = ARGS.device
os.environ["TRITON_INTERPRET"] = "1" if DEVICE == "cpu" else "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from runtimes.llm.attention import AttentionMetadata, select_attention  # noqa: E402
from runtimes.llm.config import EngineConfig, ModelConfig  # noqa: E402
from runtimes.llm.engine import LLMEngine  # noqa: E402
from runtimes.llm.loader import LoadedModel, load_state_dict  # noqa: E402
from runtimes.llm.model_runner import allocate_kv_caches  # noqa: E402
from runtimes.llm.sampling_params import SamplingParams  # noqa: E402
from runtimes.llm.tokenizer import Tokenizer  # noqa: E402
from tests.gpu.family_parity import check_families  # noqa: E402
from tests.runtimes.llm.engine_utils import ReplayingGraph, run_to_completion  # noqa: E402
from tests.runtimes.llm.tiny import tokenizer_metadata  # noqa: E402

START = time.monotonic()
TIME_LIMIT_S = float(os.environ.get("GPU_CHECK_TIMEOUT_S") or "inf")  # what run.sh gives the check
# the families part's time and a margin: ~30 s on two CPU cores under the interpreter (run.sh doubles the caps
# there), its Triton compiles and graph captures on a GPU
FAMILIES_S = 40 if DEVICE == "cuda" else 80
BLOCK_SIZE = 16
FP8_KV_ERROR_RATIO = 16  # 2 ** (7 - 3): bf16's mantissa bits against e4m3's




if DEVICE == "cuda":
    SHAPES = {
        "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, True, 100000.0),
        "llama3-8b-4layers": Shape(4096, 4, 32, 8, 14336, 128256, False, 500000.0),
    }
    PROMPT_LENS, NEW_TOKENS, BATCHED_TOKENS = [5, 40, 130, 300], 32, 256
else:
    SHAPES = {
        "tiny-tied": Shape(64, 2, 4, 2, 128, 512, True, 10000.0, 512),
        "tiny-untied": Shape(128, 3, 4, 1, 256, 1024, False, 500000.0, 512),
    }
    PROMPT_LENS, NEW_TOKENS, BATCHED_TOKENS = [5, 23, 40], 12, 32


def reference_model(shape: Shape, seed: int = 0) -> torch.nn.Module:
    """transformers' LlamaForCausalLM with random weights, fp32, eval mode, made on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions, rms_norm_eps=1e-5, rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tied, initializer_range=2 / math.sqrt(shape.hidden), bos_token_id=None,
        eos_token_id=None, pad_token_id=0, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # random norms, so a wrong norm mapping cannot hide behind all-ones weights
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy with its parameters in `dtype` and its buffers (RoPE's inv_freq) left in fp32, as `from_pretrained`
    with a dtype loads it (`.to(dtype)` would round inv_freq too)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for param in model.parameters():  # each once: tied embeddings stay tied
            param.data = param.data.to(dtype)
    return model


def tokenizer_for(vocab: int) -> Tokenizer:
    """The tiny models' byte-level tokenizer, padded with plain tokens to the model's vocabulary, so every id the
    model can produce detokenizes."""
    meta = dict(tokenizer_metadata())
    tokens = list(meta["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
    types = list(meta["tokenizer.ggml.token_type"])  # type: ignore[call-overload]
    meta["tokenizer.ggml.tokens"] = tokens + [f"<t{i}>" for i in range(len(tokens), vocab)]
    meta["tokenizer.ggml.token_type"] = types + [1] * (vocab - len(types))
    return Tokenizer.from_gguf_metadata(meta)


def ours(ref: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.nn.Module, ModelConfig]:
    """Our model with the reference's weights (through the loader's fusing), with the attention the engine picks."""
    device = torch.device(DEVICE)
    config = ModelConfig.from_hf_config(ref.config.to_dict())
    model = load_state_dict(config, ref.state_dict().items(), device, dtype, select_attention("auto", device))
    return model, config


@torch.inference_mode()
def paged_logits(model: torch.nn.Module, config: ModelConfig, seqs: list[list[int]], prompt_lens: list[int],
                 dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Logits [len, V] (fp32) of each sequence at every position: the prompts' first halves in one packed step,
    their second halves (chunked prefill over a cached prefix) in the next, then one batched decode step per
    continuation token. Block tables are shuffled."""
    total = sum(-(-len(s) // BLOCK_SIZE) for s in seqs)
    caches = allocate_kv_caches(config, total + 4, BLOCK_SIZE, kv_dtype or dtype, torch.device(DEVICE))
    perm = torch.randperm(total + 4, generator=torch.Generator().manual_seed(1)).tolist()
    tables, start = [], 0
    for s in seqs:
        n = -(-len(s) // BLOCK_SIZE)
        tables.append(perm[start : start + n])
        start += n
    bounds = [[0, max(1, p // 2), p, *range(p + 1, len(s) + 1)] for s, p in zip(seqs, prompt_lens, strict=True)]
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(len(bounds[0]) - 1):
        spans = [(b[step], b[step + 1]) for b in bounds]
        ids = torch.tensor([t for s, (lo, hi) in zip(seqs, spans, strict=True) for t in s[lo:hi]], device=DEVICE)
        pos = torch.tensor([p for lo, hi in spans for p in range(lo, hi)], device=DEVICE)
        meta = AttentionMetadata.build([hi - lo for lo, hi in spans], [hi for _, hi in spans], tables, BLOCK_SIZE,
                                       DEVICE)
        logits = model.compute_logits(model(ids, pos, caches, meta)).float()
        for i, part in enumerate(logits.split([hi - lo for lo, hi in spans])):
            out[i].append(part)
    return [torch.cat(parts) for parts in out]


@torch.no_grad()
def hf_logits(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    return model(torch.tensor([seq], device=DEVICE)).logits[0].float()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return list(out[0, len(prompt) :].tolist())


def engine_tokens(model: torch.nn.Module, config: ModelConfig, name: str, prompts: list[list[int]],
                  graphs: bool) -> tuple[list[list[int]], list[list[int]], int]:
    """The engine's tokens for each prompt, greedy and seeded (temperature 1, seed 7: the noise drawn on the device),
    both in one run, and how many decode steps it ran as graph replays (-1: it captured none). `graphs`: decode steps
    replayed from graphs (CUDA graphs; on `--device cpu` the tests' CPU stand-in, so the dry run replays too), else
    eager. One engine per mode, its buckets up to the 2 x prompts it holds: each graph-mode engine captures and warms
    up every bucket."""
    loaded = LoadedModel(model=model, config=config, tokenizer=tokenizer_for(config.vocab_size), name=name)
    kv_bytes = 2 * 4096 * config.kv_bytes_per_token(next(model.parameters()).dtype)
    new_graph = ReplayingGraph if graphs and DEVICE == "cpu" else None
    engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=2 * len(prompts),
                                            kv_cache_bytes=kv_bytes, max_num_batched_tokens=BATCHED_TOKENS,
                                            cuda_graphs=graphs), new_graph=new_graph)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    done = run_to_completion(engine, {f"g{i}": (p, greedy) for i, p in enumerate(prompts)}
                             | {f"s{i}": (p, seeded) for i, p in enumerate(prompts)})
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
    replays = engine.runner.graphs.replays if engine.runner.graphs is not None else -1  # -1: none captured
    return ([done[f"g{i}"].token_ids for i in range(len(prompts))],
            [done[f"s{i}"].token_ids for i in range(len(prompts))], replays)


def errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    """Over all positions of all sequences: max, mean and 99.9th percentile (of a 1M sample) of the absolute
    error, and how often the argmax agrees."""
    g, w = torch.cat(got), torch.cat(want)
    diff = (g - w).abs().flatten()
    sample = diff[torch.randint(diff.numel(), (1 << 20,), generator=torch.Generator().manual_seed(0)).to(diff.device)]
    return {"max": diff.max().item(), "mean": diff.mean().item(), "p999": torch.quantile(sample, 0.999).item(),
            "argmax_agree": (g.argmax(-1) == w.argmax(-1)).float().mean().item()}


def compare_greedy(truth: torch.nn.Module, prompts: list[list[int]], got: list[list[int]], want: list[list[int]],
                   tol: float) -> tuple[bool, list[dict]]:
    """Token-exact, or the first difference is a near-tie under the fp32 truth (logit gap <= tol)."""
    ok, rows = True, []
    for i, (prompt, a, b) in enumerate(zip(prompts, got, want, strict=True)):
        if a == b:
            rows.append({"prompt": i, "equal": True, "tokens": len(a)})
            continue
        j = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        row: dict[str, object] = {"prompt": i, "equal": False, "first_difference": j, "ours_len": len(a),
                                  "ref_len": len(b)}
        if j < min(len(a), len(b)):
            last = hf_logits(truth, prompt + a[:j])[-1]
            gap = abs(last[a[j]].item() - last[b[j]].item())
            row.update(ours_token=a[j], ref_token=b[j], truth_gap=gap, tol=tol, near_tie=gap <= tol)
            ok = ok and gap <= tol
        else:  # one stopped early: never a near-tie
            ok = False
        rows.append(row)
    return ok, rows


def check_shape(rep: Reporter, name: str, shape: Shape) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, shape.vocab) for _ in range(n)] for n in PROMPT_LENS]
    with timed() as t:
        truth = reference_model(shape)
    print(f"# {name}: reference built in {t['s']:.1f} s", file=sys.stderr, flush=True)
    want32 = [hf_greedy(truth, p) for p in prompts]
    seqs = [p + w for p, w in zip(prompts, want32, strict=True)]
    truth_logits = [hf_logits(truth, s) for s in seqs]
    scale = torch.cat(truth_logits).std().item()
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        hf = truth if dtype == torch.float32 else cast_parameters(truth, dtype)
        model, config = ours(truth, dtype)
        got = paged_logits(model, config, seqs, PROMPT_LENS, dtype)
        err = errors(got, truth_logits)
        del got
        if dtype == torch.float32:
            hf_err = {"max": 0.0, "mean": 0.0, "p999": 0.0, "argmax_agree": 1.0}
            ok = err["max"] <= 2e-3 * scale
        else:
            hf_err = errors([hf_logits(hf, s) for s in seqs], truth_logits)
            ok = err["max"] <= 2 * hf_err["max"] + 2e-3 * scale and err["mean"] <= 2 * hf_err["mean"] + 2e-4 * scale
        rep.report(f"{name}.{label}.logits", ok,
                   fmt(max_err=err["max"], mean_err=err["mean"], hf_max_err=hf_err["max"],
                       hf_mean_err=hf_err["mean"], logit_std=scale, argmax_agree=err["argmax_agree"],
                       hf_argmax_agree=hf_err["argmax_agree"]),
                   shape=shape.__dict__, dtype=label, ours_vs_fp32_truth=err, hf_vs_fp32_truth=hf_err,
                   logit_std=scale, positions=sum(len(s) for s in seqs))
        if dtype == torch.bfloat16:  # `kv_dtype: fp8` (e4m3, unscaled) under the bf16 model
            fp8 = errors(paged_logits(model, config, seqs, PROMPT_LENS, dtype, torch.float8_e4m3fn), truth_logits)
            # e4m3 keeps 3 mantissa bits to bf16's 7: its rounding of K and V is at most 16x coarser, so the error
            # it adds is at most 16x the bf16 cache's whole error (which includes the bf16 cache's rounding)
            rep.report(f"{name}.bf16.fp8_kv.logits", fp8["mean"] <= FP8_KV_ERROR_RATIO * err["mean"] + 2e-3 * scale,
                       fmt(max_err=fp8["max"], mean_err=fp8["mean"], bf16_kv_mean_err=err["mean"],
                           argmax_agree=fp8["argmax_agree"], bf16_kv_argmax_agree=err["argmax_agree"]),
                       dtype="bf16", kv_dtype="fp8_e4m3", ours_vs_fp32_truth=fp8, bf16_kv_vs_fp32_truth=err)
        want = want32 if dtype == torch.float32 else [hf_greedy(hf, p) for p in prompts]
        # the decode graphs against the same engine run eagerly: token-identical, greedy and seeded (the noise drawn
        # on the device), and every decode step after the last prompt's prefill replayed
        got_tokens, seeded, replays = engine_tokens(model, config, name, prompts, graphs=True)
        eager_tokens, seeded_eager, _ = engine_tokens(model, config, name, prompts, graphs=False)
        same = sum(1 for a, b in zip(got_tokens, eager_tokens, strict=True) if a == b)
        same_seeded = sum(1 for a, b in zip(seeded, seeded_eager, strict=True) if a == b)
        replayed = replays >= NEW_TOKENS - 1
        if replays < 0 and DEVICE == "cpu":
            rep.skip(f"{name}.{label}.graphs", "no decode graphs on the CPU in bf16 (the CPU attention kernel is fp32 "
                     "only; the reference it hands bf16 to reads host metadata, which a graph would bake in)")
        else:
            rep.report(f"{name}.{label}.graphs", same == same_seeded == len(prompts) and replayed,
                       fmt(identical_greedy=f"{same}/{len(prompts)}",
                           identical_seeded=f"{same_seeded}/{len(prompts)}", graph_replays=replays),
                       dtype=label, identical=same, identical_seeded=same_seeded, prompts=len(prompts),
                       graph_replays=replays)
        # A flip needs the two models' errors on the two tokens to bridge the truth's gap between them; ours counts
        # only up to what the logits criterion allows, so a broken model cannot widen its own tolerance.
        allowed = 2e-3 * scale if dtype == torch.float32 else 2 * hf_err["p999"] + 2e-3 * scale
        tol = min(err["p999"], allowed) + hf_err["p999"] + 1e-4 * scale
        ok, rows = compare_greedy(truth, prompts, got_tokens, want, tol)
        exact = sum(1 for r in rows if r["equal"])
        rep.report(f"{name}.{label}.greedy", ok,
                   fmt(exact_prompts=f"{exact}/{len(prompts)}", new_tokens=NEW_TOKENS, tie_tol=tol),
                   dtype=label, prompts=rows, prompt_lens=PROMPT_LENS, new_tokens=NEW_TOKENS)
        # one shape, for time; last, since it puts the model on the batch-invariant kernels
        if dtype == torch.bfloat16 and name == next(iter(SHAPES)):
            check_deterministic(rep, f"{name}.bf16.deterministic", model, config, name, prompts)
        del model, hf
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def check_deterministic(rep: Reporter, check: str, model: torch.nn.Module, config: ModelConfig, name: str,
                        prompts: list[list[int]]) -> None:
    """`engine.deterministic`: each prompt's greedy tokens alone equal its tokens among the others (graphs on), and
    how much longer the run takes than without (the fixed-tile kernels' cost). On `--device cpu` the model gets the
    Triton attention (the CPU kernel path refuses dense weights), run by the interpreter."""
    loaded = LoadedModel(model=model, config=config, tokenizer=tokenizer_for(config.vocab_size), name=name)
    if DEVICE == "cpu":
        from runtimes.llm.attention.triton_paged import paged_attention_triton

        model.set_attention(paged_attention_triton)
    kv_bytes = 2 * 4096 * config.kv_bytes_per_token(torch.bfloat16)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seconds: dict[bool, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    for deterministic in (False, True):
        engine = LLMEngine(loaded, EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=len(prompts),
                                                kv_cache_bytes=kv_bytes, max_num_batched_tokens=BATCHED_TOKENS,
                                                deterministic=deterministic, enable_prefix_caching=False))
        with timed() as t:
            done = run_to_completion(engine, {f"p{i}": (p, greedy) for i, p in enumerate(prompts)})
        seconds[deterministic] = t["s"]
        if deterministic:
            tokens["batched"] = [done[f"p{i}"].token_ids for i in range(len(prompts))]
            tokens["alone"] = [run_to_completion(engine, {"one": (p, greedy)})["one"].token_ids for p in prompts]
    same = sum(1 for a, b in zip(tokens["alone"], tokens["batched"], strict=True) if a == b)
    rep.report(check, same == len(prompts),
               fmt(identical=f"{same}/{len(prompts)}", seconds=seconds[True], default_seconds=seconds[False]),
               identical=same, prompts=len(prompts), seconds=seconds[True], default_seconds=seconds[False],
               tokens=tokens)


def main() -> int:
    rep = Reporter("model", ARGS.out)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        rep.report("cuda_available", False, "torch sees no CUDA device")
        return rep.exit_code()
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32 (no TF32) for both models
    for name, shape in SHAPES.items():
        rep.guarded(name, lambda n=name, s=shape: check_shape(rep, n, s))
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    # Mistral's window and Qwen3-MoE's experts, tiny (tests/gpu/family_parity.py): last, and only with the time they
    # need left, so that they can never make the shapes above time out
    left = TIME_LIMIT_S - (time.monotonic() - START)
    if left < FAMILIES_S:
        rep.skip("families", f"{left:.0f} s left of the check's {TIME_LIMIT_S:.0f} s, the families need {FAMILIES_S} s")
    else:
        check_families(rep, DEVICE)
    return rep.exit_code()


if __name__ == "__main__":
    sys.exit(main())
