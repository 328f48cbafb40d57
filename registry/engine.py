"""What a model's replicas run and within which limits, each setting defined here once (name, type, bound, default,
rule): the `engine:` section of the registry, the engine's side of a model's `policy:`, and the KV budget's precedence.

Two kinds of engine, chosen by the model's `type`: chat and completion models run the paged-KV LLM engine
(`EngineSpec`), embedding models the encoder engine (`EmbeddingEngineSpec`), which keeps no KV cache and so takes none
of the KV options. The LLM engine's options (`EngineOptions`) and its queue's (`QueueOptions`) are also the fields of
the runtime's config (runtimes/llm/config.py's `EngineConfig` derives from both), and the simulator takes their
defaults (partitioner/simulate/engine.py): validated here, once, by the same rules wherever they are set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, overload

from pydantic import Field, ValidationError, field_validator, model_validator

from policies.classify import LaneThresholds
from policies.multilevel import MultiLevelConfig
from registry.errors import FieldProblems, Problem, pydantic_problems
from registry.fields import (
    GIB,
    MAX_BLOCK_SIZE,
    MAX_GIB,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MAX_QUEUE_LEN,
    MAX_REQUEST_TOKENS,
    MAX_WAIT_S,
    Frozen,
    Scheduling,
)

MAX_SPECULATIVE_TOKENS = 16  # the most tokens one request proposes per step


class SpeculativeOptions(Frozen):
    """Speculative decoding (runtimes/llm/speculative.py): each decode step also verifies up to `k` proposed tokens
    per request; greedy and seeded requests get the same tokens as without, sampled ones the same distribution."""

    # ngram: prompt lookup, what followed the latest earlier occurrence of the output's last n tokens (n from
    # prompt_lookup_max down to prompt_lookup_min); draft: the greedy continuation of `draft_model`, another chat or
    # completion model of this registry with the same tokenizer, loaded in each replica beside this one
    method: Literal["ngram", "draft"] = "ngram"
    draft_model: str | None = Field(default=None, min_length=1)
    k: int = Field(default=8, ge=1, le=MAX_SPECULATIVE_TOKENS, strict=True)
    prompt_lookup_max: int = Field(default=4, ge=1, le=MAX_SPECULATIVE_TOKENS, strict=True)
    prompt_lookup_min: int = Field(default=2, ge=1, le=MAX_SPECULATIVE_TOKENS, strict=True)
    # each request's proposal length follows its recent acceptance and the measured cost of a verified row, and is
    # none where a row costs more than it is expected to save (a large batch); false always proposes up to k
    adaptive: bool = True

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeOptions:
        if self.method == "draft" and self.draft_model is None:
            raise FieldProblems([Problem("draft_model", "needed with method 'draft': the name of the model that "
                                                        "proposes")])
        if self.method != "draft" and self.draft_model is not None:
            raise FieldProblems([Problem("draft_model", f"only used with method 'draft' (method is "
                                                        f"{self.method!r})")])
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise FieldProblems([Problem("prompt_lookup_min", f"must be at most prompt_lookup_max "
                                                              f"({self.prompt_lookup_max}), "
                                                              f"got {self.prompt_lookup_min}")])
        return self


# how a model's weights are held (`EngineSpec.weights`)
WeightsChoice = Literal["auto", "fp32", "bf16", "fp16", "q8", "q4"]


class EngineOptions(Frozen):
    """The LLM engine's options: what the registry's `engine:` section and the runtime's `EngineConfig` share."""

    block_size: int = Field(default=16, ge=1, le=MAX_BLOCK_SIZE, strict=True)
    max_num_seqs: int = Field(default=64, ge=1, le=MAX_NUM_SEQS, strict=True)
    # None: the model's own context length
    max_model_len: int | None = Field(default=None, ge=1, le=MAX_MODEL_LEN, strict=True)
    max_num_batched_tokens: int = Field(default=512, ge=1, le=MAX_NUM_BATCHED_TOKENS, strict=True)
    enable_prefix_caching: bool = True
    # how the weights are held: auto keeps a GGUF's own quantization on the CPU (bf16 on CUDA); q8 and q4 quantize
    # to 8 or 4 bits (CPU or CUDA); fp32, bf16, fp16 dequantize (runtimes/llm/quant/weights.py)
    weights: WeightsChoice = "auto"
    # the KV cache's dtype: auto is the model's; fp16 on the CPU halves the cache's memory and the bytes its
    # attention reads; on CUDA the cache is the model's dtype or fp8 (e4m3: half of bf16's bytes, CUDA only)
    kv_dtype: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    # CUDA: decode steps replay graphs captured per batch-size bucket at start-up; false runs every step eagerly
    # (vLLM's enforce_eager). Nothing on the CPU
    cuda_graphs: bool = True
    # CUDA, with cuda_graphs: greedy decode steps launched before the previous step's tokens are read back, so the
    # host's scheduling and detokenizing overlap the device's step (never under a time-slice share)
    overlap_steps: bool = True
    # every kernel computes a row the same way whatever else is in the batch, so a greedy or seeded request gives the
    # same tokens alone or among others (runtimes/llm/batch_invariant.py). The CPU's block-weight kernels are so
    # already; on CUDA it changes the attention and dense-matmul kernels (slower); a replica whose weights or
    # attention backend have no such kernel fails to start, naming this field
    deterministic: bool = False
    # speculative decoding; None: off
    speculative: SpeculativeOptions | None = None

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):  # the range is the field's
            raise ValueError(f"must be a power of two, got {value}")
        return value


class EngineSpec(EngineOptions):
    """A chat or completion model's `engine:` section: the LLM engine's options and its KV cache's size."""

    # None: the partitioner's plan sizes it (a GPU), else the engine (`kv_cache_budget`)
    kv_cache_gib: float | None = Field(default=None, gt=0, le=MAX_GIB)

    @property
    def kv_cache_bytes(self) -> int | None:
        """`kv_cache_gib` in bytes."""
        return None if self.kv_cache_gib is None else int(self.kv_cache_gib * GIB)


class EmbeddingEngineSpec(Frozen):
    """The encoder engine's limits (runtimes/embedding/config.py's EmbeddingConfig); None: the engine's default."""

    max_num_seqs: int | None = Field(default=None, ge=1, le=MAX_NUM_SEQS, strict=True)  # inputs in one batch
    max_model_len: int | None = Field(default=None, ge=1, le=MAX_MODEL_LEN, strict=True)  # below the model's own
    batch_window_s: float | None = Field(default=None, ge=0, le=1.0)  # how long a lone input waits for company
    # padded tokens of one chunk of work; requests take turns between chunks
    max_batch_tokens: int | None = Field(default=None, ge=1, le=MAX_NUM_BATCHED_TOKENS, strict=True)
    # one request's inputs' tokens, summed; more is refused with a 400 naming `input`
    max_request_tokens: int | None = Field(default=None, ge=1, le=MAX_REQUEST_TOKENS, strict=True)


class QueueOptions(Frozen):
    """The engine's side of a model's policy: how its waiting queue is ordered and bounded (what a replica is
    launched with, `registry.launch.ReplicaLaunch.queue`)."""

    scheduling: Scheduling = "fcfs"
    # policies.multilevel.MultiLevelConfig fields (aging_s, normal_min_share, long_prompt_tokens,
    # max_long_running, share_window_tokens, urgent_step_max_share, share_window_steps, interrupt_steps,
    # busy_chunk_tokens, busy_window_s); unset ones keep that class's defaults
    multilevel: dict[str, float | int | bool | None] = {}
    # policies.classify.LaneThresholds fields: the prompt/max_tokens lengths that make a request interactive
    # or background when it does not say its priority
    lanes: dict[str, int] = {}
    max_queue_len: int | None = Field(default=None, ge=1, le=MAX_QUEUE_LEN, strict=True)  # per replica, then 429
    max_queue_wait_s: float | None = Field(default=None, gt=0, le=MAX_WAIT_S)  # not started after this long: 429

    @model_validator(mode="after")
    def _consistent(self) -> QueueOptions:
        if self.multilevel and self.scheduling != "multilevel":
            raise FieldProblems([Problem("multilevel", f"only used with scheduling 'multilevel' "
                                                       f"(scheduling is {self.scheduling!r})")])
        _check_options(MultiLevelConfig, self.multilevel, "multilevel")
        _check_options(LaneThresholds, self.lanes, "lanes")
        return self


def _check_options(options_type: Any, options: dict[str, Any], field: str) -> None:
    """Raise FieldProblems naming `field` unless `options_type(**options)` accepts the options."""
    try:
        options_type(**options)
    except TypeError as err:
        known = ", ".join(f.name for f in dataclasses.fields(options_type))
        raise FieldProblems([Problem(field, f"{err}; known options: {known}")]) from None
    except ValueError as err:
        raise FieldProblems([Problem(field, str(err))]) from None


CPU_KV_CACHE_BYTES = GIB  # an engine's KV budget off CUDA when neither its model nor a plan sizes it
KV_CACHE_MEMORY_FRACTION = 0.5  # on CUDA, likewise: of what the process may still take once its weights are loaded


@overload
def kv_cache_budget(explicit: int | None, planned: int, *, device: str | None = None,
                    free_bytes: Callable[[], int] | None = None,
                    memory_fraction: float = KV_CACHE_MEMORY_FRACTION) -> int: ...


@overload
def kv_cache_budget(explicit: int | None, planned: int | None = None, *, device: str,
                    free_bytes: Callable[[], int] | None = None,
                    memory_fraction: float = KV_CACHE_MEMORY_FRACTION) -> int: ...


@overload
def kv_cache_budget(explicit: int | None, planned: int | None = None, *, device: None = None,
                    free_bytes: Callable[[], int] | None = None,
                    memory_fraction: float = KV_CACHE_MEMORY_FRACTION) -> int | None: ...


def kv_cache_budget(explicit: int | None, planned: int | None = None, *, device: str | None = None,
                    free_bytes: Callable[[], int] | None = None,
                    memory_fraction: float = KV_CACHE_MEMORY_FRACTION) -> int | None:
    """A replica's KV-cache bytes, decided here for the planner, the launch and the engine. The first that is set:

    1. `explicit`: the model's own size (`EngineSpec.kv_cache_bytes`; at the engine, its config's `kv_cache_bytes`,
       which the launch decided by this same precedence);
    2. `planned`: the partitioner's share for the replica (partitioner/planning/demand.py: what `placement.memory_gib`
       leaves after weights and overhead, else one full-length sequence);
    3. at the engine's start, on `device` (a torch device type): on CUDA `memory_fraction` of `free_bytes()`, what
       the process may still take there (asked only then); on any other device `CPU_KV_CACHE_BYTES`.

    None: neither 1 nor 2, and no device yet: the engine decides when it starts."""
    for given in (explicit, planned):
        if given is not None:
            return given
    if device is None:
        return None
    if device != "cuda":
        return CPU_KV_CACHE_BYTES
    if free_bytes is None:
        raise ValueError("a CUDA engine's KV budget needs the device's free memory (free_bytes)")
    return int(max(0, free_bytes()) * memory_fraction)


def sequence_blocks(num_tokens: int, block_size: int, window: int = 0, max_chunk: int = 0) -> int:
    """The most KV blocks one sequence of `num_tokens` tokens holds at once, for the planner and the engine: all of
    them; with a window on every layer (`window`) and steps of at most `max_chunk` new tokens, at most those spanning
    its next token's window and one step (window - 1 + max_chunk tokens, which may start inside a block), as the
    engine hands back the blocks behind the window."""
    whole = -(-num_tokens // block_size)
    if not window or not max_chunk:
        return whole
    return min(whole, -(-(window - 1 + max_chunk) // block_size) + 1)


_KV_ONLY = frozenset(EngineSpec.model_fields) - frozenset(EmbeddingEngineSpec.model_fields)


def draft_model_of(engine: EngineSpec | EmbeddingEngineSpec) -> str | None:
    """The model an engine's speculative decoding drafts with (None: none, or an embedding engine)."""
    speculative = engine.speculative if isinstance(engine, EngineSpec) else None
    return None if speculative is None else speculative.draft_model


def engine_for_type(model_type: str, value: Any) -> EngineSpec | EmbeddingEngineSpec:
    """The `engine:` section of a model of `model_type`, validated as its kind; raises FieldProblems naming each
    field at fault (`block_size: not used by embedding models ...`)."""
    kind: type[EngineSpec] | type[EmbeddingEngineSpec]
    kind = EmbeddingEngineSpec if model_type == "embedding" else EngineSpec
    if isinstance(value, kind):  # validated already (a launch built from a registry entry)
        return value
    if isinstance(value, (EngineSpec, EmbeddingEngineSpec)):
        value = value.model_dump(exclude_unset=True)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise FieldProblems([Problem("", f"must be a mapping of engine options, got {type(value).__name__}")])
    if kind is EmbeddingEngineSpec:
        unused = sorted(set(value) & _KV_ONLY)
        if unused:
            why = "not used by embedding models (an encoder keeps no KV cache and runs no decode steps)"
            raise FieldProblems([Problem(name, why) for name in unused])
    try:
        return kind.model_validate(value)
    except ValidationError as exc:
        raise FieldProblems(pydantic_problems(exc, sorted(kind.model_fields))) from None
