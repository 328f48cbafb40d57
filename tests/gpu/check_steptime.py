"""Decode step time of our engine against the HBM floor, bf16 (run by tests/gpu/run.sh).

For the SmolLM2-135M shape and the full Llama-3-8B shape (all 32 layers, ~16 GB of bf16 weights) with random
weights: `batch` requests of a 64-token prompt are prefilled, then `LLMEngine.step()` is timed over decode steps
(wall clock, so the scheduler, the Python launch overhead and sampling count) at batch 1, 8 and 64, once with
the decode steps replayed from CUDA graphs and launched ahead of the previous step's readback (the engine's
defaults; every timed step must be a replay), once with graphs but no overlap (`no_overlap_step_ms`) and once
eagerly (`eager_step_ms`), side by side.

The floor is the weight bytes one decode step must read (every layer, the final norm and the LM head; not the
embedding table, of which a step reads only its tokens' rows) divided by the device-to-device copy bandwidth
measured here with a 1 GiB torch copy. `floor_with_kv_ms` adds the KV cache the step reads at its context length.
A row passes when it was measured, is not faster than 0.8x the floor (faster means the measurement is wrong), and
the three modes produced the same greedy tokens for the same prompts (recorded in the row, per mode). The table
goes into `$OUT/summary.json` as `decode_step_table`.

`copy_bandwidth` must be plausible for the device (`verdicts.copy_bandwidth_verdict`): between half and 1.1x the
theoretical bandwidth torch (else NVML) reports, or at least a datacenter GPU's minimum where neither does.

`--device cpu`: two tiny shapes on CPU (fp32), to try the script without a GPU; the bandwidth and the times are
reported, not judged, and the modes must still agree.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

from tests.gpu.common import Reporter, Shape, copy_bandwidth_gbs, fmt, parse_args, synchronize

ARGS = parse_args(__doc__ or "")
DEVICE = ARGS.device
os.environ["TRITON_INTERPRET"] = "1" if DEVICE == "cpu" else "0"

import torch  # noqa: E402

from runtimes.llm.attention import select_attention  # noqa: E402
from runtimes.llm.config import EngineConfig, ModelConfig  # noqa: E402
from runtimes.llm.engine import LLMEngine  # noqa: E402
from runtimes.llm.loader import LoadedModel  # noqa: E402
from runtimes.llm.model import LlamaForCausalLM  # noqa: E402
from runtimes.llm.outputs import RequestOutput  # noqa: E402
from runtimes.llm.sampling_params import SamplingParams  # noqa: E402
from runtimes.llm.tokenizer import Tokenizer  # noqa: E402
from tests.gpu.verdicts import copy_bandwidth_verdict, first_disagreement, peak_bandwidth_gbs  # noqa: E402
from tests.runtimes.llm.tiny import tokenizer_metadata  # noqa: E402

BATCHES = (1, 8, 64)
PROMPT_LEN = 64
WARMUP_STEPS = 3
TIMED_STEPS = 20 if DEVICE == "cuda" else 5
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32

SHAPES = {
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, True),
    "llama3-8b": Shape(4096, 32, 32, 8, 14336, 128256, False),
} if DEVICE == "cuda" else {
    "tiny-tied": Shape(64, 2, 4, 2, 128, 512, True),
    "tiny-untied": Shape(128, 3, 4, 1, 256, 1024, False),
}


def build(shape: Shape) -> LoadedModel:
    """Our model with random weights made on the device (the loader's steps, without a checkpoint)."""
    device = torch.device(DEVICE)
    config = ModelConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                         head_dim=shape.hidden // shape.heads, max_position_embeddings=4096,
                         tie_word_embeddings=shape.tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, select_attention("auto", device))
    model = model.to_empty(device=device).to(DTYPE)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5, generator=gen)
            else:
                param.normal_(0.0, 2 / math.sqrt(shape.hidden), generator=gen)
    model.rotary.rebuild(device)
    model = model.eval().requires_grad_(False)
    meta = dict(tokenizer_metadata())
    tokens = list(meta["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
    types = list(meta["tokenizer.ggml.token_type"])  # type: ignore[call-overload]
    meta["tokenizer.ggml.tokens"] = tokens + [f"<t{i}>" for i in range(len(tokens), shape.vocab)]
    meta["tokenizer.ggml.token_type"] = types + [1] * (shape.vocab - len(types))
    return LoadedModel(model=model, config=config, tokenizer=Tokenizer.from_gguf_metadata(meta), name="random")


def step_bytes(model: LlamaForCausalLM) -> int:
    """Weight bytes a decode step reads: all parameters but the embedding table (only its rows are read), plus
    the LM head, which is that table when tied."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens.weight")
    if model.lm_head is None:
        total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


@dataclass(frozen=True)
class DecodeRun:
    times_ms: list[float]  # wall time of each timed decode step
    context: int  # the context length the timed steps reached
    replays: int  # how many timed steps were graph replays
    tokens: dict[str, list[int]]  # request id -> every token it was given (prefill, warm-up and timed steps)


def decode_steps(loaded: LoadedModel, batch: int, cuda_graphs: bool, overlap: bool = True) -> DecodeRun:
    """TIMED_STEPS pure decode steps at `batch`, greedy, over the same prompts for every mode."""
    config = loaded.config
    steps = WARMUP_STEPS + TIMED_STEPS
    tokens = batch * (PROMPT_LEN + steps + 16)
    engine = LLMEngine(loaded, EngineConfig(block_size=16, max_num_seqs=max(BATCHES),
                                            max_num_batched_tokens=max(PROMPT_LEN * max(BATCHES), 2048),
                                            kv_cache_bytes=tokens * config.kv_bytes_per_token(DTYPE),
                                            enable_prefix_caching=False, cuda_graphs=cuda_graphs,
                                            overlap_steps=overlap))
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    produced: dict[str, list[int]] = {}
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(3, config.vocab_size) for _ in range(PROMPT_LEN)], params)
        produced[f"r{i}"] = []

    def record(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            produced[out.request_id] += out.new_token_ids

    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        record(engine.step())  # prefill (all prompts fit one step's token budget)
    for _ in range(WARMUP_STEPS):
        record(engine.step())
    graphs = engine.runner.graphs
    replays_before = graphs.replays if graphs is not None else 0
    times = []
    for _ in range(TIMED_STEPS):
        synchronize(DEVICE)
        start = time.perf_counter()
        outputs = engine.step()
        synchronize(DEVICE)
        times.append((time.perf_counter() - start) * 1e3)
        record(outputs)  # outside the timing
        assert len(outputs) == batch, f"a decode step gave {len(outputs)} outputs for {batch} requests"
    context = PROMPT_LEN + WARMUP_STEPS + TIMED_STEPS
    for i in range(batch):
        engine.abort_request(f"r{i}")
    return DecodeRun(times, context, (graphs.replays if graphs is not None else 0) - replays_before, produced)


def device_peak_bandwidth() -> tuple[float | None, str]:
    """The device's theoretical memory bandwidth (GB/s) and where it came from: torch's device properties, else
    NVML (the same device, by UUID); None where neither reports it."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    peak = peak_bandwidth_gbs(getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0))
    if peak is not None:
        return peak, "torch"
    uuid = getattr(props, "uuid", None)  # an older torch may lack it: then no NVML either
    if uuid is None:
        return None, "torch reports neither the memory clock nor the device UUID"
    try:
        import pynvml
    except ImportError as error:
        return None, f"no pynvml: {error}"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return None, f"no NVML: {error}"
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        peak = peak_bandwidth_gbs(clock_mhz * 1000, pynvml.nvmlDeviceGetMemoryBusWidth(handle))
        return peak, "nvml" if peak is not None else "nvml reports no memory clock or bus width"
    except pynvml.NVMLError as error:
        return None, f"NVML: {error}"
    finally:
        pynvml.nvmlShutdown()


def check_copy_bandwidth(rep: Reporter) -> float:
    """The copy bandwidth every floor here divides by, and whether it is plausible for the device."""
    bandwidth = copy_bandwidth_gbs(DEVICE)
    peak, source = device_peak_bandwidth() if DEVICE == "cuda" else (None, "cpu")
    verdict = copy_bandwidth_verdict(bandwidth, peak, DEVICE)
    rep.report("copy_bandwidth", verdict.ok, fmt(gbs=bandwidth, peak_gbs=peak, peak_from=source) + f" ({verdict.why})",
               gbs=bandwidth, peak_gbs=peak, peak_from=source, judged=verdict.judged)
    return bandwidth


def main() -> int:
    rep = Reporter("steptime", ARGS.out)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        rep.report("cuda_available", False, "torch sees no CUDA device")
        return rep.exit_code()
    bandwidth = check_copy_bandwidth(rep)
    for name, shape in SHAPES.items():
        def run(name: str = name, shape: Shape = shape) -> None:
            loaded = build(shape)
            weight_bytes = step_bytes(loaded.model)
            floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
            for batch in BATCHES:
                runs = {"eager": decode_steps(loaded, batch, cuda_graphs=False),
                        "no_overlap": decode_steps(loaded, batch, cuda_graphs=True, overlap=False),
                        "default": decode_steps(loaded, batch, cuda_graphs=True)}
                times, context, replays = runs["default"].times_ms, runs["default"].context, runs["default"].replays
                step_ms, eager_ms = statistics.median(times), statistics.median(runs["eager"].times_ms)
                serial_ms = statistics.median(runs["no_overlap"].times_ms)
                kv_bytes = batch * context * loaded.config.kv_bytes_per_token(DTYPE)
                floor_kv_ms = (weight_bytes + kv_bytes) / (bandwidth * 1e9) * 1e3
                # greedy over the same prompts: graphs and overlap change how a step is launched, not what it computes
                tokens_differ = first_disagreement({mode: run.tokens for mode, run in runs.items()})
                # on a GPU every timed step must be one graph replay (the engine's launches per decode step)
                ok = tokens_differ is None and math.isfinite(step_ms) and (
                    DEVICE == "cpu" or (step_ms >= 0.8 * floor_ms and replays == TIMED_STEPS))
                rep.report(f"{name}.b{batch}", ok,
                           fmt(step_ms=step_ms, floor_ms=floor_ms, ratio=step_ms / floor_ms, eager_ms=eager_ms,
                               no_overlap_ms=serial_ms, graph_replays=f"{replays}/{TIMED_STEPS}",
                               tokens_per_s=batch / step_ms * 1e3, tokens="same" if tokens_differ is None else "differ")
                           + ("" if tokens_differ is None else f" ({tokens_differ})"),
                           table="decode_step", model=name, dtype=str(DTYPE).removeprefix("torch."), batch=batch,
                           layers=shape.layers, context=context, step_ms=step_ms, step_ms_min=min(times),
                           step_ms_max=max(times), weight_bytes=weight_bytes, copy_gbs=bandwidth, floor_ms=floor_ms,
                           floor_with_kv_ms=floor_kv_ms, ratio_to_floor=step_ms / floor_ms,
                           tokens_per_s=batch / step_ms * 1e3, eager_step_ms=eager_ms, no_overlap_step_ms=serial_ms,
                           graph_speedup=eager_ms / step_ms, graph_replays=replays, timed_steps=TIMED_STEPS,
                           tokens_differ=tokens_differ,
                           tokens={mode: [" ".join(map(str, ids)) for ids in run.tokens.values()]
                                   for mode, run in runs.items()})
            del loaded
            if DEVICE == "cuda":
                torch.cuda.empty_cache()

        rep.guarded(name, run)
    return rep.exit_code()


if __name__ == "__main__":
    sys.exit(main())
