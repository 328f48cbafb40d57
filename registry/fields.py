"""The registry's building blocks: units, the bounds of its numeric fields, the names of its enumerations, and the
frozen, strict base every section of it derives from."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

MIB = 1 << 20
GIB = 1 << 30


def gib(n: int) -> str:
    """Bytes as people read a memory size in messages: `1.50 GiB`."""
    return f"{n / GIB:.2f} GiB"


# Upper bounds of the numeric fields. Each is far above what one host runs and low enough that a typo (an extra
# zero or six) is refused instead of starting a million processes or sizing a cache beyond any device.
MAX_REPLICAS = 64  # per model; each replica is a process with its own weights and KV cache
MAX_BLOCK_SIZE = 256  # tokens per KV-cache block (and a power of two)
MAX_NUM_SEQS = 4096  # sequences a replica runs at once
MAX_NUM_BATCHED_TOKENS = 1 << 20  # tokens in one engine step
MAX_MODEL_LEN = 1 << 21  # tokens of context (2M; the longest-context open models have 1M)
MAX_REQUEST_TOKENS = 1 << 24  # tokens of one embedding request's inputs (OpenAI's 2,048 inputs of 8,192 tokens)
MAX_GIB = 4096.0  # kv_cache_gib, memory_gib: 4 TiB, more than any single host has
MAX_QUEUE_LEN = 1 << 20  # waiting requests per replica
MAX_WAIT_S = 86_400.0  # queue waits and request timeouts: a day
MAX_WEIGHT = 1000.0  # a time-slice share relative to co-located models
MAX_LOAD_BOUND = 100.0  # x the mean in-flight requests
MAX_PREFIX_CHARS = 1 << 20  # characters of a prompt hashed for prefix affinity
MAX_BODY_BYTES = 1 << 30  # a request body the gateway buffers
# Bounded integer fields are `strict`: `true` or "3" for `replicas` is a mistake, not 1 or 3.

ModelType = Literal["chat", "completion", "embedding"]
# local: a worker process on this host; url: a server started elsewhere; ray: a worker started by a Ray actor;
# command: any OpenAI-compatible server this host starts from the model's `command:` (registry/command.py)
Launcher = Literal["local", "url", "ray", "command"]
Device = Literal["auto", "cpu", "cuda"]
Isolation = Literal["mig", "mps", "timeslice", "exclusive"]
Scheduling = Literal["fcfs", "multilevel"]
Routing = Literal["round_robin", "least_outstanding", "power_of_two", "prefix_affinity", "session"]

# Names are what clients send as `model` and what the admin API puts in URLs: keep them URL- and file-safe.
ModelName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=128)]
# Aliases may also carry the upper case and '/' of Hugging Face ids (`HuggingFaceTB/SmolLM2-135M-Instruct`).
Alias = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$", max_length=256)]
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class Frozen(BaseModel):
    """Immutable once validated; unknown keys are refused by name."""

    model_config = ConfigDict(frozen=True, extra="forbid")
