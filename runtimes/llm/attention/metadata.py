"""What one forward pass needs to read and write the paged KV cache.

A batch is *packed*: the new tokens of every scheduled sequence are concatenated, no padding.
Sequence `i` contributes `query_lens[i]` new tokens at positions
`[seq_lens[i] - query_lens[i], seq_lens[i])`; its keys/values for all `seq_lens[i]` positions live in
the blocks listed in `block_tables[i]`.

KV cache layout, one tensor per layer for K and one for V: `[num_blocks, block_size, num_kv_heads, head_dim]`.
A slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    # Host copies, so the reference path and the kernel launch need no device sync.
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    # Tensors an attention backend derives from the above, built by the first layer and reused by the
    # others in the same step (index tensors, masks): one step's metadata, so nothing goes stale.
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build from per-sequence host lists (the model runner's job, and tests')."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError(
                f"length mismatch: {len(query_lens)} query_lens, {len(seq_lens)} seq_lens, "
                f"{len(block_tables)} block_tables"
            )
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if q_len < 1 or q_len > s_len:
                raise ValueError(f"need 1 <= query_len <= seq_len, got {q_len}, {s_len}")
            if len(table) * block_size < s_len:
                raise ValueError(f"{len(table)} blocks of {block_size} cannot hold {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=to_device(slots, torch.int64, device),
            query_start_loc=to_device(starts, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            block_tables=to_device(padded, torch.int32, device).reshape(len(padded), width),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
        )


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host numbers as a tensor on `device`. To CUDA the copy is from page-locked memory and does not wait (a plain
    copy from pageable memory synchronises the stream): a step's metadata then costs no wait for the device."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
