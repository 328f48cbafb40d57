"""Decode steps as CUDA graph replays: one launch per step instead of ~30 kernels per layer.

A decode step's work has the same shape every time for a given batch size, so, as vLLM and SGLang do, the model's
forward pass is captured once per *batch-size bucket* (1, 2, 4, then every 8 up to the largest) and each later decode
step replays the smallest bucket that holds its batch. A graph replays the exact kernels, pointers and launch grids
it was captured with, so everything that changes between steps must be read from the device, at fixed addresses:

* **Static buffers.** Token ids, positions, KV slots, sequence lengths and the block table live in tensors made once
  at the largest bucket's size; each bucket's graph reads a prefix of them. Rows past the batch in its bucket are
  padding: token 0 at position 0 with one cached token, written to and read from a *pad block* of the KV cache that
  the engine keeps out of its block pool, so a padding row never touches a request's KV. The graph's hidden states
  for those rows are dropped.
* **Host metadata is baked in.** Whatever the forward pass reads from the host at capture (`seq_lens_host`, a grid
  sized by the longest sequence) stays as captured. Only attention backends that read their lengths and tables from
  device tensors may be captured (`attention.reads_only_device_metadata`); with another, decode runs eagerly.
* **Metadata in pinned host buffers.** A step writes its ids, positions and slots into one int64 host buffer and its
  lengths and block-table rows into one int32 buffer, both page-locked on CUDA, then copies each to the device
  asynchronously: two copies a step, with no synchronisation. Block-table rows are kept from step to step: a row that
  holds the same block-table list as last step is only extended by its new blocks (the KV manager's lists only grow; a
  request that loses its blocks, or hands back a rejected proposal's, gets a new list). There are two sets of host
  buffers, used in turn: a step launched ahead (runtimes/llm/steps/ahead.py) writes one while the copies of the step
  before it may still be reading the other, and by the time a set comes round again the step that used it has been
  waited for.
* **Token ids from the device.** A step launched before the previous one's tokens are back takes its input ids
  from that step's sampled tokens on the device (`run(..., device_ids)`), copied into the static buffer in stream
  order after the host copies.

The graphs run only for steps where every scheduled request has exactly one new token and the batch fits the largest
bucket; other steps (prefills, chunked prefills, bigger batches) run eagerly, with the same kernels. A graph replay
cannot stop between layers, so an urgent arrival waits for the rest of a decode step (a few milliseconds at most).

`Graph` is the seam: `CudaGraph` wraps `torch.cuda.CUDAGraph` (every bucket in one memory pool, captured largest
first so the smaller ones reuse its memory, each after an eager warm-up run on a side stream that compiles the Triton
kernels and sizes the workspaces); tests capture with a CPU stand-in that reruns the captured function over the same
static tensors and host values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

from runtimes.llm.attention import AttentionMetadata, reads_only_device_metadata
from runtimes.llm.attention.cpu_paged import kernel_takes, paged_attention_cpu
from runtimes.llm.model import DecoderLayer, LlamaForCausalLM, MixtureOfExperts

MAX_CAPTURED_BATCH = 256  # larger decode batches run eagerly (their launch overhead is small next to their work)


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record `fn` (which reads only the static buffers) and return its output tensor, which every `replay`
        refills in place."""

    def replay(self) -> None: ...


class CudaGraph:
    """`torch.cuda.CUDAGraph` for one bucket; `pool` and the warm-up stream `side` are shared by all of a runner's
    graphs."""

    def __init__(self, pool: Any, side: torch.cuda.Stream) -> None:
        self.pool = pool
        self.side = side
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # Warm up outside the graph, on a side stream as torch.cuda.graphs recommends: Triton compiles its kernels
        # and the libraries size their workspaces then, since neither may happen during capture.
        side = self.side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], Graph]:
    """New `CudaGraph`s that share one memory pool and one warm-up stream: cuBLAS keeps a workspace per stream it
    runs on (32 MiB on Hopper), which a stream per bucket would pay for again at every bucket."""
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    return lambda: CudaGraph(pool, side)


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURED_BATCH) -> list[int]:
    """The batch-size buckets: 1, 2, 4, then multiples of 8, up to min(max_num_seqs, limit) (included)."""
    top = min(max_num_seqs, limit)
    return sorted({s for s in (1, 2, 4) if s < top} | set(range(8, top, 8)) | {top})


class _Staging:
    """One set of host buffers a step's metadata is written into (page-locked on CUDA), and what its block-table rows
    hold. int64: ids | positions | slots, each `rows` long; int32: seq_lens (`rows`) | block table (`rows` x width)."""

    def __init__(self, rows: int, width: int, pad_block: int, block_size: int, pinned: bool) -> None:
        self.rows, self.pad_block, self.block_size = rows, pad_block, block_size
        self.host64 = torch.zeros(3 * rows, dtype=torch.int64, pin_memory=pinned)
        self.host32 = torch.zeros(rows * (1 + width), dtype=torch.int32, pin_memory=pinned)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self.tables = self.np32[rows:].reshape(rows, width)
        self.tables[:] = pad_block
        # per table row: the block-table list it holds (kept alive, so its identity stays unique) and how many of its
        # blocks are written
        self.row_owner: list[tuple[list[int], int] | None] = [None] * rows
        self.reset_rows(0, rows)

    def fill(self, input_ids: Sequence[int], positions: Sequence[int], tables: Sequence[list[int]], size: int) -> None:
        """Rows [0, B) for the step, [B, size) padding."""
        rows, bs, np64, tables_np = self.rows, self.block_size, self.np64, self.tables
        for i, (position, table) in enumerate(zip(positions, tables, strict=True)):
            np64[rows + i] = position
            np64[2 * rows + i] = table[position // bs] * bs + position % bs
            owner = self.row_owner[i]
            have = owner[1] if owner is not None and owner[0] is table else 0
            if len(table) > have:
                tables_np[i, have:len(table)] = table[have:]
                self.row_owner[i] = (table, len(table))
        batch = len(positions)
        np64[:batch] = input_ids
        self.np32[:batch] = [p + 1 for p in positions]
        self.reset_rows(batch, size)

    def reset_rows(self, start: int, stop: int) -> None:
        """Rows [start, stop) become padding: token 0 at position 0, one token, all in the pad block (a table row is
        rewritten only if a request held it)."""
        rows = self.rows
        self.np64[start:stop] = 0
        self.np64[rows + start:rows + stop] = 0
        self.np64[2 * rows + start:2 * rows + stop] = self.pad_block * self.block_size
        self.np32[start:stop] = 1
        for i in range(start, stop):
            if self.row_owner[i] is not None:
                self.tables[i] = self.pad_block
                self.row_owner[i] = None


class DecodeGraphs:
    """The captured decode graphs of one model runner, their static buffers and their pinned host buffers."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_blocks_per_seq: int,
        pad_block: int,
        sizes: Sequence[int],
        new_graph: Callable[[], Graph],
    ) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = sorted(sizes)
        self.pad_block = pad_block
        self.width = max_blocks_per_seq
        device = kv_caches[0][0].device
        rows = self.max_size
        # Two sets, used in turn: while one step's copies may still be reading one set (an overlapped step, see
        # LLMEngine), the next step writes the other.
        self._staging = [_Staging(rows, self.width, pad_block, block_size, pinned=device.type == "cuda")
                         for _ in range(2)]
        self._turn = 0
        self._dev64 = torch.zeros(3 * rows, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(rows * (1 + self.width), dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._dev64.view(3, rows)
        self.seq_lens = self._dev32[:rows]
        self.block_tables = self._dev32[rows:].view(rows, self.width)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one query per row
        self._copy(self._staging[0], rows)
        self._graphs: dict[int, Graph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        for size in sorted(self.sizes, reverse=True):  # largest first: the others reuse its pool memory
            graph = new_graph()
            self._outputs[size] = graph.capture(self._forward(size))
            self._graphs[size] = graph

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, batch: int) -> int | None:
        """The smallest captured size that holds `batch` rows, None when none does."""
        return next((s for s in self.sizes if s >= batch), None)

    def run(self, input_ids: Sequence[int], positions: Sequence[int], tables: Sequence[list[int]],
            device_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The final hidden states `[B, H]` of a step whose B rows each have one new token (`input_ids[i]` at
        `positions[i]`, KV in `tables[i]`), by graph replay; None when no bucket holds B rows. `device_ids` `[B]`, when
        given, are the token ids instead of `input_ids`: a step in flight samples them, on the device."""
        batch = len(positions)
        size = self.bucket(batch)
        if size is None or batch == 0:
            return None
        staging = self._staging[self._turn]
        self._turn ^= 1
        staging.fill(input_ids, positions, tables, size)
        self._copy(staging, size)
        if device_ids is not None:
            self.input_ids[:batch].copy_(device_ids)  # after the host copy, in stream order
        self._graphs[size].replay()
        self.replays += 1
        return self._outputs[size][:batch]

    def _copy(self, staging: _Staging, size: int) -> None:
        """Host buffers to the static device buffers: the int64 one whole (a few KB), the int32 one up to the
        bucket's last table row. Asynchronous from pinned memory on CUDA."""
        self._dev64.copy_(staging.host64, non_blocking=True)
        upto = self.max_size + size * self.width
        self._dev32[:upto].copy_(staging.host32[:upto], non_blocking=True)

    def _forward(self, size: int) -> Callable[[], torch.Tensor]:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens_host=(1,) * size,
            seq_lens_host=(1,) * size,  # baked in: only backends that do not read it are captured
        )
        ids, positions = self.input_ids[:size], self.positions[:size]
        return lambda: self.model(ids, positions, self.kv_caches, meta)


def graphs_apply(model: LlamaForCausalLM, kv_dtype: torch.dtype) -> bool:
    """Whether `model`'s decode steps over a `kv_dtype` cache may be captured: its attention reads only device
    metadata (the CPU kernel's does for its own dtypes only: others go to the reference, which reads host copies),
    and a mixture's experts run as the grouped GEMM (their loop reads each expert's token count back to the host:
    block-format experts, `engine.deterministic`)."""
    layers = cast(list[DecoderLayer], list(model.layers))
    if not layers:
        return False
    if any(isinstance(layer.mlp, MixtureOfExperts) and not layer.mlp.grouped_applies() for layer in layers):
        return False
    attention = layers[0].self_attn.attention_fn
    if attention is paged_attention_cpu and not kernel_takes(model.norm.weight.dtype, kv_dtype):
        return False
    return reads_only_device_metadata(attention)
