"""The dynamic batcher as plain data: when a batch is due, what it takes, and how it is cut into length buckets."""

from __future__ import annotations

from runtimes.embedding.batching import BatchItem, DynamicBatcher, bucket_len, plan_buckets


def items(lengths: list[int], request_id: str = "r", arrival_time: float = 0.0) -> list[BatchItem]:
    return [BatchItem(request_id, i, [1] * n, arrival_time) for i, n in enumerate(lengths)]


def batcher(max_batch_size: int = 4, window_s: float = 0.01, max_batch_tokens: int = 1024) -> DynamicBatcher:
    return DynamicBatcher(max_batch_size, window_s, max_batch_tokens, min_bucket_len=16)


def test_bucket_len_classes():
    assert [bucket_len(n, 16) for n in (1, 16, 17, 32, 33, 200, 256)] == [16, 16, 32, 32, 64, 256, 256]


def test_waits_for_the_window_then_batches_what_came():
    b = batcher()
    assert b.wait_s(now=0.0) is None and b.schedule(now=0.0) is None  # idle
    b.add(items([5], "a", arrival_time=1.0))
    b.add(items([6], "b", arrival_time=1.004))
    assert abs(b.wait_s(now=1.005) - 0.005) < 1e-9 and b.schedule(now=1.005) is None
    plan = b.schedule(now=1.0101)
    assert plan is not None and [it.request_id for bucket in plan.buckets for it in bucket.items] == ["a", "b"]
    assert not b.waiting


def test_a_full_batch_goes_at_once_and_the_rest_waits_fifo():
    b = batcher(max_batch_size=4)
    b.add(items([3] * 6, "big", arrival_time=0.0))
    b.add(items([3], "late", arrival_time=0.0))
    assert b.wait_s(now=0.0) == 0.0
    first = b.schedule(now=0.0)
    assert first is not None and sorted(it.index for it in first.buckets[0].items) == [0, 1, 2, 3]
    assert [(it.request_id, it.index) for it in b.waiting] == [("big", 4), ("big", 5), ("late", 0)]
    assert b.schedule(now=0.0) is None  # 3 left: under the cap, window open
    assert b.schedule(now=0.02).num_inputs == 3  # type: ignore[union-attr]


def test_buckets_group_by_length_class_and_pad_to_their_own_longest():
    buckets = plan_buckets(items([100, 5, 12, 40, 9, 33]), max_batch_tokens=4096, min_bucket_len=16)
    assert [[len(it.token_ids) for it in b.items] for b in buckets] == [[5, 9, 12], [33, 40], [100]]
    assert [b.padded_len for b in buckets] == [12, 40, 100]
    assert sum(b.num_padded_tokens for b in buckets) == 36 + 80 + 100  # vs 6 * 100 padded to the longest


def test_token_budget_splits_a_bucket_and_an_oversized_input_still_runs():
    buckets = plan_buckets(items([10] * 5 + [300]), max_batch_tokens=32, min_bucket_len=16)
    assert [len(b.items) for b in buckets] == [3, 2, 1]
    assert all(b.num_padded_tokens <= 32 for b in buckets[:2]) and buckets[2].padded_len == 300


def test_remove_forgets_a_requests_waiting_inputs():
    b = batcher()
    b.add(items([3, 3], "a"))
    b.add(items([3], "b"))
    b.remove("a")
    assert [it.request_id for it in b.waiting] == ["b"]
