"""What one replica is started with, in one frozen document: the contract between the gateway's pool and a worker.

The pool builds a `ReplicaLaunch` from the model's registry entry and the partitioner's placement of that replica
(`replica_launch`); the local launcher hands it to `multiserve worker --launch` as JSON, and the worker parses it with
this same model and derives its engine's runtime config from it, without validating anything a second time. Only
what CUDA itself reads (CUDA_VISIBLE_DEVICES, the MPS variables) travels in the worker's environment, with the launch
token. A change to a model that changes its launch (`launch_key`) restarts its replicas; any other change (replica
count, aliases, fallbacks, URLs, the gateway's side of its policy) does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from registry.command import CommandSpec
from registry.engine import (
    EmbeddingEngineSpec,
    EngineSpec,
    QueueOptions,
    WeightsChoice,
    draft_model_of,
    engine_for_type,
    kv_cache_budget,
)
from registry.fields import Alias, Device, Frozen, ModelName, ModelType
from registry.schema import ChatOptions, ModelSpec, Placement, RayResources, Registry


@dataclass(frozen=True)
class Footprint:
    """What one replica holds while it runs, by the planner's memory model (weights + KV cache + overhead), and on
    which memory budget: `cpu` or a GPU's index (a MIG slice counts on its GPU). `bytes` None: unknown, not
    counted."""

    device: str = "cpu"
    bytes: int | None = None


class ReplicaPlacement(Frozen):
    """Where a replica runs and with what share of its device, as the partitioner planned it (all unset: no plan,
    or nothing to share)."""

    env: dict[str, str] = {}  # CUDA_VISIBLE_DEVICES and the MPS variables: read by CUDA from the environment
    kv_cache_bytes: int | None = Field(default=None, gt=0)  # the plan's KV budget (a GPU), when the model sets none
    memory_fraction: float | None = Field(default=None, gt=0, le=1)  # of the CUDA device, for this process
    arbiter_socket: str | None = None  # the device is time-shared: each engine step takes this arbiter's lease
    arbiter_client: str | None = None  # the replica's name at the arbiter
    arbiter_weight: float = Field(default=1.0, gt=0)


class ReplicaLaunch(Frozen):
    """One replica's launch. `engine` is the model's `engine:` section as the registry validated it."""

    model: ModelName
    index: int = Field(ge=0)
    type: ModelType
    source: str  # a path or `package:file`, as `registry.sources.resolve_model_path` takes it
    draft_source: str = ""  # with `engine.speculative.method: draft`: the draft model's source, as `source`
    draft_weights: WeightsChoice = "auto"  # and how its weights are held (its own `engine.weights`)
    aliases: tuple[Alias, ...] = ()
    device: Device = "auto"
    engine: EngineSpec | EmbeddingEngineSpec = Field(default_factory=dict, validate_default=True)
    queue: QueueOptions = Field(default_factory=QueueOptions)
    chat: ChatOptions = Field(default_factory=ChatOptions)  # how its replies are read (the model's `chat:`)
    placement: ReplicaPlacement = Field(default_factory=ReplicaPlacement)
    url: str | None = None  # launcher `url`: the replica already runs there
    ray: RayResources | None = None  # launcher `ray`: what its actor asks of its node
    command: CommandSpec | None = None  # launcher `command`: the server it runs (registry/command.py)
    served_name: str | None = None  # launcher `command`: the name its server answers to

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_of_its_type(cls, value: Any, info: ValidationInfo) -> EngineSpec | EmbeddingEngineSpec:
        return engine_for_type(info.data.get("type", "chat"), value)  # JSON alone cannot tell the two kinds apart

    @model_validator(mode="after")
    def _draft_has_a_source(self) -> ReplicaLaunch:
        if (draft := draft_model_of(self.engine)) is not None and not self.draft_source:
            raise ValueError(f"draft_source: the launch of a model that speculates with draft model {draft!r} needs "
                             f"that model's source (replica_launch(..., registry))")
        return self

    @property
    def replica_id(self) -> str:
        return f"{self.model}/{self.index}"

    @property
    def kv_cache_bytes(self) -> int | None:
        """The KV budget the replica's engine is given (`registry.engine.kv_cache_budget`): the model's
        `kv_cache_gib`, else the plan's; None leaves it to the engine when it starts."""
        explicit = self.engine.kv_cache_bytes if isinstance(self.engine, EngineSpec) else None
        return kv_cache_budget(explicit, self.placement.kv_cache_bytes)



class StandbyAssignment(Frozen):
    """What a standby worker (`multiserve worker --standby`, the local launcher's warm pool) is told to serve: one
    JSON line on its standard input. The placement's environment comes with the launch; CUDA reads it at its first
    use, which a standby's imports do not make."""

    launch: ReplicaLaunch
    host: str
    port: int = Field(ge=0, le=65535)
    token: str | None = None  # what every request but its probes must carry (never in its environment)
    log_path: str | None = None  # the replica's log: the standby's output goes there from now on


def launch_key(spec: ModelSpec, registry: Registry | None = None) -> tuple[ReplicaLaunch, Placement]:
    """What decides whether a registry change restarts a model's replicas: their launch, less the replica index, the
    gateway-side aliases and the resolved placement, plus the model's `placement:` section (its isolation and
    weights apply at launch). A change that moves only the plan of other models restarts nothing; one that moves its
    draft model's weights (`registry` names it) restarts it."""
    launch = replica_launch(spec, 0, registry=registry).model_copy(update={"aliases": (), "url": None})
    return launch, spec.placement


def replica_launch(spec: ModelSpec, index: int, placement: ReplicaPlacement | None = None,
                   registry: Registry | None = None) -> ReplicaLaunch:
    """The launch of replica `index` of `spec`, placed as the partitioner planned (None: no plan); `registry` names
    its draft model, if it speculates with one."""
    queue = QueueOptions() if spec.type == "embedding" else QueueOptions.model_validate(
        spec.policy.model_dump(include=set(QueueOptions.model_fields)))
    draft = draft_launch(spec, registry)
    return ReplicaLaunch(
        model=spec.name, index=index, type=spec.type, source=spec.source_ref(), aliases=tuple(spec.aliases),
        device=spec.device, engine=spec.engine, queue=queue, chat=spec.chat, placement=placement or ReplicaPlacement(),
        url=spec.urls[index] if index < len(spec.urls) else None,
        ray=(spec.ray or RayResources()) if spec.launcher == "ray" else None,
        command=spec.command, served_name=spec.served_name if spec.launcher == "command" else None,
        draft_source=draft[0], draft_weights=draft[1])


def draft_launch(spec: ModelSpec, registry: Registry | None) -> tuple[str, WeightsChoice]:
    """The model's draft model as its launch carries it: its source and its own `engine.weights` (("", "auto") when
    it has none, or no registry names it)."""
    name = draft_model_of(spec.engine)
    draft = None if name is None or registry is None else next((m for m in registry.models if m.name == name), None)
    if draft is None:
        return "", "auto"
    return draft.source_ref(), draft.engine.weights if isinstance(draft.engine, EngineSpec) else "auto"
