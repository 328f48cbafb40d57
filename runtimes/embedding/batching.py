"""Dynamic batching: which waiting inputs to encode next, and how to pad them.

Decide, then execute: `DynamicBatcher.schedule(now)` returns the next forward pass as a plain `Bucket` (or None:
keep waiting) and the engine runs it. Work is planned a *chunk* at a time: once `max_batch_size` inputs wait or
the oldest has waited `batch_window_s`, the batcher takes up to `max_batch_size` inputs, and at most
`max_batch_tokens` tokens counted at their length class (so the chunk's padded tokens never pass it; one input
over it still runs, alone), and cuts them into length buckets (powers of two from `min_bucket_len`), each padded
only to its own longest input, so a few long inputs do not make every short one pay for their padding. Each
bucket is one forward pass, shortest first; the engine takes new requests between any two.

Fairness: requests take turns, one input each, in a round that carries on from chunk to chunk (a request with
inputs left goes to the back of the line). A request of many inputs thus shares each chunk with the requests that
arrived while its previous chunk ran, instead of holding the replica until all its inputs are encoded: a one-word
request waits for at most the rest of the chunk in flight, then goes in the next chunk (in its first pass, being
the shortest).

Turns keep a request's own inputs in input order, so a request alone is cut into the same chunks and buckets as
when the queue was first come, first served (while `max_batch_size` inputs at the model's limit fit
`max_batch_tokens`, as 64 of 256 tokens fit the default), and gets the same vectors bit for bit. In company its
vectors may differ in the last bits (~1e-7): a vector depends on its pass's padded length (the attention's sums
run over it), not on how many inputs share it (as measured on the CPU).
"""

from __future__ import annotations

from collections import OrderedDict, deque
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
    """The queue of waiting inputs, the rule for when to encode them, and the chunk being encoded."""

    def __init__(self, max_batch_size: int, batch_window_s: float, max_batch_tokens: int,
                 min_bucket_len: int) -> None:
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.max_batch_tokens = max_batch_tokens
        self.min_bucket_len = min_bucket_len
        # Each request's inputs not yet in a chunk, in input order; the requests in turn order (first: next).
        self._waiting: OrderedDict[str, deque[BatchItem]] = OrderedDict()
        self._planned: deque[Bucket] = deque()  # the rest of the chunk in flight: its next passes
        # Inputs not yet encoded, planned or not. Written by the engine thread only; /metrics reads it.
        self.num_waiting = 0

    def add(self, items: Sequence[BatchItem]) -> None:
        """Queue one request's inputs (in input order); it takes its first turn after those already waiting."""
        for item in items:
            self._waiting.setdefault(item.request_id, deque()).append(item)
        self.num_waiting += len(items)

    def remove(self, request_id: str) -> None:
        """Forget a request's inputs not yet encoded (an aborted request), planned ones included."""
        self.num_waiting -= len(self._waiting.pop(request_id, ()))
        planned = list(self._planned)
        self._planned.clear()
        for bucket in planned:
            kept = tuple(it for it in bucket.items if it.request_id != request_id)
            self.num_waiting -= len(bucket.items) - len(kept)
            if kept:  # still padded as planned: the other inputs' vectors do not depend on the abort
                self._planned.append(Bucket(kept, bucket.padded_len))

    def wait_s(self, now: float) -> float | None:
        """None when nothing waits; else how long to keep collecting before `schedule` gives a pass (<= 0: now)."""
        if self._planned:
            return 0.0
        if not self._waiting:
            return None
        if self.num_waiting >= self.max_batch_size:
            return 0.0
        oldest = min(inputs[0].arrival_time for inputs in self._waiting.values())
        return oldest + self.batch_window_s - now

    def schedule(self, now: float) -> Bucket | None:
        """The next forward pass when one is due (the chunk in flight goes on, or a new one is due); else None."""
        wait = self.wait_s(now)
        if wait is None or wait > 0:
            return None
        if not self._planned:
            self._planned.extend(plan_buckets(self._take_turns(), self.max_batch_tokens, self.min_bucket_len))
        bucket = self._planned.popleft()
        self.num_waiting -= len(bucket.items)
        return bucket

    def _take_turns(self) -> list[BatchItem]:
        """The next chunk's inputs: one per request in turn, up to `max_batch_size` inputs and `max_batch_tokens`
        tokens counted at their length class (at least one input, however long)."""
        taken: list[BatchItem] = []
        num_tokens = 0
        while self._waiting and len(taken) < self.max_batch_size:
            request_id, inputs = next(iter(self._waiting.items()))
            cost = bucket_len(len(inputs[0].token_ids), self.min_bucket_len)
            if taken and num_tokens + cost > self.max_batch_tokens:
                break  # this request keeps its turn: it leads the next chunk
            taken.append(inputs.popleft())
            num_tokens += cost
            if inputs:
                self._waiting.move_to_end(request_id)
            else:
                del self._waiting[request_id]
        return taken
