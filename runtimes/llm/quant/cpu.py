"""`QuantLinear`: a projection whose weight stays in a block format (`formats`), multiplied on CPU by our kernel
(`cpu_quant.cpp`: activations quantized per block to int8 on the fly, integer dot products, weights read once per
call, one arithmetic per output element whatever the batch). The loader hands the kernel its weights once, repacked
into panels of 16 output columns (`to_panels`); from then on the module's `qweight` buffer holds that layout
(`panels` is True). The kernel is compiled on first use like the attention kernel; without a C++ compiler the
weights stay in rows and the layer dequantizes them for each call (correct, slow), which the log says once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from runtimes.cpu_extension import build, try_build
from runtimes.llm.quant.formats import BlockFormat, dequantize_rows

_SOURCE = Path(__file__).with_name("cpu_quant.cpp")
_FLAGS = ["-ffp-contract=off"]


@functools.cache
def kernel_available() -> bool:
    """Build (or reuse the cached build of) the kernel and register `torch.ops.multiserve_quant`; False, logged,
    when it cannot be built here (the layers then dequantize their weight for each call)."""
    # -march=native picks VNNI / AVX2 / scalar code for this machine; -ffp-contract=off: the kernel's float
    # operations are exactly the ones written (no multiply-add fused in one inlined copy and not in another)
    return try_build("multiserve_cpu_quant_multiserve_quant_native", _SOURCE, [*_FLAGS, "-march=native"])


def build_kernel(namespace: str, march: str, defines: Sequence[str] = ()) -> None:
    """Compile the kernel for `-march=<march>` (and `-D` each of `defines`) and register its ops under
    `torch.ops.<namespace>` (tests build the AVX2, the 256-bit VNNI and the scalar code this way, whatever this
    machine's CPU prefers)."""
    build(f"multiserve_cpu_quant_{namespace}_{march.replace('-', '_')}", _SOURCE,
          [*_FLAGS, f"-march={march}", f"-DMULTISERVE_QUANT_NS={namespace}", *(f"-D{d}" for d in defines)])


def quant_linear(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat, in_features: int, out_features: int,
                 panels: bool = False) -> torch.Tensor:
    """x `[M, K]` @ W.T: W `[N, packed_row_bytes]` in packed rows of `fmt`, or (`panels`) as `to_panels` made it.
    On CUDA the Triton kernel (y in x's dtype), on the CPU ours (y in fp32)."""
    if panels:
        return torch.ops.multiserve_quant.quant_linear(x.float(), weight, fmt.ggml_id, in_features, out_features)
    if x.is_cuda:
        from runtimes.llm.quant.triton_matmul import quant_matmul

        return quant_matmul(x, weight, fmt, in_features)
    return F.linear(x.float(), dequantize_rows(weight, fmt, in_features))


def to_panels(rows: torch.Tensor, fmt: BlockFormat, in_features: int) -> torch.Tensor:
    """Packed rows of `fmt` (CPU) -> the kernel's panels of 16 output columns (see cpu_quant.cpp)."""
    return torch.ops.multiserve_quant.pack_panels(rows, fmt.ggml_id, in_features)


class BlockWeight(nn.Module):
    """A weight kept in a block format: `qweight` holds its packed rows, or once `pack_for_cpu` has run, the CPU
    kernel's panels (`panels`). The blocks are a buffer (state dicts carry them)."""

    qweight: torch.Tensor
    fmt: BlockFormat
    panels = False

    def shape(self) -> tuple[int, int]:
        """(output rows, values per row)."""
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T on whichever kernel holds the blocks."""
        rows, width = self.shape()
        return quant_linear(x, self.qweight, self.fmt, width, rows, self.panels)

    def pack_for_cpu(self) -> bool:
        """Repack `qweight` into the CPU kernel's panels (once, after loading); False where there is no kernel."""
        if not self.panels and self.qweight.is_cpu and kernel_available():
            self.qweight = to_panels(self.qweight, self.fmt, self.shape()[1])
            self.panels = True
        return self.panels


class QuantLinear(BlockWeight):
    """A bias-free projection with its weight in a block format."""

    def __init__(self, in_features: int, out_features: int, fmt: BlockFormat, qweight: torch.Tensor) -> None:
        super().__init__()
        if tuple(qweight.shape) != (out_features, fmt.packed_row_bytes(in_features)) or qweight.dtype != torch.uint8:
            raise ValueError(f"{fmt.name} weight of {out_features} x {in_features} needs packed uint8 rows of shape "
                             f"({out_features}, {fmt.packed_row_bytes(in_features)}), got {tuple(qweight.shape)} "
                             f"{qweight.dtype}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.register_buffer("qweight", qweight)

    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}"


class QuantEmbedding(BlockWeight):
    """An embedding table kept in a block format: a lookup dequantizes the rows it returns (from the panels too,
    `panel_rows`); `project` multiplies by the table as a (tied) LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: BlockFormat, qweight: torch.Tensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.fmt = num_embeddings, embedding_dim, fmt
        self.register_buffer("qweight", qweight)

    def shape(self) -> tuple[int, int]:
        return self.num_embeddings, self.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.panels:
            return torch.ops.multiserve_quant.panel_rows(self.qweight, ids.reshape(-1).long(), self.fmt.ggml_id,
                                                         self.embedding_dim)
        return dequantize_rows(self.qweight.index_select(0, ids.reshape(-1)), self.fmt, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.matmul(hidden)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt.name}"
