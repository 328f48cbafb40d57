"""Dynamic batching: which waiting inputs to encode now, and how to pad them.

Decide, then execute: `DynamicBatcher.schedule(now)` returns a plain `BatchPlan` (or None: keep waiting) and
the engine runs it. A batch goes out once `max_batch_size` inputs wait or the oldest has waited
`batch_window_s`; inputs are taken first come, first served, so one request's inputs may span batches.
Within a batch, inputs are sorted by length and cut into length buckets (powers of two from
`min_bucket_len`), each padded only to its own longest input and held under `max_batch_tokens` padded
tokens, so a few long inputs do not make every short one pay for their padding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchItem:
    """One input of one request."""

    request_id: str
    index: int  # position in the request's `input` list
    token_ids: Sequence[int]
    arrival_time: float


@dataclass(frozen=True)
class Bucket:
    """Inputs encoded by one forward pass, padded to `padded_len`."""

    items: tuple[BatchItem, ...]
    padded_len: int

    @property
    def num_padded_tokens(self) -> int:
        return len(self.items) * self.padded_len


@dataclass(frozen=True)
class BatchPlan:
    buckets: tuple[Bucket, ...]

    @property
    def num_inputs(self) -> int:
        return sum(len(b.items) for b in self.buckets)


def bucket_len(num_tokens: int, min_bucket_len: int) -> int:
    """The length class of an input: the smallest power of two times `min_bucket_len` that holds it."""
    size = min_bucket_len
    while size < num_tokens:
        size *= 2
    return size


def plan_buckets(items: Sequence[BatchItem], max_batch_tokens: int, min_bucket_len: int) -> tuple[Bucket, ...]:
    """Group `items` by length class; split a group that would pass `max_batch_tokens` padded tokens.

    A single input longer than the budget still gets a bucket of its own.
    """
    buckets: list[Bucket] = []
    current: list[BatchItem] = []
    for item in sorted(items, key=lambda it: len(it.token_ids)):
        length = len(item.token_ids)
        same_class = current and bucket_len(length, min_bucket_len) == bucket_len(len(current[0].token_ids),
                                                                                  min_bucket_len)
        if current and (not same_class or (len(current) + 1) * length > max_batch_tokens):
            buckets.append(Bucket(tuple(current), len(current[-1].token_ids)))
            current = []
        current.append(item)
    if current:
        buckets.append(Bucket(tuple(current), len(current[-1].token_ids)))
    return tuple(buckets)


class DynamicBatcher:
    """The queue of waiting inputs and the rule for when to encode them."""

    def __init__(self, max_batch_size: int, batch_window_s: float, max_batch_tokens: int,
                 min_bucket_len: int) -> None:
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.max_batch_tokens = max_batch_tokens
        self.min_bucket_len = min_bucket_len
        self.waiting: deque[BatchItem] = deque()

    def add(self, items: Sequence[BatchItem]) -> None:
        self.waiting.extend(items)

    def remove(self, request_id: str) -> None:
        """Forget a request's waiting inputs (an aborted request)."""
        self.waiting = deque(it for it in self.waiting if it.request_id != request_id)

    def wait_s(self, now: float) -> float | None:
        """None when nothing waits; else how long to keep collecting before `schedule` gives a batch (<= 0: now)."""
        if not self.waiting:
            return None
        if len(self.waiting) >= self.max_batch_size:
            return 0.0
        return self.waiting[0].arrival_time + self.batch_window_s - now

    def schedule(self, now: float) -> BatchPlan | None:
        """The next batch when one is due (a full batch, or the window has closed); None otherwise."""
        wait = self.wait_s(now)
        if wait is None or wait > 0:
            return None
        count = min(self.max_batch_size, len(self.waiting))
        items = [self.waiting.popleft() for _ in range(count)]
        return BatchPlan(plan_buckets(items, self.max_batch_tokens, self.min_bucket_len))
