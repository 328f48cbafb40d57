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
    bucket = b.schedule(now=1.0101)
    assert bucket is not None and [it.request_id for it in bucket.items] == ["a", "b"]
    assert b.num_waiting == 0 and b.wait_s(now=2.0) is None


def passes(b: DynamicBatcher, now: float = 100.0) -> list[list[tuple[str, int]]]:
    """Every pass `b` gives until it is idle: (request id, index) of each input."""
    out = []
    while (bucket := b.schedule(now)) is not None:
        out.append([(it.request_id, it.index) for it in bucket.items])
    return out


def test_a_full_batch_goes_at_once_and_the_rest_waits_in_turn():
    b = batcher(max_batch_size=4)
    b.add(items([3] * 6, "big", arrival_time=0.0))
    b.add(items([3], "late", arrival_time=0.0))
    assert b.wait_s(now=0.0) == 0.0
    first = b.schedule(now=0.0)
    # turns: big's first input, then late's, then big's again (late had no more)
    assert first is not None and [(it.request_id, it.index) for it in first.items] == [
        ("big", 0), ("late", 0), ("big", 1), ("big", 2)]
    assert b.num_waiting == 3
    assert b.schedule(now=0.0) is None  # 3 left: under the cap, window open
    assert passes(b, now=0.02) == [[("big", 3), ("big", 4), ("big", 5)]]


def test_a_short_request_goes_in_the_next_chunk_first():
    b = batcher(max_batch_size=4, max_batch_tokens=4 * 64)
    b.add(items([64] * 12, "big"))
    first = b.schedule(now=1.0)  # the chunk in flight: big's first 4
    assert first is not None and [it.index for it in first.items] == [0, 1, 2, 3]
    b.add(items([3], "small", arrival_time=1.0))  # arrives while that pass runs
    assert passes(b) == [[("small", 0)],  # its own short pass, first in the next chunk
                         [("big", 4), ("big", 5), ("big", 6)],
                         [("big", 7), ("big", 8), ("big", 9), ("big", 10)], [("big", 11)]]
    assert b.num_waiting == 0


def test_requests_share_chunks_in_turn():
    b = batcher(max_batch_size=4)
    b.add(items([5] * 4, "a"))
    b.add(items([5] * 4, "b"))
    b.add(items([5], "c"))
    assert passes(b) == [[("a", 0), ("b", 0), ("c", 0), ("a", 1)],
                         [("b", 1), ("a", 2), ("b", 2), ("a", 3)], [("b", 3)]]


def test_a_request_alone_is_cut_as_first_come_first_served():
    lengths = [(7 * i) % 100 + 1 for i in range(150)]
    b = batcher(max_batch_size=64, max_batch_tokens=64 * 128)
    b.add(items(lengths, "r"))
    fifo = [bucket for start in range(0, 150, 64)
            for bucket in plan_buckets(items(lengths, "r")[start:start + 64], 64 * 128, min_bucket_len=16)]
    assert passes(b) == [[("r", it.index) for it in bucket.items] for bucket in fifo]


def test_a_chunk_holds_at_most_max_batch_tokens_at_length_class():
    b = batcher(max_batch_size=8, max_batch_tokens=100)
    b.add(items([20, 20, 20, 20], "a"))  # class 32 each: three fit 100
    b.add(items([200], "huge"))  # over the budget alone: still runs, alone
    # huge's turn comes after a's first input and does not fit beside it: it keeps its turn, leading the next chunk
    assert passes(b) == [[("a", 0)], [("huge", 0)], [("a", 1), ("a", 2), ("a", 3)]]


def test_buckets_group_by_length_class_and_pad_to_their_own_longest():
    buckets = plan_buckets(items([100, 5, 12, 40, 9, 33]), max_batch_tokens=4096, min_bucket_len=16)
    assert [[len(it.token_ids) for it in b.items] for b in buckets] == [[5, 9, 12], [33, 40], [100]]
    assert [b.padded_len for b in buckets] == [12, 40, 100]
    assert sum(b.num_padded_tokens for b in buckets) == 36 + 80 + 100  # vs 6 * 100 padded to the longest


def test_token_budget_splits_a_bucket_and_an_oversized_input_still_runs():
    buckets = plan_buckets(items([10] * 5 + [300]), max_batch_tokens=32, min_bucket_len=16)
    assert [len(b.items) for b in buckets] == [3, 2, 1]
    assert all(b.num_padded_tokens <= 32 for b in buckets[:2]) and buckets[2].padded_len == 300


def test_remove_forgets_a_requests_inputs_waiting_or_planned():
    b = batcher()
    b.add(items([3, 3], "a"))
    b.add(items([3], "b"))
    b.remove("a")
    assert b.num_waiting == 1 and passes(b) == [[("b", 0)]]
    b.add(items([3, 40, 3], "a"))
    b.add(items([40], "b"))
    assert b.schedule(now=100.0) is not None  # the chunk's first pass: a's short ones
    b.remove("b")  # planned in the chunk's second pass, with a's 40-token input
    [[rest]] = passes(b)
    assert rest == ("a", 1) and b.num_waiting == 0
