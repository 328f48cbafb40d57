"""Tests for KV-block accounting (runtimes/llm/block_pool.py) and block tables / prefix lookups
(runtimes/llm/kv_cache_manager.py). CPU only, no model."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from runtimes.llm.block_pool import BlockPool
from runtimes.llm.kv_cache_manager import KVCacheManager, PartialHit
from runtimes.llm.request import Request
from runtimes.llm.sampling_params import SamplingParams

BS = 4  # block size used throughout


@pytest.fixture
def make_request() -> Callable[..., Request]:
    counter = iter(range(1_000_000))

    def make(tokens: Sequence[int], namespace: str | None = "m", request_id: str | None = None) -> Request:
        rid = request_id if request_id is not None else f"r{next(counter)}"
        return Request(rid, list(tokens), SamplingParams(max_tokens=8), 8, 0.0, cache_namespace=namespace)

    return make


def compute(kv: KVCacheManager, request: Request, computed_blocks: list[int] | None = None) -> None:
    """What the scheduler + runner do for a whole prompt: take slots, mark it computed, commit the full blocks."""
    hits = computed_blocks or []
    start = len(hits) * kv.block_size
    assert kv.allocate_slots(request, request.num_tokens - start, hits)
    request.num_computed_tokens = request.num_tokens
    kv.commit(request)


def all_ref_counts_zero(pool: BlockPool) -> bool:
    return all(c == 0 for c in pool.ref_cnt)


# --- BlockPool: reference counting ------------------------------------------------------------------


def test_allocate_and_free_count_references() -> None:
    pool = BlockPool(8, BS)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3
    assert [pool.ref_cnt[b] for b in ids] == [1, 1, 1]
    assert pool.num_free_blocks == 5
    assert pool.usage() == pytest.approx(3 / 8)

    pool.touch(ids[:1])  # a second owner of the first block
    assert pool.ref_cnt[ids[0]] == 2
    assert pool.num_free_blocks == 5

    pool.free(ids)
    assert pool.ref_cnt[ids[0]] == 1
    assert pool.num_free_blocks == 7  # the shared block is still referenced
    pool.free(ids[:1])
    assert pool.num_free_blocks == 8
    assert all_ref_counts_zero(pool)


def test_freeing_twice_raises() -> None:
    pool = BlockPool(4, BS)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="ref_cnt=0"):
        pool.free([block])
    assert pool.num_free_blocks == 4  # the failed free did not enqueue it a second time


def test_freeing_a_never_allocated_block_raises() -> None:
    pool = BlockPool(4, BS)
    with pytest.raises(RuntimeError):
        pool.free([2])


def test_allocating_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4, BS)
    with pytest.raises(RuntimeError, match="asked for 5 blocks with only 4 free"):
        pool.allocate(5)
    assert pool.num_free_blocks == 4
    assert all_ref_counts_zero(pool)
    pool.allocate(4)
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    assert pool.num_free_blocks == 0


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, BS)


# --- BlockPool: LRU order and the prefix-cache index ------------------------------------------------


def test_freed_blocks_join_the_back_of_the_queue_in_the_order_given() -> None:
    pool = BlockPool(6, BS)
    a = pool.allocate(4)  # [0, 1, 2, 3]; 4 and 5 stay at the front of the queue
    pool.free([a[2], a[0]])
    pool.free([a[3], a[1]])
    assert pool.allocate(6) == [4, 5, a[2], a[0], a[3], a[1]]


def test_cached_block_survives_free_and_is_revived_by_touch() -> None:
    pool = BlockPool(4, BS)
    (block,) = pool.allocate(1)
    pool.cache(block, 123)
    pool.free([block])
    assert pool.num_free_blocks == 4
    assert pool.lookup(123) == block and pool.num_cached_blocks == 1

    pool.touch([block])  # a prefix hit takes it back out of the free queue
    assert pool.ref_cnt[block] == 1
    assert pool.num_free_blocks == 3
    assert pool.lookup(123) == block
    pool.free([block])

    # Allocation prefers the blocks in front of it; the cached one (at the back) survives ...
    others = pool.allocate(3)
    assert block not in others
    assert pool.num_evictions == 0
    assert pool.lookup(123) == block
    # ... until allocation actually needs it.
    assert pool.allocate(1) == [block]
    assert pool.num_evictions == 1
    assert pool.lookup(123) is None
    assert pool.block_hash[block] is None
    assert pool.num_cached_blocks == 0


def test_allocating_blocks_without_hash_is_not_an_eviction() -> None:
    pool = BlockPool(3, BS)
    pool.free(pool.allocate(3))
    pool.allocate(3)
    assert pool.num_evictions == 0


def test_duplicate_hash_registration_keeps_the_first_block() -> None:
    pool = BlockPool(4, BS)
    first, second = pool.allocate(2)
    pool.cache(first, 7)
    pool.cache(second, 7)
    assert pool.lookup(7) == first
    assert pool.block_hash[second] is None
    assert pool.num_cached_blocks == 1
    # A block keeps the hash it was registered under.
    pool.cache(first, 8)
    assert pool.lookup(8) is None
    assert pool.block_hash[first] == 7
    # Evicting the unregistered duplicate leaves the index alone.
    pool.free([second])
    pool.allocate(3)  # the two never-used blocks, then `second`
    assert pool.num_evictions == 0
    assert pool.lookup(7) == first


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(4, BS)
    a, b = pool.allocate(2)
    pool.cache(a, 1)
    pool.cache(b, 2)
    pool.free([a])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.lookup(1) is None and pool.lookup(2) is None
    assert pool.block_hash == [None] * 4


# --- KVCacheManager: prefix lookups -----------------------------------------------------------------


def test_same_prompt_hits_full_blocks(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(16, BS)
    a = make_request(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    compute(kv, a)
    assert kv.pool.num_cached_blocks == 2
    b = make_request(range(10))
    assert kv.get_computed_blocks(b) == kv.block_table(a.request_id)[:2]


def test_chained_hashes_same_block_after_a_different_prefix_does_not_hit(
    make_request: Callable[..., Request],
) -> None:
    kv = KVCacheManager(16, BS)
    a = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(kv, a)
    # Block 1 holds the same tokens as a's block 1, but follows a different block 0.
    other_prefix = make_request([9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(other_prefix) == []
    assert other_prefix.block_hashes[1] != a.block_hashes[1]
    # A hit stops at the first differing block, even when a later block matches again.
    diverges = make_request([1, 2, 3, 4, 0, 0, 0, 0, 9, 9, 9, 9, 1])
    assert kv.get_computed_blocks(diverges) == kv.block_table(a.request_id)[:1]


def test_namespaces_isolate(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(16, BS)
    compute(kv, make_request(range(9), namespace="model-a"))
    assert kv.get_computed_blocks(make_request(range(9), namespace="model-b")) == []
    assert kv.get_computed_blocks(make_request(range(9), namespace=None)) == []
    assert len(kv.get_computed_blocks(make_request(range(9), namespace="model-a"))) == 2


def test_no_namespace_caches_nothing(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(16, BS)
    compute(kv, make_request(range(12), namespace=None))
    assert kv.pool.num_cached_blocks == 0


@pytest.mark.parametrize(("prompt_len", "expected_hit_blocks"), [(1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2)])
def test_computed_blocks_never_cover_the_last_token(
    make_request: Callable[..., Request], prompt_len: int, expected_hit_blocks: int
) -> None:
    kv = KVCacheManager(16, BS)
    compute(kv, make_request(range(12)))  # 3 full blocks cached
    again = make_request(range(prompt_len))
    hits = kv.get_computed_blocks(again)
    assert len(hits) == expected_hit_blocks
    assert len(hits) * BS < again.num_tokens  # at least one token is left to compute


def test_hits_are_shared_and_reference_counted(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(16, BS)
    a = make_request(range(10))
    compute(kv, a)
    b = make_request(range(10))
    hits = kv.get_computed_blocks(b)
    compute(kv, b, hits)
    assert kv.block_table(b.request_id)[:2] == kv.block_table(a.request_id)[:2]
    assert kv.block_table(b.request_id)[2] != kv.block_table(a.request_id)[2]
    assert [kv.pool.ref_cnt[x] for x in hits] == [2, 2]
    assert kv.num_free_blocks == 16 - 4
    kv.free(a)
    assert [kv.pool.ref_cnt[x] for x in hits] == [1, 1]
    assert kv.num_free_blocks == 16 - 3
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_decode_growth_registers_blocks_as_they_fill(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(16, BS)
    r = make_request(range(6))
    compute(kv, r)
    assert kv.pool.num_cached_blocks == 1
    r.token_ids.append(100)  # sampled token 7 ...
    assert kv.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    r.token_ids.append(101)  # ... and 8 fill block 1
    assert kv.allocate_slots(r, 1)
    assert kv.pool.num_cached_blocks == 1  # slots taken, KV not yet computed: not in the index yet
    r.num_computed_tokens += 1
    kv.commit(r)
    assert kv.pool.num_cached_blocks == 2
    assert len(kv.block_table(r.request_id)) == 2
    r.token_ids.append(102)  # token 9 needs a third block
    assert kv.allocate_slots(r, 1)
    assert len(kv.block_table(r.request_id)) == 3
    later = make_request([*range(6), 100, 101, 102])
    assert kv.get_computed_blocks(later) == kv.block_table(r.request_id)[:2]


def test_tail_first_free_makes_tail_blocks_evicted_first(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(3, BS)
    a = make_request(range(12))  # exactly 3 full blocks, all cached
    compute(kv, a)
    table = list(kv.block_table(a.request_id))
    kv.free(a)
    assert kv.pool.num_cached_blocks == 3
    assert kv.pool.allocate(1) == [table[-1]]  # the tail block goes first ...
    assert kv.pool.num_evictions == 1
    # ... so the prefix, the part other requests can share, survives.
    assert kv.get_computed_blocks(make_request(range(12))) == table[:2]


# --- KVCacheManager: allocate_slots all-or-nothing --------------------------------------------------


def test_allocate_slots_fails_without_changing_anything(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(4, BS)
    a = make_request(range(10))
    compute(kv, a)  # 3 blocks, 1 left
    table_before = list(kv.block_table(a.request_id))
    refs_before = list(kv.pool.ref_cnt)

    b = make_request(range(100, 108))  # needs 2 blocks
    assert not kv.allocate_slots(b, 8)
    assert kv.num_free_blocks == 1
    assert b.request_id not in kv.block_tables
    assert kv.pool.ref_cnt == refs_before

    a.token_ids.extend(range(50, 57))  # a growing by 7 tokens to 17 would need 2 more blocks
    assert not kv.allocate_slots(a, 7)
    assert kv.block_table(a.request_id) == table_before
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots(a, 6)  # 16 tokens fill the partial block and the one free block
    assert kv.block_table(a.request_id)[:3] == table_before
    assert len(kv.block_table(a.request_id)) == 4
    assert kv.num_free_blocks == 0


def test_allocate_slots_counts_hit_blocks_that_would_leave_the_free_queue(
    make_request: Callable[..., Request],
) -> None:
    kv = KVCacheManager(4, BS)
    a = make_request(range(9))  # blocks 0, 1 full (cached), block 2 partial
    compute(kv, a)
    kv.free(a)  # queue: [3, 2, 1, 0]; 1 and 0 hold cached prefixes
    other = make_request(range(200, 203))
    assert kv.allocate_slots(other, 3)  # takes block 3, no eviction
    assert kv.pool.num_evictions == 0
    assert kv.num_free_blocks == 3

    b = make_request([*range(8), 70, 71, 72, 73, 74])  # 13 tokens: 2 hit blocks + 2 new blocks
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    assert all(kv.pool.ref_cnt[x] == 0 for x in hits)
    # 3 blocks are free, but reviving the 2 hits leaves only 1 for the 2 new blocks.
    assert not kv.allocate_slots(b, 5, hits)
    assert kv.num_free_blocks == 3
    assert b.request_id not in kv.block_tables
    assert all(kv.pool.ref_cnt[x] == 0 for x in hits)
    assert kv.pool.num_evictions == 0
    assert kv.get_computed_blocks(make_request(range(9))) == hits  # the cached prefix is intact

    kv.free(other)
    assert kv.allocate_slots(b, 5, hits)
    assert kv.block_table(b.request_id)[:2] == hits
    assert kv.num_free_blocks == 0


def test_free_releases_everything(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(32, BS)
    requests = [make_request(range(n)) for n in (3, 9, 9, 17)]
    for r in requests:
        compute(kv, r, kv.get_computed_blocks(r))
    assert kv.num_free_blocks < 32
    for r in requests:
        kv.free(r)
    assert kv.num_free_blocks == 32
    assert kv.block_tables == {}
    assert all_ref_counts_zero(kv.pool)
    kv.free(requests[0])  # freeing a request without blocks is a no-op
    assert kv.num_free_blocks == 32


# --- KVCacheManager: hits that end inside a block (KV copied) ------------------------------------------


class FakeKV:
    """What each slot of each block holds: the token whose KV was written there (the copy the engine would do)."""

    def __init__(self) -> None:
        self.slots: dict[int, dict[int, int]] = {}
        self.copies: list[tuple[int, int, int]] = []

    def write(self, kv: KVCacheManager, request: Request, start: int, stop: int) -> None:
        table = kv.block_table(request.request_id)
        for pos in range(start, stop):
            self.slots.setdefault(table[pos // kv.block_size], {})[pos % kv.block_size] = request.token_ids[pos]

    def copy(self, source: int, destination: int, num_tokens: int) -> None:
        self.copies.append((source, destination, num_tokens))
        held = self.slots.get(source, {})
        self.slots[destination] = {slot: held[slot] for slot in range(num_tokens)}

    def tokens_of(self, kv: KVCacheManager, request: Request, stop: int) -> list[int | None]:
        table = kv.block_table(request.request_id)
        return [self.slots.get(table[p // kv.block_size], {}).get(p % kv.block_size) for p in range(stop)]


def admit(kv: KVCacheManager, fake: FakeKV, request: Request) -> int:
    """The scheduler's admission of a whole prompt with both kinds of hits, then its computation; returns the tokens
    served from the cache."""
    hits = kv.get_computed_blocks(request)
    partial = kv.find_partial(request, len(hits))
    cached = len(hits) * kv.block_size + (0 if partial is None else partial.num_tokens)
    assert kv.allocate_slots(request, request.num_tokens - cached, hits, partial)
    fake.write(kv, request, cached, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.commit(request)
    return cached


def decode(kv: KVCacheManager, fake: FakeKV, request: Request, token: int) -> None:
    """One sampled token appended, then computed in the next step."""
    request.token_ids.append(token)
    assert kv.allocate_slots(request, 1)
    fake.write(kv, request, request.num_computed_tokens, request.num_tokens)
    request.num_computed_tokens += 1
    kv.commit(request)


@pytest.fixture
def fake() -> FakeKV:
    return FakeKV()


def test_a_prompt_sent_again_reuses_all_but_its_last_token(make_request: Callable[..., Request], fake: FakeKV) -> None:
    kv = KVCacheManager(16, BS, fake.copy)
    first = make_request(range(10))  # [0..3] [4..7] full, [8, 9] partial
    assert admit(kv, fake, first) == 0
    again = make_request(range(10))
    assert kv.find_partial(again, 2) is None  # `first` still runs: its partial block is being written
    kv.free(first)
    again = make_request(range(10))
    assert admit(kv, fake, again) == 9  # two whole blocks and token 8; token 9 is computed (its logits are needed)
    assert fake.tokens_of(kv, again, 10) == list(range(10))
    source, destination, count = fake.copies[-1]
    assert count == 1 and destination == kv.block_table(again.request_id)[2] != source


def test_a_conversation_turn_reuses_the_last_turn_up_to_its_last_computed_token(
    make_request: Callable[..., Request], fake: FakeKV,
) -> None:
    kv = KVCacheManager(16, BS, fake.copy)
    turn = make_request(range(6))
    admit(kv, fake, turn)
    decode(kv, fake, turn, 100)
    turn.token_ids.append(101)  # sampled, then the request finished: 101 has no KV
    kv.free(turn)
    nxt = make_request([*range(6), 100, 101, 7, 8])  # block 1 [4, 5, 100, 101] was never full: no whole-block hit
    assert len(kv.get_computed_blocks(nxt)) == 1
    assert kv.find_partial(nxt, 1).num_tokens == 3
    assert admit(kv, fake, nxt) == 7
    assert fake.tokens_of(kv, nxt, 10) == nxt.token_ids


def test_a_full_block_serves_the_prefix_it_shares(make_request: Callable[..., Request], fake: FakeKV) -> None:
    kv = KVCacheManager(16, BS, fake.copy)
    admit(kv, fake, make_request(range(8)))  # still running: its full blocks are cached and final
    other = make_request([0, 1, 2, 3, 4, 5, 9, 9, 9])
    assert admit(kv, fake, other) == 6
    assert fake.tokens_of(kv, other, 9) == other.token_ids


def test_the_longest_shared_prefix_wins(make_request: Callable[..., Request], fake: FakeKV) -> None:
    kv = KVCacheManager(32, BS, fake.copy)
    for tail in ([7, 1, 1, 1], [7, 8, 9, 1], [7, 8, 1, 1]):
        admit(kv, fake, make_request([0, 1, 2, 3, *tail]))
    probe = make_request([0, 1, 2, 3, 7, 8, 9, 5, 5])
    hit = kv.find_partial(probe, len(kv.get_computed_blocks(probe)))
    assert hit is not None and hit.num_tokens == 3
    assert kv.find_partial(make_request([0, 1, 2, 3, 6, 6]), 1) is None  # nothing shares its first token


def test_the_source_at_the_front_of_the_free_queue_is_not_handed_out_as_the_destination(
    make_request: Callable[..., Request], fake: FakeKV,
) -> None:
    kv = KVCacheManager(4, BS, fake.copy)
    a = make_request(range(6))  # blocks 0, 1 ([4, 5] partial)
    admit(kv, fake, a)
    c = make_request([50])
    admit(kv, fake, c)  # block 2
    kv.free(a)  # queue: 3, 1, 0
    d = make_request([60])
    admit(kv, fake, d)  # block 3
    kv.free(d)  # queue: 1 (a's partial block, the source), 0 (a hit), 3
    again = make_request(range(7))
    assert admit(kv, fake, again) == 6
    source, destination, _ = fake.copies[-1]
    assert (source, destination) == (1, 3)
    assert fake.tokens_of(kv, again, 7) == list(range(7))
    assert kv.pool.ref_cnt[source] == 0  # held only while copied: free again, and still indexed
    assert kv.find_partial(make_request(range(7)), 1) is not None


def test_a_partial_hit_that_does_not_fit_changes_nothing(make_request: Callable[..., Request], fake: FakeKV) -> None:
    kv = KVCacheManager(3, BS, fake.copy)
    a = make_request(range(6))
    admit(kv, fake, a)
    admit(kv, fake, make_request([50]))  # block 2 stays taken
    kv.free(a)  # free: 1 (partial source), 0 (hit)
    again = make_request(range(7))
    hits = kv.get_computed_blocks(again)
    partial = kv.find_partial(again, len(hits))
    assert partial is not None
    # both free blocks are the hit and the source: none is left for the destination
    assert not kv.allocate_slots(again, 1, hits, partial)
    assert again.request_id not in kv.block_tables
    assert kv.num_free_blocks == 2 and fake.copies == []
    assert kv.find_partial(again, len(hits)) == partial


def test_a_reused_block_leaves_the_index(make_request: Callable[..., Request], fake: FakeKV) -> None:
    kv = KVCacheManager(2, BS, fake.copy)
    a = make_request(range(6))
    admit(kv, fake, a)
    kv.free(a)  # queue: 1 (partial [4, 5]), 0
    kv.pool.allocate(1)  # block 1 handed out for new data
    assert kv.find_partial(make_request(range(7)), 1) is None
    kv.pool.reset_prefix_cache()
    assert kv.pool.children(hash("m")) == {}


def test_without_a_kv_copy_only_whole_blocks_are_reused(make_request: Callable[..., Request]) -> None:
    kv = KVCacheManager(16, BS)
    a = make_request(range(10))
    compute(kv, a)
    kv.free(a)
    again = make_request(range(10))
    assert kv.find_partial(again, len(kv.get_computed_blocks(again))) is None
    with pytest.raises(ValueError, match="partial prefix hit"):
        kv.allocate_slots(again, 1, [], PartialHit(0, 1))
