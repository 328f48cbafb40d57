"""A GGUF file's metadata and tensor table, read straight from a memory map.

gguf-py's `GGUFReader` builds numpy views for every part of every metadata value: for a 49k-token vocabulary that
is ~1 million memmap slices, ~4 s and ~160 MB before a single weight is read. This reader walks the same layout
with `struct` over the mapped bytes (strings decoded once, number arrays as one `frombuffer` each) and keeps
gguf-py for what it is good at: its enums, block sizes and byte shapes, and `dequantize`. Tensors come back as
gguf-py's do (`name`, `tensor_type`, `shape` in GGUF's order, `data` a read-only view of the map shaped as gguf-py
shapes it), so the loader takes either; `tests/runtimes/llm/test_gguf_file.py` checks the two agree on real files.

Layout (little-endian): magic `GGUF`, version (uint32, 2 or 3), tensor count and metadata count (uint64); each
metadata entry a string key, a uint32 value type and the value (an array: element type, uint64 count, elements;
a string: uint64 length, UTF-8 bytes); each tensor's name, dimension count (uint32), dimensions (uint64 each),
GGML type (uint32) and data offset (uint64); then the data, aligned to `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOAT_ITEMS = {0: np.float32, 1: np.float16, 28: np.float64, 24: np.int8, 25: np.int16, 26: np.int32,
                27: np.int64}  # GGML types gguf-py exposes as values rather than bytes
# GGML type id -> (values per block, bytes per block) of the block-quantized types, as the GGUF format defines them
# (a test checks them against gguf-py's GGML_QUANT_SIZES; kept here so that reading a file does not import gguf-py,
# ~3 MiB resident for the replica's life)
QUANT_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40), 10: (256, 84),
                11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292), 16: (256, 66),
                17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
                23: (256, 136), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36),
                41: (128, 18)}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int  # the GGML type id (gguf-py's GGMLQuantizationType values)
    shape: tuple[int, ...]  # GGUF's order: shape[0] is the contiguous (innermost) dimension
    data: np.ndarray  # read-only view of the memory map


class GGUFFile:
    """`metadata` (key -> str, int, float, bool, or a list of them) and `tensors`, in file order."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
        try:
            self._read(path)
        except (struct.error, ValueError, UnicodeError) as exc:
            if str(exc).startswith(str(path)):
                raise
            raise ValueError(f"{path}: truncated or corrupt GGUF file ({exc})") from None

    def _read(self, path: str | Path) -> None:
        self._pos = 4
        version, tensor_count, kv_count = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(name, dims, ggml_type, data_start + offset) for name, dims, ggml_type, offset
                        in infos]

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = bytes(self._buf[self._pos : self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _SCALARS:  # numbers: one read of the whole array
                dtype = np.dtype(_SCALARS[item_type])
                items = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
                self._pos += dtype.itemsize * count
                return items.tolist()
            return [self._value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {self._pos}")
        return self._unpack(_SCALARS[value_type])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._unpack("<I")
        dims = tuple(self._unpack("<Q") for _ in range(n_dims))
        return name, dims, self._unpack("<I"), self._unpack("<Q")

    def _tensor(self, name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> GGUFTensor:
        numpy_shape = tuple(reversed(dims))
        elements = int(np.prod(dims)) if dims else 1
        if ggml_type in _FLOAT_ITEMS:
            data = np.frombuffer(self._buf, dtype=_FLOAT_ITEMS[ggml_type], count=elements, offset=offset)
        elif ggml_type in QUANT_BLOCKS:
            block_size, type_size = QUANT_BLOCKS[ggml_type]
            if numpy_shape[-1] % block_size:
                raise ValueError(f"tensor {name!r}: {numpy_shape[-1]} values per row is not a whole number of "
                                 f"blocks of {block_size} (GGML type {ggml_type})")
            data = np.frombuffer(self._buf, dtype=np.uint8, count=elements * type_size // block_size, offset=offset)
            numpy_shape = (*numpy_shape[:-1], numpy_shape[-1] // block_size * type_size)
        else:
            raise ValueError(f"tensor {name!r} has GGML type {ggml_type}, which this reader does not know")
        return GGUFTensor(name, ggml_type, dims, data.reshape(numpy_shape))
