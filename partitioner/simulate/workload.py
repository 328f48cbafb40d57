"""The one vocabulary of a workload, shared by the load generator (bench/) and the simulator (partitioner/simulate/):
how long requests are (`LengthDist`) and what latency each must meet (`Slo`). Here, below both in the layering.

Times are seconds (`*_s`) inside; traffic files and the command line take milliseconds (`ttft_ms`, `--slo-ttft`)
and convert where they are read. A lognormal length says which centre it is given by: its `median` (exp(mu)) or
its `mean` (exp(mu + sigma²/2), larger by a factor exp(sigma²/2)).

Each side draws with its own generator, as it always has: bench with a seeded `random.Random` (`sample`), the
simulator with a numpy `Generator` (`draw`), so a seed gives the same requests as before either way.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

import numpy as np

LengthKind = Literal["fixed", "uniform", "lognormal"]
LENGTH_KINDS: tuple[LengthKind, ...] = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    """Token counts of a request's prompt or answer.

    - `fixed`: `value` tokens.
    - `uniform`: `low`..`high`, both included.
    - `lognormal`: log(length) is normal with standard deviation `sigma`, centred by exactly one of `median` or
      `mean` (of the lengths, in tokens); draws are rounded to the nearest integer.
    `low` and `high` (None: no upper bound) clamp every draw.
    """

    kind: LengthKind = "fixed"
    value: int = 256
    low: int = 1
    high: int | None = None
    median: float | None = None
    mean: float | None = None
    sigma: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"unknown length distribution {self.kind!r}; known: {', '.join(LENGTH_KINDS)}")
        if self.low < 1 or (self.high is not None and self.high < self.low):
            raise ValueError(f"lengths need 1 <= low <= high, got low={self.low} high={self.high}")
        if self.kind == "fixed" and self.value < 1:
            raise ValueError(f"fixed lengths need value >= 1, got {self.value}")
        if self.kind == "uniform" and self.high is None:
            raise ValueError("uniform lengths need high (and low, default 1)")
        if self.kind == "lognormal":
            if (self.median is None) == (self.mean is None):
                raise ValueError(f"lognormal lengths need one of median or mean, got median={self.median} "
                                 f"mean={self.mean}")
            centre = self.median if self.median is not None else self.mean
            if not (centre is not None and centre >= 1 and self.sigma >= 0):
                raise ValueError(f"lognormal lengths need a median or mean >= 1 and sigma >= 0, got "
                                 f"{'median' if self.median is not None else 'mean'} {centre}, sigma {self.sigma}")

    def parameters(self) -> dict[str, str | float | int | None]:
        """Its kind and the fields that kind draws by, none of another kind's (a record of it)."""
        own = {"fixed": ("value", "low", "high"), "uniform": ("low", "high"),
               "lognormal": ("median" if self.median is not None else "mean", "sigma", "low", "high")}[self.kind]
        return {"kind": self.kind, **{name: getattr(self, name) for name in own}}

    def _mu(self) -> float:
        """The mean of log(length)."""
        if self.median is not None:
            return math.log(self.median)
        assert self.mean is not None
        return math.log(self.mean) - self.sigma ** 2 / 2

    def _clamp(self, value: int) -> int:
        value = max(value, self.low)
        return value if self.high is None else min(value, self.high)

    def sample(self, rng: random.Random) -> int:
        """One length, drawn from `rng` (bench)."""
        if self.kind == "fixed":
            value = self.value
        elif self.kind == "uniform":
            assert self.high is not None
            value = rng.randint(self.low, self.high)
        else:
            value = round(rng.lognormvariate(self._mu(), self.sigma))
        return self._clamp(value)

    def samples(self, count: int, rng: random.Random) -> list[int]:
        return [self.sample(rng) for _ in range(count)]

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths (int64) drawn from `rng` (the simulator)."""
        if self.kind == "fixed":
            return np.full(n, self._clamp(self.value), dtype=np.int64)
        if self.kind == "uniform":
            assert self.high is not None
            return rng.integers(self.low, self.high + 1, n)
        drawn = np.maximum(self.low, np.rint(rng.lognormal(self._mu(), self.sigma, n)))
        return (drawn if self.high is None else np.minimum(drawn, self.high)).astype(np.int64)

    def expected(self) -> float:
        """The mean length, before clamping."""
        if self.kind == "fixed":
            return float(self.value)
        if self.kind == "uniform":
            assert self.high is not None
            return (self.low + self.high) / 2
        return self.mean if self.mean is not None else math.exp(self._mu() + self.sigma ** 2 / 2)


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives, in seconds: time to first token, and mean time per output token after
    the first. None: not judged."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Whether a request with these times meets every objective given. A request without a first token
        (`ttft_s` None) fails a TTFT objective; one whose TPOT is undefined (`tpot_s` None: an answer of one token)
        passes a TPOT objective."""
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s

    @classmethod
    def from_ms(cls, ttft_ms: float | None, tpot_ms: float | None) -> Slo:
        """The objectives given in milliseconds (a file's `ttft_ms`, the command line's `--slo-ttft`)."""
        return cls(ttft_s=None if ttft_ms is None else ttft_ms / 1e3, tpot_s=None if tpot_ms is None else tpot_ms / 1e3)
