"""A model's `ModelShape` estimated from its own files, for a model that names no shape: without a memory size it is
the size the planner reserves; with `placement.memory_gib` it lets the planner refuse a size that cannot hold the
weights, before a replica runs out of memory.

The planner takes shapes as inputs and never opens a model (demand.py). Serving does, here, and reads metadata
only: a GGUF file's header (gguf's reader maps the file; the parameter count comes from the tensors' shapes, no
tensor data is touched) or a Hugging Face directory's config.json and safetensors headers. The numbers are the
runtime's own: the config readers its loader uses, from `runtimes/llm/model_config.py`, which imports no torch (so
planning never loads the engine), and the same source resolution as its workers (registry/sources.py), so the
estimate describes the model a replica will load.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from partitioner.devices.inventory import Inventory
from partitioner.planning.demand import ModelShape
from registry.engine import EngineSpec, draft_model_of
from registry.errors import Problem
from registry.schema import ModelSpec, Registry
from registry.sources import resolve_model_path

if TYPE_CHECKING:
    from runtimes.llm.model_config import ModelConfig

# The LLM runtime holds weights in bf16 on a GPU (its dtype `auto`) and dequantizes GGUF blocks to it, so a
# parameter costs 2 bytes there whatever the file's quantization. Its KV cache is in the weights' dtype.
GPU_BYTES_PER_PARAMETER = 2
GPU_KV_DTYPE_BYTES = 2

_Fingerprint = tuple[tuple[str, int, int], ...]


def plan_shapes(registry: Registry, shapes: Mapping[str, ModelShape], inventory: Inventory,
                ) -> tuple[dict[str, ModelShape], dict[str, str]]:
    """The shapes to plan `registry` onto `inventory` with, and why a model has none (`with_estimates`). A CPU
    inventory needs no memory sizes, so no model is opened for it."""
    if inventory.is_cpu:
        return dict(shapes), {}
    return with_estimates(registry, shapes)


def needs_estimate(model: ModelSpec, shapes: Mapping[str, ModelShape]) -> bool:
    """Whether the planner wants `model`'s shape from its files when it goes to a GPU: an LLM of ours, launched here
    and not pinned to the CPU, without a given shape (which wins). Embedding models are left out: the encoder runtime
    keeps its weights in another dtype and reads other keys."""
    return _may_go_to_gpu(model) and isinstance(model.engine, EngineSpec) and model.name not in shapes


def _may_go_to_gpu(model: ModelSpec) -> bool:
    return model.enabled and model.max_replicas > 0 and model.launcher not in ("url", "command") \
        and model.device != "cpu"


def with_estimates(registry: Registry, shapes: Mapping[str, ModelShape],
                   ) -> tuple[dict[str, ModelShape], dict[str, str]]:
    """`shapes` plus an estimate for each model that `needs_estimate`, and, by model name, why one could not be
    made for a model without `placement.memory_gib` (its weights are not on this machine, or they are not of a model
    the runtime loads). Such a model stays without a shape: the planner then refuses it on a GPU, asking for
    `placement.memory_gib`. A model with one is planned by it either way: only the check of that size is lost."""
    found, unknown = dict(shapes), {}
    # a draft model (engine.speculative) runs inside the replicas of the models that name it: its size is theirs too
    drafts = {name for m in registry.models if _may_go_to_gpu(m) and (name := draft_model_of(m.engine))}
    for model in registry.models:
        if not (needs_estimate(model, shapes) or (model.name in drafts and model.name not in shapes)):
            continue
        try:
            found[model.name] = estimate_shape(model.source_ref())
        except Exception as exc:  # a damaged file fails in its reader's own ways (a cut GGUF: IndexError)
            if model.placement.memory_gib is None:
                unknown[model.name] = f"its shape could not be read from {model.source_ref()}: {exc!r}"
    return found, unknown


def family_problems(registry: Registry) -> list[Problem]:
    """Models our engines would load whose files are of a family they do not run (or not a model they can read):
    refused when the registry is validated, naming the model's `source` and what the runtime said (the families it
    runs), rather than when a replica starts. An LLM's config is read by the LLM engine's readers; an embedding
    model's directory by the encoder's (its config.json and sentence-transformers modules: architecture, positions,
    activation, pooling). Files that are not on this machine (another Ray node's, a package not installed here) are
    left to the worker, and a damaged file to its reader there."""
    problems = []
    for i, model in enumerate(registry.models):
        if not (model.launcher in ("local", "ray") and model.source is not None and model.source.kind != "url"):
            continue
        check = estimate_shape if isinstance(model.engine, EngineSpec) else check_embedding_source
        try:
            check(model.source_ref())
        except ValueError as exc:  # the config readers' refusal: an unsupported family, a feature it lacks
            problems.append(Problem(f"models[{i}].source", f"{model.source_ref()} cannot be served: {exc}"))
        except Exception:  # not here, or damaged: the worker reports it where the files are
            continue
    return problems


def check_embedding_source(source: str | Path) -> None:
    """Raise ValueError when the embedding model at `source` is not one the encoder runtime runs (what its loader
    would refuse: a file rather than a directory, another architecture, a pooling it does not do), and
    FileNotFoundError when it is not on this machine. Reads JSON files only: no weights, no torch."""
    from runtimes.embedding.model_config import check_encoder_dir

    path = resolve_model_path(source)
    if not path.is_dir():
        raise ValueError("an embedding model is a directory (config.json, model.safetensors, tokenizer.json), "
                         "not a file")
    check_encoder_dir(path)


def estimate_shape(source: str | Path) -> ModelShape:
    """The shape of the LLM at `source` (`package:file` or a path, as a worker takes it) as the runtime will hold
    it on a GPU. Raises FileNotFoundError when it is not on this machine, and whatever its readers raise when its
    metadata is not that of a model the runtime loads. Cached by the files' sizes and modification times."""
    path = resolve_model_path(source)
    return _estimate(str(path), _fingerprint(path))


def _fingerprint(path: Path) -> _Fingerprint:
    """What the estimate reads, by name, size and modification time: an edited or replaced file reads afresh."""
    files = [path / "config.json", *sorted(path.glob("*.safetensors"))] if path.is_dir() else [path]
    stats = [(str(f), f.stat()) for f in files if f.exists()]
    return tuple((name, s.st_size, s.st_mtime_ns) for name, s in stats)


@functools.lru_cache(maxsize=64)
def _estimate(path: str, fingerprint: _Fingerprint) -> ModelShape:
    location = Path(path)
    config, parameters = _hf_directory(location) if location.is_dir() else _gguf_file(location)
    return ModelShape(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                      weights_bytes=parameters * GPU_BYTES_PER_PARAMETER, kv_dtype_bytes=GPU_KV_DTYPE_BYTES,
                      context_len=config.max_position_embeddings, sliding_window=config.sliding_window)


def _gguf_file(path: Path) -> tuple[ModelConfig, int]:
    """The runtime's config of a GGUF file and its parameter count, from the header alone."""
    from runtimes.llm.model_config import read_gguf

    reader, config = read_gguf(path)
    return config, sum(math.prod(t.shape) for t in reader.tensors)


def _hf_directory(path: Path) -> tuple[ModelConfig, int]:
    """The runtime's config of a Hugging Face directory and the parameters it loads, from the safetensors headers.
    A tied `lm_head.weight` is not counted: the loader skips it, the embedding serves for both."""
    from safetensors import safe_open

    from runtimes.llm.model_config import ModelConfig

    config = ModelConfig.from_hf_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    parameters = 0
    for file in files:
        with safe_open(str(file), framework="numpy") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if config.tie_word_embeddings and key.removeprefix("model.") == "lm_head.weight":
                    continue
                parameters += math.prod(handle.get_slice(key).get_shape())
    return config, parameters
