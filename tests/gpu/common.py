"""What the GPU checks share: the device switch, one `PASS name ...` / `FAIL name ...` line per result on stdout
(`SKIP name reason` for one that cannot run here), and the same result as a JSON line appended to
`$OUT/<group>.jsonl` (tests/gpu/summarize.py gathers them).

Results are written as they happen, so a check stopped by its timeout still leaves what it had found. SIGTERM
(what `timeout` sends first) raises SystemExit, so `finally` blocks still stop the processes and daemons a
check started.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEVICE_ENV = "GPU_CHECK_DEVICE"


def parse_args(description: str, add: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """`--device cuda` (default, or $GPU_CHECK_DEVICE): the real shapes on the GPU; `--device cpu`: tiny shapes, to
    try a check end to end without a GPU. `--out`: the results folder ($OUT, else ./gpu-results)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=os.environ.get(DEVICE_ENV, "cuda"),
                        help="cuda: real shapes on the GPU; cpu: tiny shapes, a dry run without a GPU")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-results")))
    if add is not None:
        add(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "tolist"):  # tensors, numpy values
        return value.tolist()
    return str(value)


def fmt(**values: Any) -> str:
    """`k=v` pairs for a result line, floats to 4 significant digits."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


class Reporter:
    """Results of one check script (a group): printed, and appended to `<out>/<group>.jsonl`."""

    def __init__(self, group: str, out: Path) -> None:
        self.group = group
        self.path = out / f"{group}.jsonl"
        self.path.write_text("")
        self.failed: list[str] = []
        self.passed = 0
        self.skipped = 0

    def report(self, name: str, ok: bool, summary: str = "", **data: Any) -> None:
        full = f"{self.group}.{name}"
        print(f"{'PASS' if ok else 'FAIL'} {full}{' ' + summary if summary else ''}", flush=True)
        self._write({"name": full, "ok": bool(ok), "summary": summary, **data})
        if ok:
            self.passed += 1
        else:
            self.failed.append(full)

    def skip(self, name: str, reason: str, **data: Any) -> None:
        """A check that cannot run here, and why: `SKIP name reason`; summarize.py lists it, with its reason, as
        neither passed nor failed."""
        full = f"{self.group}.{name}"
        print(f"SKIP {full} {reason}", flush=True)
        self._write({"name": full, "ok": True, "skipped": reason, "summary": reason, **data})
        self.skipped += 1

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, default=_jsonable) + "\n")

    def guarded(self, name: str, check: Callable[[], None]) -> None:
        """Run `check`; an exception is a failed result named `name` (the other checks still run)."""
        try:
            check()
        except Exception as exc:
            self.report(name, False, f"{type(exc).__name__}: {str(exc)[:300]}",
                        traceback=traceback.format_exc()[-6000:])

    def exit_code(self) -> int:
        print(f"# {self.group}: {self.passed} passed, {len(self.failed)} failed, {self.skipped} skipped",
              file=sys.stderr, flush=True)
        return 1 if self.failed else 0


@contextmanager
def timed() -> Iterator[dict[str, float]]:
    """`with timed() as t: ...`; then t["s"] holds the elapsed seconds."""
    result = {"s": float("nan")}
    start = time.perf_counter()
    try:
        yield result
    finally:
        result["s"] = time.perf_counter() - start


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, iters: int = 50, reps: int = 5, warmup: int = 5) -> float:
    """Median over `reps` of the mean time of `iters` calls of `fn` (CUDA events on a GPU, the clock on CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / iters)
        else:
            begin = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - begin) * 1e3 / iters)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(device: str, nbytes: int | None = None) -> float:
    """Device memory bandwidth as a large device-to-device copy achieves it: (read + write bytes) / time.
    1 GiB on a GPU (far beyond its caches), 256 MiB on CPU."""
    import torch

    nbytes = nbytes or (1 << 30 if device == "cuda" else 1 << 28)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=20 if device == "cuda" else 3, reps=5, warmup=3)
    return 2 * nbytes / (ms / 1e3) / 1e9


@dataclass(frozen=True)
class Shape:
    """A Llama-family model's shape, for random-weight checks (the step-time check leaves RoPE at its defaults)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float = 10000.0
    max_positions: int = 8192
