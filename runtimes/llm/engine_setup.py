"""Building an engine's parts from a loaded model and its config: the KV block pool sized from the budget, the model
runner with its sampler, the decode graphs where they apply, and the waiting queue's policy."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch

from runtimes.llm.config import EngineConfig, resolve_kv_dtype
from runtimes.llm.cuda_graphs import DecodeGraphs, Graph, capture_sizes, cuda_graph_factory, graphs_apply
from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.loader import LoadedModel
from runtimes.llm.logits_processors import BUILTIN_PROCESSORS, LogitsProcessor
from runtimes.llm.model_runner import ModelRunner, allocate_kv_caches, num_blocks_for_budget
from runtimes.llm.queue_policy import FCFSPolicy, QueuePolicy
from runtimes.llm.sampler import Sampler

log = structlog.get_logger(__name__)


@dataclass
class EngineParts:
    kv: KVCacheManager
    runner: ModelRunner
    max_model_len: int


def build_parts(loaded: LoadedModel, config: EngineConfig, new_graph: Callable[[], Graph] | None,
                logits_processors: Sequence[LogitsProcessor]) -> EngineParts:
    """The KV cache, the runner and (with `new_graph`, or on CUDA when `config.cuda_graphs`) the decode graphs."""
    if config.deterministic:
        from runtimes.llm import batch_invariant  # Triton: imported only when asked for

        batch_invariant.apply(loaded.model)
    device = next(loaded.model.parameters()).device
    dtype = next(loaded.model.parameters()).dtype
    max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                        loaded.config.max_position_embeddings)
    budget = config.kv_cache_budget(device)
    kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype, device)
    num_blocks = num_blocks_for_budget(loaded.config, budget, config.block_size, kv_dtype)
    if new_graph is None and config.cuda_graphs and device.type == "cuda":
        new_graph = cuda_graph_factory()
    if new_graph is not None and not graphs_apply(loaded.model, kv_dtype):
        log.warning("decode_graphs_off", reason="the attention backend, or a mixture's expert loop, reads host values",
                    attention_backend=config.attention_backend)
        new_graph = None
    reserved = 0 if new_graph is None else 1  # the decode graphs' pad block, out of the block pool
    if num_blocks < 1 + reserved:
        raise ValueError(f"kv_cache_bytes={budget} is too small for {1 + reserved} blocks of "
                         f"{config.block_size} tokens")
    kv = KVCacheManager(num_blocks - reserved, config.block_size, window=loaded.config.sliding_window,
                        max_chunk=config.max_num_batched_tokens)
    kv_caches = allocate_kv_caches(loaded.config, num_blocks, config.block_size, kv_dtype, device)
    # noise drawn where the logits are
    sampler = Sampler(torch.Generator(device=device).manual_seed(config.seed),
                      (*BUILTIN_PROCESSORS, *logits_processors))
    runner = ModelRunner(loaded.model, kv_caches, config.block_size, device, sampler)
    kv.copy_prefix = runner.copy_block_prefix  # prefix hits that end inside a block
    if new_graph is not None:
        started = time.perf_counter()
        runner.graphs = DecodeGraphs(loaded.model, kv_caches, config.block_size,
                                     -(-max_model_len // config.block_size), num_blocks - 1,
                                     capture_sizes(config.max_num_seqs), new_graph)
        log.info("decode_graphs_captured", sizes=runner.graphs.sizes,
                 seconds=round(time.perf_counter() - started, 2))
    return EngineParts(kv, runner, max_model_len)


def queue_policy(config: EngineConfig, clock: Callable[[], float]) -> QueuePolicy:
    if config.scheduling == "multilevel":
        options = config.multilevel_config()
        from policies.multilevel import MultiLevelPolicy

        return MultiLevelPolicy(options, clock=clock)  # type: ignore[return-value]  # structurally a QueuePolicy
    return FCFSPolicy()

