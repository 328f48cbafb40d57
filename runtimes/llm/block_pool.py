"""The one owner of KV-block accounting: reference counts, the free queue and the prefix-cache index.

Free blocks wait in an LRU queue (an insertion-ordered dict: O(1) pop from the front, O(1) removal
from the middle). A block that held a full, hashed prefix keeps its hash while it waits there, so a
later request can revive it; it is evicted only when the queue hands it out for new data.

Beside the hash index, blocks are also indexed by their parent's prefix hash with the tokens whose KV they hold
(full cached blocks, and the partly filled last block of a finished or preempted request): a request whose next
block matches none in full can still copy the KV of its longest common token prefix with one of them
(`KVCacheManager.find_partial`), so a repeated prompt or a conversation's next turn reuses every computed token,
not only whole blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # prefix hash -> block id
        # parent prefix hash -> {block id: the tokens (after that prefix) whose KV the block holds}, newest last
        self._children: dict[int, dict[int, tuple[int, ...]]] = {}
        self._parent: dict[int, int] = {}  # block id -> its key in _children
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (some may still hold reusable cached prefixes)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the front of the free queue, evicting their cached prefixes."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with only {len(self._free)} free")
        block_ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            old = self.block_hash[block_id]
            if old is not None:
                if self._cached.get(old) == block_id:
                    del self._cached[old]
                self.block_hash[block_id] = None
                self.num_evictions += 1
            self._forget_child(block_id)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference to existing (cached or shared) blocks."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop a reference; unreferenced blocks join the back of the LRU queue in the order given."""
        for block_id in block_ids:
            count = self.ref_cnt[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed with ref_cnt={count}")
            self.ref_cnt[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: int, parent: int | None = None,
              tokens: tuple[int, ...] = ()) -> None:
        """Register a full block under its prefix hash (first writer wins on duplicates), and, given its parent's
        hash and its tokens, as a child that later prefixes can copy a part of."""
        if self.block_hash[block_id] is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash
            if parent is not None:
                self.add_child(block_id, parent, tokens)

    def add_child(self, block_id: int, parent: int, tokens: tuple[int, ...]) -> None:
        """Index a block whose first `len(tokens)` slots hold the KV of `tokens` after the prefix `parent`. The
        caller guarantees those slots are final: the block is full and cached, or partial and no longer written
        (its request is gone); the entry lasts until the block is handed out again."""
        self._forget_child(block_id)
        self._children.setdefault(parent, {})[block_id] = tokens
        self._parent[block_id] = parent

    def children(self, parent: int) -> dict[int, tuple[int, ...]]:
        """The indexed blocks after the prefix `parent`, oldest first (do not modify)."""
        return self._children.get(parent, {})

    def _forget_child(self, block_id: int) -> None:
        parent = self._parent.pop(block_id, None)
        if parent is not None:
            siblings = self._children[parent]
            del siblings[block_id]
            if not siblings:
                del self._children[parent]

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._cached.values()):
            self.block_hash[block_id] = None
        self._cached.clear()
        self._children.clear()
        self._parent.clear()
