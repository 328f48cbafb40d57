"""The registry schema: what an operator may write in the registry YAML. Frozen, and strict about unknown keys.

Single-field rules live on the fields; rules that relate fields of one model live on `ModelSpec`, rules across
models (unique names and aliases, fallbacks) on `Registry`. Cross-field validators raise `FieldProblems` so that
every error names the field at fault: `models[1].fallbacks[0]: unknown model 'nope'`.

The numeric bounds (`MAX_*`) are checked here and nowhere else: the admin API and the store pass values through
and show this module's message. Sources are checked by `registry.sources`; a `{path}` source must lie under
`gateway.model_roots`, which are relative to the registry file, so that rule needs the file's directory and runs
when the registry is validated with `validate_registry` (the file and admin edits always are); a `Registry` built
in code with plain `model_validate` has no file to be relative to and skips it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from foundation.http.limits import DEFAULT_LIMITS
from registry import sources
from registry.command import CommandSpec
from registry.engine import EmbeddingEngineSpec, EngineSpec, QueueOptions, draft_model_of, engine_for_type
from registry.errors import FieldProblems, Problem, pydantic_problems
from registry.fields import (
    GIB,
    MAX_BODY_BYTES,
    MAX_GIB,
    MAX_LOAD_BOUND,
    MAX_PREFIX_CHARS,
    MAX_REPLICAS,
    MAX_WAIT_S,
    MAX_WEIGHT,
    MIB,
    Alias,
    Device,
    EnvName,
    Frozen,
    Isolation,
    Launcher,
    ModelName,
    ModelType,
    Routing,
)


def _check_http_url(url: str) -> str:
    if not url.startswith(("http://", "https://")) or len(url) <= len("https://"):
        raise ValueError(f"must be an http:// or https:// URL, got {url!r}")
    return url


HttpUrlStr = Annotated[str, AfterValidator(_check_http_url)]
def _check_budget_device(device: str) -> str:
    if device != "cpu" and not (device.isascii() and device.isdigit() and len(device) <= 2):
        raise ValueError(f"a device is cpu or a GPU's index (\"0\", \"1\", ...), got {device!r}")
    return device


# a key of `gateway.memory_budget_gib`: the host's memory (`cpu`) or a GPU by index
BudgetDevice = Annotated[str, AfterValidator(_check_budget_device)]


class TrafficLogConfig(Frozen):
    """The per-request traffic profile (gateway/traffic.py): token counts, lane, model, timestamps, never content.
    Off by default (`path` unset): it is for operators who plan capacity, and a file nobody asked for is a surprise."""

    path: str | None = None  # e.g. .multiserve/traffic.jsonl (relative to the gateway's working directory)
    max_bytes: int = Field(default=64 * MIB, ge=4096)  # rotate past this (~300k requests per file)
    backups: int = Field(default=3, ge=0, le=100)  # rotated files kept: path.1 ... path.<backups>


class HttpLimits(Frozen):
    """How long a client may take to send a request, how large its head may be, how many connections are served
    at the gateway's socket (foundation/http/guard.py enforces them). Each default is the guard's own
    (`DEFAULT_LIMITS`), which every replica serves with; the bounds are the registry's."""

    header_timeout_s: float = Field(default=DEFAULT_LIMITS.header_timeout_s, gt=0, le=MAX_WAIT_S)
    body_timeout_s: float = Field(default=DEFAULT_LIMITS.body_timeout_s, gt=0, le=MAX_WAIT_S)
    max_header_bytes: int = Field(default=DEFAULT_LIMITS.max_header_bytes, ge=1024, le=16 * MIB, strict=True)
    keep_alive_s: float = Field(default=DEFAULT_LIMITS.keep_alive_s, gt=0, le=MAX_WAIT_S)
    # Past this, a request gets 503. Each connection holds a file descriptor (and, at the gateway, often one to a
    # replica): keep it under the process's descriptor limit (`ulimit -n`, often 1024 by default).
    max_connections: int | None = Field(default=DEFAULT_LIMITS.max_connections, ge=1, le=1 << 20, strict=True)


class RayConnection(Frozen):
    """The Ray cluster that `launcher: ray` models run on (model_pool/ray_launcher.py)."""

    # `auto` (the cluster this host belongs to: `ray start` ran here), `host:port` of its GCS, or `ray://host:port`
    # (Ray Client); None: `auto` when a model needs Ray. `multiserve serve --ray-address` overrides it.
    address: str | None = Field(default=None, min_length=1, max_length=512)
    namespace: str = Field(default="multiserve", pattern=r"^[A-Za-z0-9._-]+$", max_length=128)
    # where a Ray replica's worker listens, on its node (model_pool/ray_launcher.py `worker_address`): None is
    # 127.0.0.1, which serves only replicas on the gateway's host (one elsewhere fails its start, saying so); `node`
    # is each node's own address as Ray knows it (keep that network private: docs/multi-node.md); an address as given
    worker_host: str | None = Field(default=None, min_length=1, max_length=255)
    start_timeout_s: float = Field(default=120.0, gt=0, le=MAX_WAIT_S)  # for Ray to place and start an actor


class RayResources(Frozen):
    """What one replica's Ray actor asks of its node (Ray's own resource model): CPUs, GPUs (fractional to share one
    between models), memory, and custom resources (a node label, a MIG profile a node advertises)."""

    num_cpus: float = Field(default=1.0, ge=0, le=4096)
    num_gpus: float = Field(default=0.0, ge=0, le=64)
    memory_gib: float | None = Field(default=None, gt=0, le=MAX_GIB)
    resources: dict[Annotated[str, Field(min_length=1, max_length=128)], Annotated[float, Field(gt=0)]] = {}

    def ray_options(self) -> dict[str, Any]:
        """As `ActorClass.options()` takes them."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory_gib is not None:
            options["memory"] = int(self.memory_gib * GIB)
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class GatewayConfig(Frozen):
    """Where the gateway listens and where it finds its secrets (names of environment variables, never values)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port (tests)
    admin_token_env: EnvName = "MULTISERVE_ADMIN_TOKEN"
    api_keys_env: EnvName | None = None  # None: the OpenAI endpoints need no key
    # A 128k-token prompt is ~0.5 MB of text; 4 MiB leaves room for JSON escaping and batched embedding inputs.
    max_body_bytes: int = Field(default=4 * MIB, ge=1024, le=MAX_BODY_BYTES)
    traffic: TrafficLogConfig = Field(default_factory=TrafficLogConfig)
    http: HttpLimits = Field(default_factory=HttpLimits)  # slow and abusive clients: read deadlines, caps
    # Directories every `{path}` source must lie in, by real path (`..` and symlinks resolved: no escaping). A
    # relative root is relative to the registry file's directory; the default is that directory itself, so
    # models outside it need an entry here (e.g. [/srv/models]). `[]` allows no `{path}` sources at all.
    model_roots: list[Annotated[str, Field(min_length=1)]] = ["."]
    ray: RayConnection = Field(default_factory=RayConnection)
    # The most memory resident replicas may hold, per device: `cpu`, and GPUs by index ("0", "1", ...), in GiB.
    # A device not named: its inventory's memory (a GPU's total, the host's RAM). A replica's share is the
    # planner's memory model (weights + KV cache + overhead); starting one that does not fit first evicts idle
    # replicas started on demand, least recently used first (docs/on-demand.md).
    memory_budget_gib: dict[BudgetDevice, Annotated[float, Field(gt=0, le=MAX_GIB)]] = {}
    # a cold start that does not fit waits this long for replicas in use to go idle, then is refused (503)
    eviction_wait_s: float = Field(default=30.0, ge=0, le=MAX_WAIT_S)
    # Standby worker processes kept started with the runtimes imported, each taken by the next local launch (most
    # of a small model's cold start is the interpreter and torch's import); ~0.3 GiB of host memory each, outside
    # the budget. Taken at the next launch after an edit.
    warm_workers: int = Field(default=0, ge=0, le=8, strict=True)

    @field_validator("memory_budget_gib", mode="before")
    @classmethod
    def _gpu_keys_as_text(cls, value: Any) -> Any:
        """YAML reads `{0: 70}` with an integer key: a GPU's index either way."""
        if isinstance(value, dict):
            return {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: v for k, v in value.items()}
        return value


class ModelSource(Frozen):
    """Where the weights come from: exactly one of `{package, file}`, `{path}` or `{url}` (launcher `url` only).
    What `package`/`file` and `path` may name is `registry.sources`'s rules (`path` is checked by `Registry`)."""

    package: str | None = Field(default=None, min_length=1)
    file: str | None = Field(default=None, min_length=1)
    path: str | None = Field(default=None, min_length=1)
    url: HttpUrlStr | None = None

    @property
    def kind(self) -> Literal["package", "path", "url"]:
        return "package" if self.package is not None else "path" if self.path is not None else "url"

    @model_validator(mode="after")
    def _one_kind(self) -> ModelSource:
        given = [k for k in ("package", "path", "url") if getattr(self, k) is not None]
        if len(given) != 1:
            raise FieldProblems([Problem("", f"give exactly one of package (with file), path or url; got {given}")])
        if (self.package is None) != (self.file is None):
            raise FieldProblems([Problem("file", "package and file go together")])
        if self.package is not None and self.file is not None:
            self._check_package_file(self.package, self.file)
        return self

    @staticmethod
    def _check_package_file(package: str, file: str) -> None:
        try:
            sources.check_package_name(package)
        except sources.SourceError as err:
            raise FieldProblems([Problem("package", str(err))]) from None
        try:  # a package not installed here gets the lexical checks only; the loader says it is missing
            sources.package_file(package, file)
        except sources.SourceError as err:
            raise FieldProblems([Problem("file", str(err))]) from None


class Placement(Frozen):
    """How this model's replicas share a device; the partitioner turns it into a plan."""

    isolation: Isolation = "timeslice"
    memory_gib: float | None = Field(default=None, gt=0, le=MAX_GIB)
    sm_percent: int | None = Field(default=None, ge=1, le=100, strict=True)
    weight: float = Field(default=1.0, gt=0, le=MAX_WEIGHT)  # share of time-slices relative to co-located models
    # mps/timeslice only: share one MIG instance with every model that names the same one (MPS or time-slicing
    # inside it), next to mig models on the same GPU; the partitioner sizes it from their summed memory
    mig_instance: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=64)

    @model_validator(mode="after")
    def _consistent(self) -> Placement:
        if self.mig_instance is not None and self.isolation not in ("mps", "timeslice"):
            raise FieldProblems([Problem("mig_instance", f"names a MIG instance to share by mps or timeslice, but "
                                                         f"isolation is {self.isolation!r} (a mig replica gets an "
                                                         f"instance of its own, an exclusive one a whole GPU)")])
        return self


class PolicySpec(QueueOptions):
    """Queueing and admission (engine side, `QueueOptions`), replica choice and deadlines (gateway side) for one
    model."""

    # the whole request at the gateway (queueing, retries, a stream to its end): 504. Finite by default, as OpenAI's
    # own client waits 600 s; null: no deadline (a stalled replica then holds its client until the read timeout)
    request_timeout_s: float | None = Field(default=600.0, gt=0, le=MAX_WAIT_S)
    routing: Routing = "least_outstanding"
    session_header: str = Field(default="x-session-id", pattern=r"^[A-Za-z0-9-]+$")  # routing `session`
    # routing `prefix_affinity`: the prompt's head that is hashed
    prefix_chars: int = Field(default=512, ge=16, le=MAX_PREFIX_CHARS, strict=True)
    # routing `prefix_affinity`/`session`: a replica takes a hashed request only while it has at most
    # load_bound x the group's mean in-flight requests (consistent hashing with bounded loads)
    load_bound: float = Field(default=1.25, ge=1.0, le=MAX_LOAD_BOUND)


# the reply parsers of runtimes/server/tool_parsers.py and reasoning_parsers.py (a test keeps the lists the same)
ToolParserName = Literal["hermes", "llama3_json", "mistral"]
ReasoningParserName = Literal["think", "none"]


class ChatOptions(Frozen):
    """How a chat model's replies are read (our engine's replicas): `tool_parser` finds tool calls in a reply to
    `tool_choice: "auto"`; `reasoning_parser` splits the model's thinking out as `reasoning_content` ("none": never).
    Unset: the parser the chat template's own syntax implies (tool calls: else `hermes`, which reads what the default
    tool prompt asks for)."""

    tool_parser: ToolParserName | None = None
    reasoning_parser: ReasoningParserName | None = None


class ReplicaRange(Frozen):
    """`replicas: {min, max}`: a model started on demand. `min` replicas are kept resident; up to `max` run while it
    is called (the first request to a model with none starts one: a cold start); a replica idle for
    `scaling.idle_unload_s` is stopped, down to `min`."""

    min: int = Field(default=0, ge=0, le=MAX_REPLICAS, strict=True)
    max: int = Field(default=1, ge=1, le=MAX_REPLICAS, strict=True)

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaRange:
        if self.min > self.max:
            raise FieldProblems([Problem("min", f"must be at most max ({self.max}), got {self.min}")])
        return self


class Scaling(Frozen):
    """How a model with `replicas: {min, max}` comes and goes (model_pool/pool.py, docs/on-demand.md)."""

    # no request this long: a replica is drained and stopped, down to `min` (null: never for idleness; an idle
    # replica above `min` may still be evicted to make room under `gateway.memory_budget_gib`)
    idle_unload_s: float | None = Field(default=300.0, gt=0, le=MAX_WAIT_S)
    # a cold request waits this long for its replica to be ready, then gets 503 with Retry-After (the start goes on)
    cold_start_timeout_s: float = Field(default=120.0, gt=0, le=MAX_WAIT_S)
    # kept resident: at least one replica runs, never unloaded when idle nor evicted (the admin API's /pin)
    pinned: bool = False


_REPLICA_COUNT: TypeAdapter[int] = TypeAdapter(Annotated[int, Field(ge=0, le=MAX_REPLICAS, strict=True)])


class ModelSpec(Frozen):
    """One model of the registry and how to run it."""

    name: ModelName
    aliases: list[Alias] = []
    type: ModelType
    source: ModelSource | None = None  # required unless launcher is `url`
    # a count (0: defined, not running), or {min, max}: started on demand, unloaded when idle (`scaling`)
    replicas: Annotated[int, Field(ge=0, le=MAX_REPLICAS, strict=True)] | ReplicaRange = 1
    scaling: Scaling = Field(default_factory=Scaling)
    launcher: Launcher = "local"
    # launcher `url`: one running OpenAI-compatible server per replica
    urls: list[HttpUrlStr] = Field(default=[], max_length=MAX_REPLICAS)
    ray: RayResources | None = None  # launcher `ray`: what each replica's actor asks of its node (default: 1 CPU)
    command: CommandSpec | None = None  # launcher `command`: the server each replica runs (registry/command.py)
    device: Device = "auto"
    enabled: bool = True
    placement: Placement = Field(default_factory=Placement)
    # its kind follows `type` (registry/engine.py): the LLM engine's options, or the encoder's for embedding models
    engine: EngineSpec | EmbeddingEngineSpec = Field(default_factory=dict, validate_default=True)
    policy: PolicySpec = Field(default_factory=PolicySpec)
    chat: ChatOptions = Field(default_factory=ChatOptions)  # how replies are read: tool calls, reasoning
    fallbacks: list[ModelName] = []  # names (not aliases) of models of the same type, tried in order
    # tried when a replica answers `context_length_exceeded`: models with a longer context window
    context_window_fallbacks: list[ModelName] = []
    # tenant class (from the API key) -> the model that serves this one's traffic for that class, e.g.
    # {internal: smollm2-int8}: internal callers asking for this model get the int8 variant
    variants: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+$")], ModelName] = {}

    @field_validator("replicas", mode="before")
    @classmethod
    def _count_or_range(cls, value: Any) -> int | ReplicaRange:
        """A count or `{min, max}`, each checked by its own rules (one error, not one per form it could be)."""
        try:
            if isinstance(value, (dict, ReplicaRange)):
                return ReplicaRange.model_validate(value)
            return _REPLICA_COUNT.validate_python(value)
        except ValidationError as exc:
            raise FieldProblems([Problem("" if p.field == "(top level)" else p.field, p.message)
                                 for p in pydantic_problems(exc)]) from None

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_of_its_type(cls, value: Any, info: ValidationInfo) -> EngineSpec | EmbeddingEngineSpec:
        model_type = info.data.get("type")
        if model_type is None:  # `type` itself is missing or wrong: that is the error to show
            return EngineSpec()
        return engine_for_type(model_type, value)

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        problems = [*self._launcher_problems(), *self._embedding_problems(), *self._chat_problems(),
                    *self._scaling_problems(), *_duplicates("aliases", self.aliases)]
        problems += _duplicates("fallbacks", self.fallbacks)
        problems += _duplicates("context_window_fallbacks", self.context_window_fallbacks)
        if self.placement.mig_instance is not None and self.device == "cpu":
            problems.append(Problem("placement.mig_instance", "a MIG instance is part of a GPU, but device is 'cpu'"))
        problems += [Problem(f"aliases[{i}]", "an alias cannot repeat the model's own name")
                     for i, alias in enumerate(self.aliases) if alias == self.name]
        problems += [Problem(where, "a model cannot fall back to itself")
                     for where, name in self.model_references() if name == self.name]
        if problems:
            raise FieldProblems(problems)
        return self

    @property
    def on_demand(self) -> bool:
        """Started on demand and unloaded when idle: `replicas: {min, max}`."""
        return isinstance(self.replicas, ReplicaRange)

    @property
    def max_replicas(self) -> int:
        """The most replicas it runs: its count, or `max` (what the partitioner plans a place for)."""
        return self.replicas.max if isinstance(self.replicas, ReplicaRange) else self.replicas

    @property
    def resident_replicas(self) -> int:
        """The replicas kept running whether called or not: its count, or `min` (at least one when pinned)."""
        if isinstance(self.replicas, ReplicaRange):
            return max(self.replicas.min, 1 if self.scaling.pinned else 0)
        return self.replicas

    def _scaling_problems(self) -> list[Problem]:
        """`scaling:` is about replicas that come and go: `replicas: {min, max}` with a launcher that starts them."""
        problems = []
        if "scaling" in self.model_fields_set and not self.on_demand:
            problems.append(Problem("scaling", f"only for a model started on demand (replicas: {{min, max}}); "
                                               f"replicas is {self.replicas!r}"))
        if self.on_demand and self.launcher == "url":
            problems.append(Problem("replicas", "{min, max} starts replicas on demand; launcher 'url' adopts servers "
                                                "that run already: give their count"))
        return problems

    def _chat_problems(self) -> list[Problem]:
        """`chat:` is read by our engine's replicas, for models that chat."""
        if "chat" not in self.model_fields_set:
            return []
        if self.type != "chat":
            return [Problem("chat", f"how chat replies are read: only for type 'chat' (type is {self.type!r})")]
        if self.launcher in ("url", "command"):
            return [Problem("chat", f"read by multiserve's own engine; a {self.launcher!r} replica's server reads "
                                    "its replies itself (e.g. vLLM's --tool-call-parser in command.args)")]
        return []

    def _embedding_problems(self) -> list[Problem]:
        """What the embedding runtime does not do (its requests take turns in one queue, with no queue limits)."""
        if self.type != "embedding":
            return []
        unsupported = [("scheduling", self.policy.scheduling != "fcfs"),
                       ("max_queue_len", self.policy.max_queue_len is not None),
                       ("lanes", bool(self.policy.lanes)),
                       ("max_queue_wait_s", self.policy.max_queue_wait_s is not None)]
        return [Problem(f"policy.{name}", "not supported for embedding models (their requests take turns in "
                                          "one queue)") for name, given in unsupported if given]

    def _launcher_problems(self) -> list[Problem]:
        problems = self._ray_problems() + self._command_problems()
        if self.launcher != "url":
            if self.urls:
                problems.append(Problem("urls", f"only used with launcher 'url' (launcher is {self.launcher!r})"))
            if self.source is None:
                problems.append(Problem("source", f"required with launcher {self.launcher!r}"))
            elif self.source.kind == "url":
                problems.append(Problem("source.url", f"only with launcher 'url' (launcher is {self.launcher!r})"))
            return problems
        if not self.urls:
            return [*problems, Problem("urls", "launcher 'url' needs the URL of each replica's server")]
        if self.max_replicas not in (0, len(self.urls)):
            return [*problems, Problem("urls", f"launcher 'url' needs one URL per replica: replicas={self.replicas}, "
                                               f"got {len(self.urls)} url(s)")]
        return problems

    def _command_problems(self) -> list[Problem]:
        """A command replica runs a server that is not ours: none of our engine's options, and no time-slicing
        (its arbiter is taken at each step of our engine); on a GPU its memory must be given, not estimated."""
        if self.launcher != "command":
            return [Problem("command", f"only used with launcher 'command' (launcher is {self.launcher!r})")] \
                if self.command is not None else []
        if self.command is None:
            return [Problem("command", "launcher 'command' needs a command: {preset: vllm | sglang | llamacpp} or "
                                       "{argv: [...]}")]
        problems = []
        if "engine" in self.model_fields_set:
            problems.append(Problem("engine", "options of multiserve's own engine; a command replica takes its "
                                              "server's options in command.args"))
        if "placement" in self.model_fields_set and self.placement.isolation == "timeslice":
            problems.append(Problem("placement.isolation", "timeslice needs multiserve's own engine (each engine "
                                                           "step takes the device's lease); a command replica "
                                                           "shares a GPU by mig, mps or exclusive"))
        if self.device == "cuda" and self.placement.memory_gib is None:
            problems.append(Problem("placement.memory_gib", "required for a command replica on a GPU: what one "
                                                            "replica holds on its device (it is not estimated)"))
        return problems

    @property
    def served_name(self) -> str:
        """The name this model's replicas answer to: a command's `served_name`, else the model's own."""
        return self.command.served_name if self.command is not None and self.command.served_name else self.name

    def _ray_problems(self) -> list[Problem]:
        if self.launcher != "ray":
            return [Problem("ray", f"only used with launcher 'ray' (launcher is {self.launcher!r})")] \
                if self.ray is not None else []
        problems = []
        if importlib.util.find_spec("ray") is None:
            problems.append(Problem("launcher", "'ray' needs Ray installed where the gateway runs: "
                                                "pip install 'multiserve[ray]'"))
        return problems

    def model_references(self) -> list[tuple[str, str]]:
        """(field, model name) for every other model this one names: fallbacks, context fallbacks, variants."""
        refs = [(f"fallbacks[{i}]", name) for i, name in enumerate(self.fallbacks)]
        refs += [(f"context_window_fallbacks[{i}]", name) for i, name in enumerate(self.context_window_fallbacks)]
        return refs + [(f"variants.{tenant}", name) for tenant, name in self.variants.items()]

    def source_ref(self) -> str:
        """The source as `multiserve worker --source` takes it: `package:file` or a path ("" for url sources)."""
        source = self.source
        if source is None or source.kind == "url":
            return ""
        return f"{source.package}:{source.file}" if source.kind == "package" else str(source.path)


class Registry(Frozen):
    """The whole registry file. `models` is required so that an emptied file is an error, not "stop everything"."""

    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    models: list[ModelSpec]

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> Registry:
        problems = self._name_problems() + self._fallback_problems() + self._draft_problems()
        registry_dir = (info.context or {}).get(_REGISTRY_DIR)
        if registry_dir is not None:
            problems += self._path_problems(Path(registry_dir))
        if problems:
            raise FieldProblems(problems)
        return self

    def _path_problems(self, registry_dir: Path) -> list[Problem]:
        roots = sources.resolve_roots(self.gateway.model_roots, registry_dir)
        problems = []
        for i, model in enumerate(self.models):
            if model.source is not None and model.source.path is not None:
                try:
                    sources.check_model_path(model.source.path, roots)
                except sources.SourceError as err:
                    problems.append(Problem(f"models[{i}].source.path", str(err)))
        return problems

    def _name_problems(self) -> list[Problem]:
        owner: dict[str, str] = {}  # name or alias -> where it was first defined
        problems = []
        for i, model in enumerate(self.models):  # names first, so a clash is always blamed on the alias
            if model.name in owner:
                problems.append(Problem(f"models[{i}].name", f"duplicate model name {model.name!r} "
                                                             f"(also {owner[model.name]})"))
            owner.setdefault(model.name, f"models[{i}].name")
        for i, model in enumerate(self.models):
            for j, alias in enumerate(model.aliases):
                where = f"models[{i}].aliases[{j}]"
                if alias in owner:
                    problems.append(Problem(where, f"{alias!r} is already used by {owner[alias]}"))
                owner.setdefault(alias, where)
        return problems

    def _fallback_problems(self) -> list[Problem]:
        by_name = {m.name: m for m in self.models}
        aliases = {a: m.name for m in self.models for a in m.aliases}
        problems = []
        for i, model in enumerate(self.models):
            for field, name in model.model_references():
                target, where = by_name.get(name), f"models[{i}].{field}"
                if target is None:
                    hint = f" ({name!r} is an alias; fallbacks name models: use {aliases[name]!r})" \
                        if name in aliases else ""
                    problems.append(Problem(where, f"unknown model {name!r}{hint}"))
                elif target.type != model.type:
                    noun = "variant" if field.startswith("variants") else "fallback"
                    problems.append(Problem(where, f"{name!r} has type {target.type!r}; a {noun} must have "
                                                   f"the same type as its model ({model.type!r})"))
        if not problems:
            problems = self._cycle_problems()
        return problems

    def _draft_problems(self) -> list[Problem]:
        """A draft model (`engine.speculative.draft_model`) is a chat or completion model of this registry whose
        weights a replica can load (a package or path source)."""
        by_name = {m.name: m for m in self.models}
        aliases = {a: m.name for m in self.models for a in m.aliases}
        problems = []
        for i, model in enumerate(self.models):
            name = draft_model_of(model.engine)
            if name is None:
                continue
            where, draft = f"models[{i}].engine.speculative.draft_model", by_name.get(name)
            if draft is None:
                hint = f" ({name!r} is an alias; a draft is named by its model's name: use {aliases[name]!r})" \
                    if name in aliases else ""
                problems.append(Problem(where, f"unknown model {name!r}{hint}"))
            elif draft.type == "embedding":
                problems.append(Problem(where, f"{name!r} is an embedding model; a draft is a chat or completion "
                                               f"model with the same tokenizer"))
            elif draft.source is None or draft.source.kind == "url":
                problems.append(Problem(where, f"{name!r} has no weights a replica can load (a package or path "
                                               f"source)"))
        return problems

    def _cycle_problems(self) -> list[Problem]:
        graph = {m.name: m.fallbacks for m in self.models}
        index = {m.name: i for i, m in enumerate(self.models)}
        state: dict[str, int] = {}  # 1: on the current path, 2: done
        problems: list[Problem] = []

        def visit(name: str, path: list[str]) -> None:
            state[name] = 1
            for nxt in graph[name]:
                if state.get(nxt) == 1:
                    cycle = [*path[path.index(nxt):], nxt]
                    problems.append(Problem(f"models[{index[name]}].fallbacks",
                                            "fallback cycle " + " -> ".join(cycle)))
                elif nxt not in state:
                    visit(nxt, [*path, nxt])
            state[name] = 2

        for name in graph:
            if name not in state:
                visit(name, [name])
        return problems

    def resolve(self, name_or_alias: str) -> ModelSpec | None:
        """The model a client's `model` field names, by name or alias (disabled models included), or None."""
        for model in self.models:
            if model.name == name_or_alias or name_or_alias in model.aliases:
                return model
        return None

    def names_and_aliases(self) -> dict[str, str]:
        """Every name and alias a client may send, mapped to the model's name."""
        return {key: m.name for m in self.models for key in (m.name, *m.aliases)}


_REGISTRY_DIR = "registry_dir"  # validation context: the directory relative model roots are resolved against


def validate_registry(data: Any, registry_path: str | Path) -> Registry:
    """Validate registry data read from (or to be written to) `registry_path`: every rule, model roots included.
    Raises pydantic's `ValidationError` (see `validation_problems`)."""
    return Registry.model_validate(data, context={_REGISTRY_DIR: Path(registry_path).parent})


def _duplicates(field: str, values: list[str]) -> list[Problem]:
    return [Problem(f"{field}[{i}]", f"{v!r} is listed twice") for i, v in enumerate(values) if v in values[:i]]


_SCHEMA_CLASSES: tuple[type[BaseModel], ...] = (
    Registry, GatewayConfig, ModelSpec, ModelSource, Placement, EngineSpec, EmbeddingEngineSpec, PolicySpec,
    ReplicaRange, Scaling)
_FIELD_NAMES = sorted({name for cls in _SCHEMA_CLASSES for name in cls.model_fields})


def validation_problems(exc: ValidationError) -> list[Problem]:
    """Every error of a schema validation as a `Problem` with the full field path; an unknown field gets the
    nearest field name of the registry as a suggestion."""
    return pydantic_problems(exc, _FIELD_NAMES)
