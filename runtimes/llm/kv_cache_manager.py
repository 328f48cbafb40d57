"""Per-request block tables on top of the BlockPool, and prefix-cache lookups.

Prefix keys are chained hashes of full blocks: `hash((parent_hash, block_token_ids))`, rooted in the
request's cache namespace (the model, or a request group for `n > 1`), so equal token prefixes share
blocks and different models or groups never collide.

Past the last whole block that matches, a request may match part of one more: the longest common token prefix with
a block indexed under the same parent (a full cached block, or the partly filled last block a finished or preempted
request left). Those tokens' KV is copied into the request's own new block (`copy_prefix`, the engine's KV copy), so
a prompt sent again computes only its last token, and a conversation's next turn only its new tokens. The copy is
exact: a token's KV depends only on the tokens up to it, and the kernels compute it with the same bits in any batch.

With sliding-window attention on every layer (`window`), a request's blocks that lie wholly before its next token's
window are never read again: `release_behind_window` hands them back to the pool as the request advances (still
indexed, so another request with the same prefix can hit them while they last). Their ids stay in the request's
table (positions keep their blocks), and the attention kernels never read them. A prefix hit's blocks that lie wholly
behind the window of the request's first new token are not taken at all (only named in its table), so a long prompt
sent again holds no more blocks than its window needs; `blocks_at_most` is what a request can hold at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from registry.engine import sequence_blocks
from runtimes.llm.block_pool import BlockPool
from runtimes.llm.request import Request


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True, slots=True)
class PartialHit:
    """The KV of the first `num_tokens` slots of block `source` serves the request's next block."""

    source: int
    num_tokens: int


# (source block, destination block, tokens): copy the KV of the first `tokens` slots in every layer
CopyPrefix = Callable[[int, int, int], None]

MAX_PARTIAL_CANDIDATES = 64  # the newest blocks after one prefix compared with a request's next block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, copy_prefix: CopyPrefix | None = None,
                 window: int = 0, max_chunk: int = 0) -> None:
        self.block_size = block_size
        self.window = window  # every layer's attention window in tokens (0: some layer sees the whole context)
        self.max_chunk = max_chunk  # the most tokens one step computes for a request (0: unknown, no bound)
        self.pool = BlockPool(num_blocks, block_size)
        self.copy_prefix = copy_prefix  # None: only whole blocks are reused
        self.block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # request id -> its blocks already in the cache index
        self._num_released: dict[str, int] = {}  # request id -> its leading blocks handed back (behind its window)
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_at_most(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once (`registry.engine.sequence_blocks`)."""
        return sequence_blocks(num_tokens, self.block_size, self.window, self.max_chunk)

    def _behind(self, num_computed: int) -> int:
        """Blocks wholly before the window of the token at position `num_computed` (0 without a window)."""
        return max(0, num_computed + 1 - self.window) // self.block_size if self.window else 0

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's chained block hashes to cover its full blocks within `num_tokens`."""
        hashes = request.block_hashes
        bs = self.block_size
        num_full = num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            hashes.append(hash((self._parent_hash(request, i), tuple(request.token_ids[i * bs : (i + 1) * bs]))))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Longest run of cached full blocks matching the request's prefix.

        At least one token is always left to compute, since the step must produce logits for it.
        """
        if request.cache_namespace is None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_hashes(request, max_blocks * self.block_size)
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits  # stats are counted by the caller, once per request (first admission)

    def find_partial(self, request: Request, num_hit_blocks: int) -> PartialHit | None:
        """After `num_hit_blocks` whole-block hits (`get_computed_blocks`), the indexed block sharing the longest
        token prefix with the request's next block, short of its last token (always computed); None when no such
        block shares a token, or when KV cannot be copied."""
        if self.copy_prefix is None or request.cache_namespace is None:
            return None
        bs = self.block_size
        start = num_hit_blocks * bs
        wanted = request.token_ids[start : min(start + bs, request.num_tokens - 1)]
        if not wanted:
            return None
        self._update_hashes(request, start)
        parent = self._parent_hash(request, num_hit_blocks)
        best: PartialHit | None = None
        for block_id, tokens in itertools.islice(reversed(self.pool.children(parent).items()), MAX_PARTIAL_CANDIDATES):
            n = 0
            for a, b in zip(wanted, tokens, strict=False):
                if a != b:
                    break
                n += 1
            if n and (best is None or n > best.num_tokens):
                best = PartialHit(block_id, n)
                if n == len(wanted):
                    break
        return best

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = (),
                       partial: PartialHit | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens (after any `computed_blocks` prefix hits and a `partial` one,
        whose KV is copied into the first new block here).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        table = self.block_tables.get(request.request_id)
        num_held = 0 if table is None else len(table)
        if partial is not None and (num_held or self.copy_prefix is None):
            raise ValueError("a partial prefix hit only starts a request's block table, and needs a KV copy")
        num_computed = (request.num_computed_tokens + len(computed_blocks) * self.block_size
                        + (0 if partial is None else partial.num_tokens))
        num_needed = self.blocks_for(num_computed + num_new_tokens) - num_held - len(computed_blocks)
        # Hit blocks that sit unreferenced in the free queue stop being allocatable once touched, and so does a
        # partial hit's source while it is copied.
        # With a window, the hits wholly behind the first new token's window are never read: named, not taken.
        behind = min(len(computed_blocks), self._behind(num_computed))
        taken = computed_blocks[behind:]
        revived = sum(1 for b in taken if self.pool.ref_cnt[b] == 0)
        if partial is not None and self.pool.ref_cnt[partial.source] == 0:
            revived += 1
        if num_needed > self.pool.num_free_blocks - revived:
            return False
        if table is None:
            table = self.block_tables[request.request_id] = []
        if computed_blocks:
            self.pool.touch(taken)
            table.extend(computed_blocks)
            if behind:  # as if released behind the window: never freed, nor indexed again, by this request
                self._num_released[request.request_id] = behind
                self._num_registered[request.request_id] = behind
        if partial is not None:
            self.pool.touch([partial.source])  # not handed out as the destination below
        if num_needed > 0:
            table.extend(self.pool.allocate(num_needed))
        if partial is not None:
            assert self.copy_prefix is not None
            try:
                self.copy_prefix(partial.source, table[len(computed_blocks)], partial.num_tokens)
            finally:
                self.pool.free([partial.source])
        return True

    def commit(self, request: Request) -> None:
        """Register the request's blocks that its computed tokens have filled (each block once per request).

        Called once a step's results are applied, never when slots are allocated: a block enters the cache index
        only once its KV is written in every layer, so a step that stops part-way or fails (its KV half written)
        leaves nothing another request could match.
        """
        table = self.block_tables.get(request.request_id)
        if request.cache_namespace is None or table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        bs = self.block_size
        self._update_hashes(request, num_full * bs)
        for i in range(start, num_full):
            self.pool.cache(table[i], request.block_hashes[i], self._parent_hash(request, i),
                            tuple(request.token_ids[i * bs : (i + 1) * bs]))
        self._num_registered[request.request_id] = num_full

    def trim(self, request: Request) -> int:
        """Hand back the request's blocks past the one its next token goes in (at `num_computed_tokens`): slots
        allocated for proposed tokens that were rejected (their KV, written, is never read: positions are written
        again before they are read). Returns how many blocks went back."""
        table = self.block_tables.get(request.request_id)
        if table is None:
            return 0
        keep = self.blocks_for(request.num_computed_tokens + 1)
        if len(table) <= keep:
            return 0
        surplus = table[keep:]
        # a new list, not the old one cut short: a table that shrinks is a new table to whoever keeps a copy of one
        # and tops it up as it grows (the decode graphs' staging, runtimes/llm/cuda_graphs.py)
        self.block_tables[request.request_id] = table[:keep]
        self.pool.free(reversed(surplus))
        return len(surplus)

    def release_behind_window(self, request: Request) -> int:
        """Hand back the request's blocks wholly before the window of its next token (at `num_computed_tokens`):
        no later query of it reads them. Called once a step's results are applied, after `commit` (so a full block
        is indexed before it goes back). Returns how many blocks were released."""
        table = self.block_tables.get(request.request_id)
        if not self.window or table is None:
            return 0
        behind = self._behind(request.num_computed_tokens)
        done = self._num_released.get(request.request_id, 0)
        if behind <= done:
            return 0
        self.pool.free(table[done:behind])
        self._num_released[request.request_id] = behind
        return behind - done

    def _parent_hash(self, request: Request, block_index: int) -> int:
        """The prefix hash before the request's block `block_index` (its hashes cover the blocks before it)."""
        return request.block_hashes[block_index - 1] if block_index else hash(request.cache_namespace)

    def free(self, request: Request) -> None:
        """Release every block of the request; tail blocks first so they are evicted first (LRU). A partly filled
        last block is indexed with the tokens it holds, for `find_partial` (nothing writes it any more)."""
        table = self.block_tables.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        released = self._num_released.pop(request.request_id, 0)
        if not table:
            return
        bs = self.block_size
        computed = request.num_computed_tokens
        last = computed // bs
        if (self.copy_prefix is not None and request.cache_namespace is not None and computed % bs
                and last < len(table) and self.pool.ref_cnt[table[last]] == 1):
            self._update_hashes(request, last * bs)
            self.pool.add_child(table[last], self._parent_hash(request, last),
                                tuple(request.token_ids[last * bs : computed]))
        self.pool.free(reversed(table[released:]))
