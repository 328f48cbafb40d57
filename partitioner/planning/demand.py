"""What each replica asks of a device: memory (weights + KV budget), SM share, isolation and time-slice weight.

Model shapes are inputs (`ModelShape`, e.g. from a `--shapes` file), never read from the weights here: the
planner is pure and fast, and plans can be made for models that are not on this machine. Serving estimates the
shape of a model whose weights are here from their metadata (`shapes.plan_shapes`) and hands it in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from foundation.config_files import config_path
from partitioner.planning.plan import InfeasiblePlan
from registry.engine import EngineSpec, draft_model_of, kv_cache_budget, sequence_blocks
from registry.fields import GIB, MIB, Device, Isolation, gib
from registry.schema import ModelSpec, Registry

# Each process on a GPU pays for more than weights and KV: its CUDA context (0.4-0.55 GiB on Hopper with torch's
# kernels loaded), a cuBLAS workspace per stream it runs on (32 MiB each on Hopper: the default, the graphs' capture
# and warm-up streams), the decode graphs' memory pool (the largest bucket's activations), a step's activations and
# the caching allocator's slack. 512 MiB did not cover the context and workspaces alone. `serve.memory_model` in
# tests/gpu/check_serve.py measures what a worker holds against it.
DEFAULT_OVERHEAD_BYTES = 1024 * MIB
# A draft model's engine (speculative decoding) in the same process adds its own share of that: its graphs' warm-up
# stream's cuBLAS workspace (32 MiB on Hopper), its graph pool (its largest bucket's activations), a step's
# activations and the allocator's slack; the CUDA context is the process's, counted once. An estimate by those parts
# for drafts of up to a few billion parameters; not yet measured on a GPU.
DRAFT_ENGINE_OVERHEAD_BYTES = 256 * MIB


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model that size its memory (from its config: layers, KV heads, head size, context)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    weights_bytes: int  # as loaded on the device (dequantized size if the runtime dequantizes)
    kv_dtype_bytes: int = 2  # fp16/bf16 KV cache
    context_len: int | None = None  # the model's own maximum context (max_position_embeddings)
    sliding_window: int = 0  # every layer's attention window (0: some layer sees the whole context)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, for every layer and KV head: 2 × layers × kv_heads × head_dim × dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes


@dataclass(frozen=True)
class ReplicaDemand:
    """One replica's ask. `memory_bytes` None: unknown (no shape and no `placement.memory_gib`)."""

    model: str
    replica: int
    isolation: Isolation
    memory_bytes: int | None
    kv_cache_bytes: int | None = None
    sm_percent: int | None = None
    weight: float = 1.0
    device: Device = "auto"
    mig_instance: str | None = None  # the MIG instance it shares with the other demands naming it (mps/timeslice)
    draft_unsized: str | None = None  # its draft model, where that model's shape is unknown (so its memory is)

    @property
    def replica_id(self) -> str:
        return f"{self.model}/{self.replica}"


def planned_locally(model: ModelSpec) -> bool:
    """Whether this host's plan places `model`: enabled, with replicas, launched here (a `url` replica runs
    elsewhere already; `ray` replicas are planned per node, `planning/cluster.py`)."""
    return model.enabled and model.max_replicas > 0 and model.launcher not in ("url", "ray")


def replica_demands(registry: Registry, shapes: Mapping[str, ModelShape] | None = None,
                    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
                    planned: Callable[[ModelSpec], bool] = planned_locally) -> list[ReplicaDemand]:
    """One demand per replica of every model `planned` selects (default: those launched on this host). Raises
    `InfeasiblePlan` when a model's own numbers contradict each other (its `memory_gib` cannot hold its weights and
    KV budget)."""
    shapes = shapes or {}
    demands, problems = [], []
    for i, model in enumerate(registry.models):
        if not planned(model):
            continue
        draft = draft_model_of(model.engine)
        draft_shape = shapes.get(draft) if draft else None
        unsized = draft if draft is not None and draft_shape is None else None
        try:
            # a draft of unknown size leaves the replica's own unknown (a GPU plan then refuses it, naming the draft)
            memory, kv = replica_memory(model, None if unsized else shapes.get(model.name), overhead_bytes,
                                        draft_shape)
        except ValueError as exc:
            problems.append(f"models[{i}] {model.name}: {exc}")
            continue
        placement = model.placement
        demands += [ReplicaDemand(model=model.name, replica=r, isolation=placement.isolation, memory_bytes=memory,
                                  kv_cache_bytes=kv, sm_percent=placement.sm_percent, weight=placement.weight,
                                  device=model.device, mig_instance=placement.mig_instance, draft_unsized=unsized)
                    for r in range(model.max_replicas)]
    if problems:
        raise InfeasiblePlan(problems)
    return demands


def replica_memory(model: ModelSpec, shape: ModelShape | None, overhead_bytes: int,
                   draft: ModelShape | None = None) -> tuple[int | None, int | None]:
    """(device memory, KV-cache bytes) of one replica; either may be None (unknown). Raises ValueError.

    KV budget (`registry.engine.kv_cache_budget`): `engine.kv_cache_gib` when set; else the plan's share, what
    `placement.memory_gib` leaves after weights and overhead, else one `max_model_len` sequence (the least that serves
    a full-length request). Embedding models have none.

    With a draft model (`engine.speculative.draft_model`, of shape `draft`) the replica also holds the draft's weights,
    its engine's overhead (`DRAFT_ENGINE_OVERHEAD_BYTES`) and its KV cache, which holds as many tokens as the model's
    (runtimes/llm/engine.py sizes it so, in the model's KV dtype); what `placement.memory_gib` leaves is shared
    between the two caches by their bytes per token.
    """
    engine = model.engine if isinstance(model.engine, EngineSpec) else None  # an encoder keeps no KV cache
    is_llm = engine is not None
    explicit_kv = None if engine is None else engine.kv_cache_bytes
    one_seq = None if engine is None else _one_sequence_kv(engine, shape)
    weights = shape.weights_bytes if shape is not None else None
    beside = _DraftBytes(shape, draft, engine.block_size) if engine is not None and shape and draft else None
    total = _bytes(model.placement.memory_gib)
    if total is not None:
        if weights is None:
            return total, explicit_kv
        rest = total - weights - overhead_bytes - (beside.fixed if beside else 0)
        budget = kv_cache_budget(explicit_kv, beside.model_share(rest) if beside else rest) if is_llm else 0
        drafted = beside.fixed + beside.kv(max(budget, 0)) if beside else 0
        need = weights + max(budget, 0) + overhead_bytes + drafted
        if need > total:
            with_kv = f" + KV cache {gib(budget)}" if budget > 0 else (", before any KV cache" if is_llm else "")
            with_draft = f" + draft model {gib(drafted)}" if beside else ""
            raise ValueError(f"placement.memory_gib {gib(total)} cannot hold weights {gib(weights)}{with_draft} + "
                             f"overhead {gib(overhead_bytes)}{with_kv}: short by {gib(need - total)}")
        try:
            _check_kv(budget if is_llm else None, one_seq, engine)
        except ValueError as exc:
            if explicit_kv is not None:
                raise
            less_draft = f", the draft model's {gib(drafted)}" if beside else ""
            raise ValueError(f"placement.memory_gib {gib(total)} less weights {gib(weights)}{less_draft} and "
                             f"overhead {gib(overhead_bytes)}: {exc}") from None
        return total, budget if is_llm else None
    kv = kv_cache_budget(explicit_kv, one_seq)
    _check_kv(kv, one_seq, engine)
    if weights is None:
        return None, kv
    drafted = beside.fixed + beside.kv(kv or 0) if beside else 0
    return weights + (kv or 0) + overhead_bytes + drafted, kv


@dataclass(frozen=True)
class _DraftBytes:
    """What a draft model adds to a replica of `model`: its weights and its engine's overhead, and a KV cache of as
    many whole blocks as the model's holds, at the draft's bytes per token in the model's KV dtype."""

    model: ModelShape
    draft: ModelShape
    block_size: int

    @property
    def fixed(self) -> int:
        """The draft's weights and its engine's overhead."""
        return self.draft.weights_bytes + DRAFT_ENGINE_OVERHEAD_BYTES

    @property
    def per_token(self) -> int:
        return 2 * self.draft.num_layers * self.draft.num_kv_heads * self.draft.head_dim * self.model.kv_dtype_bytes

    def kv(self, model_kv: int) -> int:
        """The draft's KV bytes beside a model KV cache of `model_kv` bytes."""
        return model_kv // (self.block_size * self.model.kv_bytes_per_token) * self.block_size * self.per_token

    def model_share(self, both: int) -> int:
        """The model's part of `both` bytes shared by the two caches (by bytes per token; the draft's part, whole
        blocks of the model's, then fits in the rest)."""
        return max(both, 0) * self.model.kv_bytes_per_token // (self.model.kv_bytes_per_token + self.per_token)


def _one_sequence_kv(engine: EngineSpec, shape: ModelShape | None) -> int | None:
    """The KV one full-length sequence holds at once: all its blocks, or with a window on every layer those spanning
    the window and one step's new tokens (the engine hands back the blocks behind the window as a sequence
    advances: runtimes/llm/kv_cache_manager.py `blocks_at_most`)."""
    tokens = engine.max_model_len or (shape.context_len if shape is not None else None)
    if shape is None or tokens is None:
        return None
    block = engine.block_size
    blocks = sequence_blocks(tokens, block, shape.sliding_window, engine.max_num_batched_tokens)
    return blocks * block * shape.kv_bytes_per_token


def _check_kv(kv: int | None, one_seq: int | None, engine: EngineSpec | None) -> None:
    if engine is not None and kv is not None and one_seq is not None and kv < one_seq:
        raise ValueError(f"a KV cache of {gib(kv)} holds less than one {engine.max_model_len or 'full'}-token "
                         f"sequence ({gib(one_seq)}): short by {gib(one_seq - kv)}")


def _bytes(size_gib: float | None) -> int | None:
    return None if size_gib is None else int(size_gib * GIB)


SHIPPED_SHAPES = config_path("model_shapes.json")  # the known models' shapes


def load_shapes(path: str | Path) -> dict[str, ModelShape]:
    """A JSON file `{model name: {num_layers, num_kv_heads, head_dim, weights_bytes, ...}}`. Raises ValueError."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of model name -> shape")
    allowed = {f.name for f in fields(ModelShape)}
    shapes = {}
    for name, entry in data.items():
        unknown = set(entry) - allowed if isinstance(entry, dict) else {"(not an object)"}
        if unknown:
            raise ValueError(f"{path}: {name}: unknown field(s) {sorted(unknown)}; known: {sorted(allowed)}")
        try:
            shapes[name] = ModelShape(**entry)
        except TypeError as exc:
            raise ValueError(f"{path}: {name}: {exc}") from None
    return shapes
