"""The weight block formats the runtime computes on: llama.cpp's Q8_0, Q4_0 and Q4_1, blocks of 32 values.

GGUF stores a block as its float16 scale d (Q4_1: and float16 min m) followed by its values:

| format | GGML id | GGUF block bytes | value |
|---|---|---|---|
| Q8_0 | 8 | 34 | d * q, q int8 |
| Q4_0 | 2 | 18 | d * (q - 8), q 0..15 |
| Q4_1 | 3 | 20 | d * q + m, q 0..15 |

(In a 4-bit block, byte j holds value j in its low nibble and value j + 16 in its high one.)

The loader keeps one packed row layout for all three, `w = d * u + c` with u unsigned: a row's values first (4-bit:
16 bytes a block, as GGUF's; 8-bit: u = q + 128, 32 bytes), then its float16 scales d, then its float16 offsets c
(Q4_1: m; Q4_0: -8 d; Q8_0: -128 d), the block count padded to even with zero blocks. The Triton kernel reads it as
it is; the CPU kernel (`cpu_quant.cpp`) gets it repacked once into panels of 16 output columns. `pack` converts
GGUF blocks to it (numpy, vectorized, exact); other GGUF types are requantized first (gguf-py's quantizer and
dequantizer, llama.cpp's own reference code).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_id: int
    gguf_block_bytes: int
    bits: int  # of the packed values: 4 or 8

    def packed_row_bytes(self, in_features: int) -> int:
        """Bytes of one packed row of `in_features` values: values, scales and offsets of its padded blocks."""
        return padded_blocks(in_features) * (BLOCK * self.bits // 8 + 4)


Q8_0 = BlockFormat("Q8_0", 8, 34, 8)
Q4_0 = BlockFormat("Q4_0", 2, 18, 4)
Q4_1 = BlockFormat("Q4_1", 3, 20, 4)
FORMATS = {f.ggml_id: f for f in (Q8_0, Q4_0, Q4_1)}


def format_of(ggml_id: int) -> BlockFormat | None:
    """The kernel's format for a GGML tensor type id, or None when the kernel cannot compute on it as it is."""
    return FORMATS.get(int(ggml_id))


def pack(blocks: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    """GGUF blocks of `fmt`, `[N, K / 32 * block bytes]` uint8 -> the kernel's packed rows `[N, packed_row_bytes]`."""
    n, nb = blocks.shape[0], blocks.shape[1] // fmt.gguf_block_bytes
    nbp, value_bytes = nb + nb % 2, BLOCK * fmt.bits // 8
    b = np.asarray(blocks).reshape(n, nb, fmt.gguf_block_bytes)
    d = _halves(b[..., 0:2])
    if fmt is Q8_0:
        values = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        c = (d.astype(np.float32) * -128).astype(np.float16)
    elif fmt is Q4_0:
        values, c = b[..., 2:], (d.astype(np.float32) * -8).astype(np.float16)
    else:
        values, c = b[..., 4:], _halves(b[..., 2:4])
    out = np.zeros((n, fmt.packed_row_bytes(nb * BLOCK)), dtype=np.uint8)
    out[:, : nb * value_bytes] = values.reshape(n, nb * value_bytes)
    scales = nbp * value_bytes
    out[:, scales : scales + nb * 2] = d.view(np.uint8).reshape(n, nb * 2)
    out[:, scales + nbp * 2 : scales + nbp * 2 + nb * 2] = c.view(np.uint8).reshape(n, nb * 2)
    return out


def quantize(weight: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    """fp32 `[N, K]` -> packed rows of `fmt` (K a multiple of 32), through llama.cpp's reference quantizer."""
    import gguf
    from gguf.quants import quantize as gguf_quantize

    if weight.shape[-1] % BLOCK:
        raise ValueError(f"a quantized weight's rows must be a multiple of {BLOCK} wide, got {weight.shape[-1]}")
    blocks = gguf_quantize(np.ascontiguousarray(weight, dtype=np.float32), gguf.GGMLQuantizationType(fmt.ggml_id))
    return pack(blocks, fmt)


def dequantize_rows(packed: torch.Tensor, fmt: BlockFormat, in_features: int) -> torch.Tensor:
    """Packed rows -> fp32 `[R, in_features]`, in torch: the embedding lookup, and the reference the kernel is
    tested against."""
    nb = in_features // BLOCK
    nbp, value_bytes = padded_blocks(in_features), BLOCK * fmt.bits // 8
    rows = packed.shape[0]
    values = packed[:, : nbp * value_bytes].reshape(rows, nbp, value_bytes)[:, :nb]
    scales = nbp * value_bytes
    d = packed[:, scales : scales + nbp * 2].contiguous().view(torch.float16)[:, :nb, None].float()
    c = packed[:, scales + nbp * 2 :].contiguous().view(torch.float16)[:, :nb, None].float()
    u = torch.cat((values & 0x0F, values >> 4), dim=-1) if fmt.bits == 4 else values
    return (d * u.float() + c).reshape(rows, in_features)


def padded_blocks(in_features: int) -> int:
    """Blocks per packed row: K / 32 padded to an even count (the CPU kernel reads blocks in pairs)."""
    nb = in_features // BLOCK
    return nb + nb % 2


def _halves(pairs: np.ndarray) -> np.ndarray:
    """`[..., 2]` uint8 -> `[...]` float16."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0]
