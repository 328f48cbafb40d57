"""What the simulator serves: per model, a request trace (synthetic or replayed) and its SLOs.

Synthetic traffic is a Poisson process (exponential gaps at `rate_per_s`), or a burstier one (gamma gaps of the same
mean with coefficient of variation `arrival_cv` > 1, as vLLM's benchmark `--burstiness` = 1/cv²), with prompt and
output lengths drawn from `workload.LengthDist`s; a replayed one is the requests of a gateway traffic log (the file
`multiserve profile` reads), at their logged start times. Every model's draws come from their own generator seeded
by (seed, model name), so a trace does not change when another model is added, and the same seed gives the same
trace.

A traffic file (YAML or JSON):

    duration_s: 120          # arrivals in [0, duration_s)
    seed: 0
    models:
      chat-a:
        rate_per_s: 4
        arrival_cv: 1        # of the gaps between arrivals: 1 Poisson (default), > 1 bursty
        prompt_tokens: {dist: lognormal, mean: 512, sigma: 0.6}    # or median: instead of mean; low/high clamp
        output_tokens: {dist: uniform, low: 16, high: 256}         # or {dist: fixed, value: 512}
        slo: {ttft_ms: 500, tpot_ms: 50}                           # default 1000 and 100 ms
        calibration: 1.0     # measured / modelled step time (cost.calibration_factor); default 1
        host_ms_per_step: 0  # measured time between two steps off the device (scheduling, output); default 0
      chat-b:
        log: .multiserve/traffic.jsonl   # replay this model's requests from a gateway traffic log
        slo: {ttft_ms: 1000, tpot_ms: 100}
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from partitioner.simulate.workload import LengthDist, Slo

DEFAULT_SLO = Slo(ttft_s=1.0, tpot_s=0.1)  # a model's SLO when its traffic names none (and each objective's default)

LogReader = Callable[[str], Sequence[Mapping[str, Any]]]  # a traffic log's rows: start_s, prompt/output_tokens, model


@dataclass(frozen=True)
class Arrival:
    time_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ModelTraffic:
    """One model's load: Poisson arrivals with drawn lengths, or a replayed `trace` (then the rest is unused)."""

    rate_per_s: float = 1.0
    arrival_cv: float = 1.0  # coefficient of variation of the gaps: 1 is Poisson, larger is burstier
    prompt_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", value=512))
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", value=128))
    slo: Slo = DEFAULT_SLO
    calibration: float = 1.0
    host_s_per_step: float = 0.0  # between a step's end and the next one's start, off the device (measured)
    trace: tuple[Arrival, ...] | None = None

    def offered_tokens_per_s(self, duration_s: float) -> float:
        """Prompt + output tokens per second this load brings (the candidates' by-load shares are made from it)."""
        if self.trace is not None:
            return sum(a.prompt_tokens + a.output_tokens for a in self.trace if a.time_s < duration_s) / duration_s
        return self.rate_per_s * (self.prompt_tokens.expected() + self.output_tokens.expected())


@dataclass(frozen=True)
class Traffic:
    duration_s: float
    models: Mapping[str, ModelTraffic]
    seed: int = 0

    def arrivals(self, model: str) -> list[Arrival]:
        """`model`'s requests in [0, duration_s), in time order (the same list for the same seed)."""
        spec = self.models[model]
        if spec.trace is not None:
            return sorted((a for a in spec.trace if a.time_s < self.duration_s), key=lambda a: a.time_s)
        rng = np.random.default_rng([self.seed, zlib.crc32(model.encode())])
        # enough gaps to pass duration_s with overwhelming probability (ten standard deviations of the count, which
        # grow with the gaps' cv); any past it are dropped
        expected = spec.rate_per_s * self.duration_s
        n = int(expected + 10 * max(1.0, spec.arrival_cv) * math.sqrt(expected + 1) + 10)
        times = np.cumsum(_gaps(rng, spec.rate_per_s, spec.arrival_cv, n)) if spec.rate_per_s > 0 else np.empty(0)
        prompts, outputs = spec.prompt_tokens.draw(rng, n), spec.output_tokens.draw(rng, n)
        return [Arrival(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs, strict=False)
                if t < self.duration_s]


def _gaps(rng: np.random.Generator, rate_per_s: float, cv: float, n: int) -> np.ndarray:
    """`n` gaps of mean 1/rate: exponential (cv 1), else gamma of shape 1/cv² (the same draws as before for cv 1)."""
    if cv == 1.0:
        return rng.exponential(1 / rate_per_s, n)
    shape = 1 / cv**2
    return rng.gamma(shape, 1 / (rate_per_s * shape), n)


def default_traffic(models: Sequence[str], duration_s: float = 60.0, seed: int = 0) -> Traffic:
    """The load when no traffic file is given: `ModelTraffic()`'s defaults for every model."""
    return Traffic(duration_s, {m: ModelTraffic() for m in models}, seed)


_TOP_KEYS = {"duration_s", "seed", "models"}
_MODEL_KEYS = {"rate_per_s", "arrival_cv", "prompt_tokens", "output_tokens", "slo", "calibration", "host_ms_per_step",
               "log"}


def load_traffic(path: str | Path, read_log: LogReader | None = None) -> Traffic:
    """A traffic file (module docstring). `read_log` reads a gateway traffic log a model's `log:` names (relative
    paths from the file's folder). Raises ValueError naming the file, the field and what is wrong."""
    path = Path(path)
    try:
        data = YAML(typ="safe").load(path.read_text())  # JSON is YAML too
    except (OSError, YAMLError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise ValueError(f"{path}: expected an object with `models:` (model name -> traffic)")
    _no_unknown(path, "", data, _TOP_KEYS)
    duration = _number(path, "duration_s", data.get("duration_s", 60.0), positive=True)
    models = {str(name): _model_traffic(path, str(name), entry, read_log) for name, entry in data["models"].items()}
    return Traffic(duration, models, int(data.get("seed", 0)))


def _model_traffic(path: Path, name: str, entry: Any, read_log: LogReader | None) -> ModelTraffic:
    where = f"models.{name}"
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: {where}: expected an object, got {entry!r}")
    _no_unknown(path, where + ".", entry, _MODEL_KEYS)
    slo = _slo(path, f"{where}.slo", entry.get("slo", {}))
    prompt, output = (_lengths(path, f"{where}.{k}", entry[k]) if k in entry else getattr(ModelTraffic(), k)
                      for k in ("prompt_tokens", "output_tokens"))
    trace = None
    if "log" in entry:
        if read_log is None:
            raise ValueError(f"{path}: {where}.log: replaying a traffic log is not available here")
        trace = _trace(path, where, name, read_log(str(path.parent / entry["log"])))
    return ModelTraffic(rate_per_s=_number(path, f"{where}.rate_per_s", entry.get("rate_per_s", 1.0)),
                        arrival_cv=_number(path, f"{where}.arrival_cv", entry.get("arrival_cv", 1.0), positive=True),
                        prompt_tokens=prompt, output_tokens=output, slo=slo, trace=trace,
                        calibration=_number(path, f"{where}.calibration", entry.get("calibration", 1.0),
                                            positive=True),
                        host_s_per_step=_number(path, f"{where}.host_ms_per_step",
                                                entry.get("host_ms_per_step", 0.0)) / 1e3)


_SLO_KEYS = {"ttft_ms", "tpot_ms"}
_LENGTH_KEYS = {"dist", "value", "low", "high", "median", "mean", "sigma"}


def _slo(path: Path, where: str, entry: Any) -> Slo:
    """A model's `slo:` (milliseconds); an objective it leaves out is `DEFAULT_SLO`'s."""
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: {where}: expected an object with ttft_ms and/or tpot_ms, got {entry!r}")
    _no_unknown(path, where + ".", entry, _SLO_KEYS)
    defaults = {"ttft_ms": DEFAULT_SLO.ttft_s, "tpot_ms": DEFAULT_SLO.tpot_s}
    ttft_s, tpot_s = (_number(path, f"{where}.{k}", entry[k]) / 1e3 if k in entry else defaults[k]
                      for k in ("ttft_ms", "tpot_ms"))
    return Slo(ttft_s=ttft_s, tpot_s=tpot_s)


def _lengths(path: Path, where: str, entry: Any) -> LengthDist:
    """`{dist: fixed, value: N}`, `{dist: uniform, low: A, high: B}` or `{dist: lognormal, mean|median: M, sigma:
    S}` (tokens; `low`/`high` clamp any of them). `dist` defaults to fixed, a fixed value to 256 tokens."""
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: {where}: expected an object such as {{dist: fixed, value: 256}}, got {entry!r}")
    _no_unknown(path, where + ".", entry, _LENGTH_KEYS)
    fields = {("kind" if k == "dist" else str(k)): v for k, v in entry.items()}
    try:
        return LengthDist(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {where}: {exc}") from None


def _trace(path: Path, where: str, model: str, rows: Sequence[Mapping[str, Any]]) -> tuple[Arrival, ...]:
    mine = [r for r in rows if r.get("model") == model]
    if not mine:
        raise ValueError(f"{path}: {where}.log: no request of model {model!r} in the log "
                         f"(it has {sorted({str(r.get('model')) for r in rows})})")
    first = min(float(r["start_s"]) for r in mine)
    return tuple(Arrival(float(r["start_s"]) - first, max(1, int(r["prompt_tokens"])), max(1, int(r["output_tokens"])))
                 for r in mine)


def _number(path: Path, where: str, value: Any, positive: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not ok or (positive and value == 0):
        raise ValueError(f"{path}: {where}: expected a {'positive' if positive else 'non-negative'} number, "
                         f"got {value!r}")
    return float(value)


def _no_unknown(path: Path, where: str, entry: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(entry) - allowed
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {sorted(where + str(k) for k in unknown)}; known: "
                         f"{sorted(allowed)}")
