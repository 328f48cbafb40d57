"""Per-request block tables on top of the BlockPool, and prefix-cache lookups.

Prefix keys are chained hashes of full blocks: `hash((parent_hash, block_token_ids))`, rooted in the
request's cache namespace (the model, or a request group for `n > 1`), so equal token prefixes share
blocks and different models or groups never collide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtimes.llm.block_pool import BlockPool
from runtimes.llm.request import Request


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # request id -> its blocks already in the cache index
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's chained block hashes to cover its full blocks within `num_tokens`."""
        hashes = request.block_hashes
        bs = self.block_size
        num_full = num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else hash(request.cache_namespace)
            hashes.append(hash((parent, tuple(request.token_ids[i * bs : (i + 1) * bs]))))

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

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens (after any `computed_blocks` prefix hits).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        table = self.block_tables.get(request.request_id)
        num_held = 0 if table is None else len(table)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.blocks_for(num_computed + num_new_tokens) - num_held - len(computed_blocks)
        # Hit blocks that sit unreferenced in the free queue stop being allocatable once touched.
        revived = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if num_needed > self.pool.num_free_blocks - revived:
            return False
        if table is None:
            table = self.block_tables[request.request_id] = []
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
        if num_needed > 0:
            table.extend(self.pool.allocate(num_needed))
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
        self._update_hashes(request, num_full * self.block_size)
        for i in range(start, num_full):
            self.pool.cache(table[i], request.block_hashes[i])
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block of the request; tail blocks first so they are evicted first (LRU)."""
        table = self.block_tables.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))
