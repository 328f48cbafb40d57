"""run_isolating on plain items: who is blamed, what runs, and how often (no model needed)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from runtimes.fault_isolation import run_isolating


class Runner:
    """Fails a batch that holds any of `bad`, or (batch faults) any batch longer than `max_len`."""

    def __init__(self, bad: set[int], max_len: int | None = None) -> None:
        self.bad, self.max_len = bad, max_len
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, items: Sequence[int]) -> list[int]:
        self.calls.append(tuple(items))
        culprit = next((i for i in items if i in self.bad), None)
        if culprit is not None:
            raise ValueError(f"item {culprit}")
        if self.max_len is not None and len(items) > self.max_len:
            raise MemoryError(f"batch of {len(items)}")
        return [i * 10 for i in items]


def _ran(outcome) -> list[int]:
    return sorted(i for part, _ in outcome.parts for i in part)


def test_a_clean_batch_runs_once():
    runner = Runner(bad=set())
    outcome = run_isolating(runner, list(range(8)))
    assert runner.calls == [tuple(range(8))] and outcome.faults == []
    assert outcome.parts == [(list(range(8)), [i * 10 for i in range(8)])]


@pytest.mark.parametrize("bad", [{0}, {5}, {15}, {3, 12}, {6, 7}])
def test_offenders_are_found_and_everyone_else_runs(bad):
    runner = Runner(bad=bad)
    outcome = run_isolating(runner, list(range(16)))
    assert sorted(item for item, _ in outcome.faults) == sorted(bad)
    assert all(str(item) in str(error) for item, error in outcome.faults)  # each with its own error
    assert _ran(outcome) == [i for i in range(16) if i not in bad]
    for part, result in outcome.parts:
        assert result == [i * 10 for i in part]
    if len(bad) == 1:
        assert len(runner.calls) <= 1 + 2 * 4  # one full run, then two runs per level of a 16-item bisection


def test_a_fault_of_the_whole_batch_blames_nobody():
    outcome = run_isolating(Runner(bad=set(), max_len=3), list(range(10)))
    assert outcome.faults == [] and _ran(outcome) == list(range(10))


def test_before_rerun_sees_every_rerun_part():
    seen: list[tuple[int, ...]] = []
    run_isolating(Runner(bad={2}), [0, 1, 2, 3], before_rerun=lambda part: seen.append(tuple(part)))
    assert seen == [(0, 1), (2, 3), (2,), (3,)]
