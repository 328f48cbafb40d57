"""Token bitmasks: which next tokens a grammar allows, one bit per token, and their application to logits.

A bitmask is int32 `[B, ceil(V / 32)]` on the CPU, filled by the matchers (`GrammarMatcher.fill_bitmask`); bit i of
word j stands for token 32 * j + i, 1 = allowed. `apply_bitmask` sends the rows it needs to the logits' device in
one copy and unpacks them there with torch ops: each byte of the mask picks its 8 logit caps from a 256-row table
(+inf = allowed, -inf = not), and the logits take the elementwise minimum. Branch-free, so the cost does not depend
on the mask: on the CPU, for 16 rows of SmolLM2's 49,152 tokens, unpacking the bits for a boolean masked_fill_
took 2-5 ms (its loop branches on each element) and this 0.5 ms, whatever the mask (docs/benchmarks.md,
"Grammar engines").
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

__all__ = ["allocate_bitmask", "apply_bitmask", "bitmask_width"]

_INF = float("inf")
_caps: dict[torch.device, torch.Tensor] = {}  # per device: [256, 8] fp32, row b = the caps of byte value b's bits
_byte_shifts: dict[torch.device, torch.Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    """Words per row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An int32 `[batch, ceil(vocab_size / 32)]` bitmask on the CPU, every token allowed."""
    return torch.full((batch, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, each logit whose token `bitmask` does not allow: `bitmask[i]` gives the allowed tokens
    of `logits[rows[i]]`. `logits` is `[B, V]` fp32 on any device; `bitmask` int32 `[>= len(rows), W]`, on the CPU
    (one copy of its rows to the logits' device) or already there. Tokens from 32 * W on (past the mask) are not
    allowed; allowed logits are left as they are."""
    n = len(rows)
    if n == 0:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"apply_bitmask wants logits [B, V] and an int32 bitmask [N, W], got {tuple(logits.shape)} "
                         f"and {bitmask.dtype} {tuple(bitmask.shape)}")
    if bitmask.shape[0] < n:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {n} logits rows")
    device, width = logits.device, logits.shape[1]
    covered = min(width, 32 * bitmask.shape[1])
    first = rows[0]
    contiguous = all(r == first + i for i, r in enumerate(rows))
    mask, row_index = _rows_to(device, bitmask[:n], None if contiguous else rows, copy=bitmask.device != device)
    caps = _unpack(mask.contiguous(), device)[:, :covered]  # [n, covered]: +inf allowed, -inf not
    target = logits[first : first + n] if row_index is None else logits.index_select(0, row_index)
    torch.minimum(target[:, :covered], caps, out=target[:, :covered])
    if covered < width:
        target[:, covered:] = -_INF
    if row_index is not None:
        logits.index_copy_(0, row_index, target)


def _rows_to(device: torch.device, mask: torch.Tensor, rows: Sequence[int] | None, *,
             copy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mask rows on `device`, and the logits rows they go to as a long tensor there (None: a contiguous run).
    With `copy`, one host-to-device copy: the row indices ride in it as one more column."""
    if not copy:
        return mask, None if rows is None else torch.as_tensor(list(rows), dtype=torch.long, device=device)
    if rows is None:
        return mask.to(device, non_blocking=True), None
    words = mask.shape[1]
    packed = torch.empty((mask.shape[0], words + 1), dtype=torch.int32)
    packed[:, :words] = mask
    packed[:, words] = torch.as_tensor(list(rows), dtype=torch.int32)
    on_device = packed.to(device, non_blocking=True)
    return on_device[:, :words], on_device[:, words].long()


def _unpack(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int32 `[n, W]` -> fp32 caps `[n, 32 * W]` (+inf where the bit is set, -inf where not)."""
    caps = _caps.get(device)
    if caps is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        caps = _caps[device] = torch.where(bits == 1, _INF, -_INF).to(torch.float32).to(device)
    if sys.byteorder == "little":  # byte k of a word holds its bits 8k..8k+7
        byte_values = mask.view(torch.uint8).reshape(-1).long()
    else:
        shifts = _byte_shifts.get(device)
        if shifts is None:
            shifts = _byte_shifts[device] = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=device)
        byte_values = ((mask.unsqueeze(-1) >> shifts) & 0xFF).reshape(-1).long()
    return caps.index_select(0, byte_values).view(mask.shape[0], -1)
