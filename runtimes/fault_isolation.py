"""Running a batch so that a fault caused by one of its items fails that item only (both engines use it).

A step runs a whole batch, so an exception from it (a kernel refusing a shape, a bug a rare input reaches) does
not say whose it is. `run_isolating` runs the batch; if that raises, it bisects: each half runs on its own,
recursing into a half that raises too, until every part either ran or is a single item that fails alone: those
are the offenders. The parts that ran are the step's results, so the step is, in effect, retried without the
offenders and nobody else loses work. A fault that is no single item's (a batch too big for the device) lets
every part run, and nobody fails.

One offender among B items costs about 2·log2(B) extra runs, on the failure path only. The caller must make a
rerun harmless: the LLM engine's progress is counted (a rerun recomputes the same KV into the same slots) and it
keys seeded noise by position, so a rerun draws the same (`before_rerun` is for callers with other state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")
PROBE_TEXT = "ping"  # a known-good input: the startup probes and the self-check after a request fault use it


class EngineFaultError(RuntimeError):
    """The engine's self-check failed after a request fault: it cannot serve anything, not just one request."""


@dataclass
class Isolated(Generic[ItemT, ResultT]):
    """What a batch came to: the parts that ran, each with its result, and the items that fail alone."""

    parts: list[tuple[Sequence[ItemT], ResultT]] = field(default_factory=list)
    faults: list[tuple[ItemT, Exception]] = field(default_factory=list)


def run_isolating(run: Callable[[Sequence[ItemT]], ResultT], items: Sequence[ItemT],
                  before_rerun: Callable[[Sequence[ItemT]], None] = lambda part: None) -> Isolated[ItemT, ResultT]:
    """`run(items)`, or, when that raises, `run` over every part of `items` that runs without the items that
    raise alone. `before_rerun(part)` is called before each rerun of a part."""
    outcome: Isolated[ItemT, ResultT] = Isolated()
    try:
        outcome.parts.append((items, run(items)))
    except Exception as error:  # whose fault it is, is found below
        _bisect(run, items, error, before_rerun, outcome)
    return outcome


def _bisect(run: Callable[[Sequence[ItemT]], ResultT], items: Sequence[ItemT], error: Exception,
            before_rerun: Callable[[Sequence[ItemT]], None], outcome: Isolated[ItemT, ResultT]) -> None:
    """`items` raised `error` together: run each half alone, recursing into a half that raises too."""
    if len(items) == 1:
        outcome.faults.append((items[0], error))
        return
    middle = len(items) // 2
    for part in (items[:middle], items[middle:]):
        before_rerun(part)
        try:
            outcome.parts.append((part, run(part)))
        except Exception as part_error:
            _bisect(run, part, part_error, before_rerun, outcome)
