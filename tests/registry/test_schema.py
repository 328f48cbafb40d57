"""The registry schema: what validates, and that every rejection names the field at fault."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from foundation.config_files import config_path
from registry.errors import RegistryError
from registry.fields import GIB
from registry.launch import replica_launch
from registry.schema import ModelSpec, Registry
from registry.store import diff_registries, load_registry, parse_registry

DEFAULT_CONFIG = config_path("default.yaml")

CHAT = "{name: %s, type: chat, source: {path: m.gguf}%s}"  # relative: inside the default model root


def registry_text(*models: str, extra: str = "") -> str:
    return "models:\n" + "".join(f"  - {m}\n" for m in models) + extra


def chat(name: str, more: str = "") -> str:
    return CHAT % (name, more)


def test_default_config_loads_and_resolves():
    registry = load_registry(DEFAULT_CONFIG)
    spec = registry.resolve("smollm2")
    assert spec is not None and spec.name == "smollm2-135m-instruct"
    assert spec.source is not None and spec.source.kind == "package"
    assert registry.resolve("smollm2-135m-instruct") is spec
    assert registry.resolve("nope") is None
    embedder = registry.resolve("minilm")
    assert embedder is not None and embedder.type == "embedding" and embedder.name == "all-minilm-l6-v2"
    assert registry.names_and_aliases() == {"smollm2-135m-instruct": spec.name, "smollm2": spec.name,
                                            "all-minilm-l6-v2": embedder.name, "minilm": embedder.name}
    assert registry.gateway.port == 8000 and registry.gateway.admin_token_env == "MULTISERVE_ADMIN_TOKEN"


def test_a_launch_builds_an_engine_config():
    from runtimes.server.worker import embedding_config, engine_config  # torch: imported here only

    chat_model, embedder = load_registry(DEFAULT_CONFIG).models
    config = engine_config(replica_launch(chat_model, 0))
    assert config.kv_cache_bytes == GIB and config.block_size == 16 and config.max_model_len == 4096
    assert config.device == "cpu"
    half = chat_model.model_copy(update={"engine": chat_model.engine.model_copy(update={"kv_cache_gib": 0.5})})
    assert replica_launch(half, 0).kv_cache_bytes == GIB // 2
    assert embedding_config(replica_launch(embedder, 0)).device == "cpu"


def test_speculative_options_travel_to_the_worker_s_engine_config():
    from registry.launch import ReplicaLaunch
    from runtimes.server.worker import engine_config  # torch: imported here only

    spec = parse_registry(registry_text(chat("a", ", engine: {speculative: {k: 5, prompt_lookup_min: 1}}")),
                          "x.yaml").models[0]
    launch = ReplicaLaunch.model_validate_json(replica_launch(spec, 0).model_dump_json())  # as the worker reads it
    options = engine_config(launch).speculative
    assert options is not None and (options.method, options.k, options.prompt_lookup_min) == ("ngram", 5, 1)
    assert engine_config(replica_launch(parse_registry(registry_text(chat("b")), "x.yaml").models[0], 0)
                         ).speculative is None
    # a draft model: its source goes in the launch, and moving its weights relaunches the model it drafts for
    text = registry_text(chat("t", ", engine: {speculative: {method: draft, draft_model: d}}"), chat("d"))
    registry = parse_registry(text, "x.yaml")
    launch = replica_launch(registry.models[0], 0, registry=registry)
    assert launch.draft_source == "m.gguf" and engine_config(launch).speculative.draft_model == "d"
    moved = parse_registry(text.replace("{name: d, type: chat, source: {path: m.gguf}", "{name: d, type: chat, "
                                        "source: {path: other.gguf}"), "x.yaml")
    diff = diff_registries(registry, moved)
    assert diff.changed == ("t", "d") and diff.relaunched == ("t", "d")
    assert diff_registries(registry, registry).changed == ()
    # the draft is held as its own entry says, and holding it otherwise relaunches the model it drafts for too
    assert launch.draft_weights == "auto"
    requantized = parse_registry(registry_text(chat("t", ", engine: {speculative: {method: draft, draft_model: d}}"),
                                               chat("d", ", engine: {weights: q8}")), "x.yaml")
    assert replica_launch(requantized.models[0], 0, registry=requantized).draft_weights == "q8"
    diff = diff_registries(registry, requantized)
    assert diff.changed == ("t", "d") and diff.relaunched == ("t", "d")
    with pytest.raises(ValidationError, match="draft_source: the launch of a model that speculates with draft"):
        replica_launch(registry.models[0], 0)  # no registry to find its draft in: refused, not started without


def test_the_variants_example_serves_one_file_at_two_precisions():
    registry = load_registry(DEFAULT_CONFIG.with_name("variants.yaml"))
    full, quantized = registry.models
    assert full.source == quantized.source and full.variants == {"internal": quantized.name}
    assert (full.engine.weights, quantized.engine.weights) == ("fp32", "auto")


def test_defaults_and_minimal_model():
    registry = parse_registry(registry_text(chat("m")), "x.yaml")
    spec = registry.models[0]
    assert (spec.replicas, spec.launcher, spec.device, spec.enabled) == (1, "local", "auto", True)
    assert (spec.placement.isolation, spec.placement.weight) == ("timeslice", 1.0)
    assert (spec.engine.block_size, spec.engine.max_num_seqs, spec.engine.enable_prefix_caching) == (16, 64, True)
    assert (spec.policy.scheduling, spec.policy.routing) == ("fcfs", "least_outstanding")
    assert replica_launch(spec, 0).kv_cache_bytes is None
    assert parse_registry("models: []\n", "x.yaml").models == []


def test_specs_are_frozen():
    spec = ModelSpec.model_validate({"name": "m", "type": "chat", "source": {"path": "/m"}})
    with pytest.raises(ValidationError):
        spec.replicas = 3  # type: ignore[misc]


def test_url_launcher_with_one_url_per_replica_or_none_running():
    urls = "launcher: url, urls: [http://10.0.0.1:8001, http://10.0.0.2:8001]"
    for replicas in (2, 0):
        text = registry_text(f"{{name: remote, type: chat, replicas: {replicas}, {urls}}}")
        assert parse_registry(text, "x.yaml").models[0].source is None


INVALID = {
    "duplicate name": (registry_text(chat("a"), chat("a")),
                       "models[1].name: duplicate model name 'a' (also models[0].name)"),
    "alias is another model's name": (registry_text(chat("a"), chat("b", ", aliases: [a]")),
                                      "models[1].aliases[0]: 'a' is already used by models[0].name"),
    "alias used twice": (registry_text(chat("a", ", aliases: [x]"), chat("b", ", aliases: [x]")),
                         "models[1].aliases[0]: 'x' is already used by models[0].aliases[0]"),
    "alias repeats own name": (registry_text(chat("a", ", aliases: [a]")),
                               "models[0].aliases[0]: an alias cannot repeat the model's own name"),
    "block size": (registry_text(chat("a"), chat("b", ", engine: {block_size: 12}")),
                   "models[1].engine.block_size: must be a power of two, got 12"),
    "speculative lookup range": (registry_text(chat("a", ", engine: {speculative: {prompt_lookup_min: 5}}")),
                                 "models[0].engine.speculative.prompt_lookup_min: must be at most prompt_lookup_max "
                                 "(4), got 5"),
    "draft method without its model": (registry_text(chat("a", ", engine: {speculative: {method: draft}}")),
                                       "models[0].engine.speculative.draft_model: needed with method 'draft': the "
                                       "name of the model that proposes"),
    "draft model with prompt lookup": (registry_text(chat("a", ", engine: {speculative: {draft_model: a}}")),
                                       "models[0].engine.speculative.draft_model: only used with method 'draft' "
                                       "(method is 'ngram')"),
    "unknown draft model": (registry_text(chat("a", ", engine: {speculative: {method: draft, draft_model: b}}")),
                            "models[0].engine.speculative.draft_model: unknown model 'b'"),
    "draft by alias": (registry_text(chat("a", ", engine: {speculative: {method: draft, draft_model: bee}}"),
                                     chat("b", ", aliases: [bee]")),
                       "models[0].engine.speculative.draft_model: unknown model 'bee' ('bee' is an alias; a draft is "
                       "named by its model's name: use 'b')"),
    "embedding draft": (registry_text(chat("a", ", engine: {speculative: {method: draft, draft_model: e}}"),
                                      "{name: e, type: embedding, source: {path: e}}"),
                        "models[0].engine.speculative.draft_model: 'e' is an embedding model; a draft is a chat or "
                        "completion model with the same tokenizer"),
    "speculative k": (registry_text(chat("a", ", engine: {speculative: {k: 40}}")),
                      "models[0].engine.speculative.k: Input should be less than or equal to 16"),
    "speculative method": (registry_text(chat("a", ", engine: {speculative: {method: eagle}}")),
                           "models[0].engine.speculative.method: Input should be 'ngram' or 'draft'"),
    "negative replicas": (registry_text(chat("a", ", replicas: -1")),
                          "models[0].replicas: Input should be greater than or equal to 0"),
    "replica range upside down": (registry_text(chat("a", ", replicas: {min: 2, max: 1}")),
                                  "models[0].replicas.min: must be at most max (1), got 2"),
    "replica range typo": (registry_text(chat("a", ", replicas: {min: 0, maxi: 1}")),
                           "models[0].replicas.maxi: unknown field"),
    "replicas neither count nor range": (registry_text(chat("a", ", replicas: two")),
                                         "models[0].replicas: Input should be a valid integer"),
    "scaling of a fixed count": (registry_text(chat("a", ", replicas: 2, scaling: {idle_unload_s: 5}")),
                                 "models[0].scaling: only for a model started on demand (replicas: {min, max}); "
                                 "replicas is 2"),
    "url model on demand": (registry_text("{name: a, type: chat, launcher: url, urls: ['http://127.0.0.1:9'], "
                                          "replicas: {min: 0, max: 1}}"),
                            "models[0].replicas: {min, max} starts replicas on demand; launcher 'url' adopts"),
    "budget of an unknown device": (registry_text(chat("a"), extra="gateway: {memory_budget_gib: {gpu0: 8}}"),
                                    "gateway.memory_budget_gib.gpu0[key]: a device is cpu or a GPU's index "
                                    "(\"0\", \"1\", ...), got 'gpu0'"),
    "zero budget": (registry_text(chat("a"), extra="gateway: {memory_budget_gib: {cpu: 0}}"),
                    "gateway.memory_budget_gib.cpu: Input should be greater than 0"),
    "typo": (registry_text(chat("a", ", replica: 2")), "models[0].replica: unknown field; did you mean 'replicas'?"),
    "nested typo": (registry_text(chat("a", ", engine: {blocksize: 8}")),
                    "models[0].engine.blocksize: unknown field; did you mean 'block_size'?"),
    "unknown fallback": (registry_text(chat("a", ", fallbacks: [nope]")),
                         "models[0].fallbacks[0]: unknown model 'nope'"),
    "fallback by alias": (registry_text(chat("a", ", fallbacks: [bee]"), chat("b", ", aliases: [bee]")),
                          "models[0].fallbacks[0]: unknown model 'bee' ('bee' is an alias; fallbacks name models: "
                          "use 'b')"),
    "fallback to itself": (registry_text(chat("a", ", fallbacks: [a]")),
                           "models[0].fallbacks[0]: a model cannot fall back to itself"),
    "fallback cycle": (registry_text(chat("a", ", fallbacks: [b]"), chat("b", ", fallbacks: [c]"),
                                     chat("c", ", fallbacks: [a]")),
                       "models[2].fallbacks: fallback cycle a -> b -> c -> a"),
    "fallback of another type": (registry_text(chat("a", ", fallbacks: [e]"),
                                               "{name: e, type: embedding, source: {path: /e}}"),
                                 "models[0].fallbacks[0]: 'e' has type 'embedding'; a fallback must have the same type "
                                 "as its model ('chat')"),
    "context fallback unknown": (registry_text(chat("a", ", context_window_fallbacks: [big]")),
                                 "models[0].context_window_fallbacks[0]: unknown model 'big'"),
    "variant of another type": (registry_text(chat("a", ", variants: {internal: e}"),
                                              "{name: e, type: embedding, source: {path: /e}}"),
                                "models[0].variants.internal: 'e' has type 'embedding'; a variant must have"),
    "variant is itself": (registry_text(chat("a", ", variants: {internal: a}")),
                          "models[0].variants.internal: a model cannot fall back to itself"),
    "url launcher without urls": (registry_text("{name: r, type: chat, launcher: url}"),
                                  "models[0].urls: launcher 'url' needs the URL of each replica's server"),
    "url count": (registry_text("{name: r, type: chat, launcher: url, replicas: 2, urls: [http://h:1]}"),
                  "models[0].urls: launcher 'url' needs one URL per replica: replicas=2, got 1 url(s)"),
    "bad url": (registry_text("{name: r, type: chat, launcher: url, urls: [h:1]}"),
                "models[0].urls[0]: must be an http:// or https:// URL, got 'h:1'"),
    "urls without url launcher": (registry_text(chat("a", ", urls: [http://h:1]")),
                                  "models[0].urls: only used with launcher 'url' (launcher is 'local')"),
    "ray resources without ray launcher": (registry_text(chat("a", ", ray: {num_gpus: 1}")),
                                           "models[0].ray: only used with launcher 'ray' (launcher is 'local')"),
    "ray negative gpus": (registry_text(chat("a", ", launcher: ray, ray: {num_gpus: -1}")),
                          "models[0].ray.num_gpus: Input should be greater than or equal to 0"),
    "ray custom resource": (registry_text(chat("a", ", launcher: ray, ray: {resources: {node_b: 0}}")),
                            "models[0].ray.resources.node_b: Input should be greater than 0"),
    "source url with local launcher": (registry_text("{name: a, type: chat, source: {url: http://h/m}}"),
                                       "models[0].source.url: only with launcher 'url'"),
    "no source": (registry_text("{name: a, type: chat}"), "models[0].source: required with launcher 'local'"),
    "two sources": (registry_text("{name: a, type: chat, source: {path: /m, url: http://h/m}}"),
                    "models[0].source: give exactly one of package (with file), path or url"),
    "package without file": (registry_text("{name: a, type: chat, source: {package: p}}"),
                             "models[0].source.file: package and file go together"),
    "name not a slug": (registry_text(chat("Big Model")), "models[0].name: String should match pattern"),
    "type": (registry_text("{name: a, type: chatty, source: {path: /m}}"),
             "models[0].type: Input should be 'chat', 'completion' or 'embedding'"),
    "sm percent": (registry_text(chat("a", ", placement: {sm_percent: 101}")),
                   "models[0].placement.sm_percent: Input should be less than or equal to 100"),
    "weight": (registry_text(chat("a", ", placement: {weight: 0}")),
               "models[0].placement.weight: Input should be greater than 0"),
    "isolation": (registry_text(chat("a", ", placement: {isolation: vgpu}")),
                  "models[0].placement.isolation: Input should be 'mig', 'mps', 'timeslice' or 'exclusive'"),
    "mig instance with mig isolation": (
        registry_text(chat("a", ", placement: {isolation: mig, mig_instance: shared}")),
        "models[0].placement.mig_instance: names a MIG instance to share by mps or timeslice, but isolation is 'mig'"),
    "mig instance on the cpu": (
        registry_text(chat("a", ", device: cpu, placement: {isolation: mps, mig_instance: shared}")),
        "models[0].placement.mig_instance: a MIG instance is part of a GPU, but device is 'cpu'"),
    "mig instance name": (registry_text(chat("a", ", placement: {isolation: mps, mig_instance: Shared/1}")),
                          "models[0].placement.mig_instance: String should match pattern"),
    "routing": (registry_text(chat("a", ", policy: {routing: random}")), "models[0].policy.routing: Input should be"),
    "multilevel without scheduling": (registry_text(chat("a", ", policy: {multilevel: {aging_s: 5}}")),
                                      "models[0].policy.multilevel: only used with scheduling 'multilevel'"),
    "multilevel unknown option": (
        registry_text(chat("a", ", policy: {scheduling: multilevel, multilevel: {agin_s: 5}}")),
        "models[0].policy.multilevel: MultiLevelConfig.__init__() got an unexpected keyword argument 'agin_s'; "
        "known options: aging_s"),
    "multilevel bad value": (
        registry_text(chat("a", ", policy: {scheduling: multilevel, multilevel: {max_long_running: 0}}")),
        "models[0].policy.multilevel: max_long_running must be >= 1, got 0"),
    "lane thresholds": (
        registry_text(chat("a", ", policy: {lanes: {interactive_max_prompt_tokens: 5000}}")),
        "models[0].policy.lanes: interactive_max_prompt_tokens (5000) must be below background_min_prompt_tokens"),
    "queue limit": (registry_text(chat("a", ", policy: {max_queue_len: 0}")),
                    "models[0].policy.max_queue_len: Input should be greater than or equal to 1"),
    "embedding with multilevel": (
        registry_text("{name: e, type: embedding, source: {path: /e}, policy: {scheduling: multilevel}}"),
        "models[0].policy.scheduling: not supported for embedding models"),
    "embedding with a queue limit": (
        registry_text("{name: e, type: embedding, source: {path: /e}, policy: {max_queue_len: 3}}"),
        "models[0].policy.max_queue_len: not supported for embedding models"),
    "unknown tool parser": (registry_text(chat("a", ", chat: {tool_parser: qwen}")),
                            "models[0].chat.tool_parser: Input should be 'hermes', 'llama3_json' or 'mistral'"),
    "unknown chat key": (registry_text(chat("a", ", chat: {template: x}")),
                         "models[0].chat.template: unknown field"),
    "chat options for an embedder": (
        registry_text("{name: e, type: embedding, source: {path: m}, chat: {reasoning_parser: think}}"),
        "models[0].chat: how chat replies are read: only for type 'chat' (type is 'embedding')"),
    "chat options for a url replica": (
        registry_text("{name: u, type: chat, launcher: url, urls: ['http://127.0.0.1:9'], "
                      "chat: {tool_parser: hermes}}"),
        "models[0].chat: read by multiserve's own engine; a 'url' replica's server reads its replies itself"),
    "gateway port": (registry_text(chat("a"), extra="gateway: {port: 70000}\n"),
                     "gateway.port: Input should be less than or equal to 65535"),
    "no models key": ("gateway: {port: 8000}\n", "models: Field required"),
    "empty file": ("", "(top level): the file is empty"),
    "not a mapping": ("- a\n- b\n", "(top level): Input should be a valid dictionary"),
    "yaml syntax": ("models:\n  - name: a\n    type: chat: x\n", "line 3, column 15: mapping values are not allowed"),
    "yaml duplicate key": ("models:\n  - name: a\n    name: b\n", 'line 3, column 5: found duplicate key "name"'),
}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_registry_names_the_field(case):
    text, expected = INVALID[case]
    with pytest.raises(RegistryError) as info:
        parse_registry(text, "configs/x.yaml")
    message = str(info.value)
    assert f"configs/x.yaml: {expected}" in message, message
    assert info.value.path == "configs/x.yaml" and info.value.problems


LIMIT = "Input should be less than or equal to"
OUT_OF_BOUNDS = {
    "a million replicas": ("replicas: 1000000", f"models[0].replicas: {LIMIT} 64"),
    "replicas as a bool": ("replicas: true", "models[0].replicas: Input should be a valid integer"),
    "replicas as a string": ("replicas: '3'", "models[0].replicas: Input should be a valid integer"),
    "block size": ("engine: {block_size: 512}", f"models[0].engine.block_size: {LIMIT} 256"),
    "block size zero": ("engine: {block_size: 0}", "models[0].engine.block_size: Input should be greater than or "
                                                   "equal to 1"),
    "max_num_seqs": ("engine: {max_num_seqs: 4097}", f"models[0].engine.max_num_seqs: {LIMIT} 4096"),
    "max_num_batched_tokens": ("engine: {max_num_batched_tokens: 2000000}",
                               f"models[0].engine.max_num_batched_tokens: {LIMIT} 1048576"),
    "max_model_len": ("engine: {max_model_len: 3000000}", f"models[0].engine.max_model_len: {LIMIT} 2097152"),
    "kv_cache_gib": ("engine: {kv_cache_gib: 5000}", f"models[0].engine.kv_cache_gib: {LIMIT} 4096"),
    "memory_gib": ("placement: {memory_gib: 5000}", f"models[0].placement.memory_gib: {LIMIT} 4096"),
    "weight": ("placement: {weight: 1e6}", f"models[0].placement.weight: {LIMIT} 1000"),
    "max_queue_len": ("policy: {max_queue_len: 2000000}", f"models[0].policy.max_queue_len: {LIMIT} 1048576"),
    "request_timeout_s": ("policy: {request_timeout_s: 1e9}", f"models[0].policy.request_timeout_s: {LIMIT} 86400"),
    "load_bound": ("policy: {load_bound: 1000}", f"models[0].policy.load_bound: {LIMIT} 100"),
}


@pytest.mark.parametrize("case", OUT_OF_BOUNDS)
def test_numeric_fields_are_bounded_by_the_schema(case):
    field, expected = OUT_OF_BOUNDS[case]
    with pytest.raises(RegistryError) as info:
        parse_registry(registry_text(chat("a", f", {field}")), "r.yaml")
    assert [str(p) for p in info.value.problems] == [expected]


def test_the_bounds_themselves_are_accepted():
    text = registry_text(chat("a", ", replicas: 64, engine: {block_size: 256, max_num_seqs: 4096, kv_cache_gib: 4096,"
                                   " max_model_len: 2097152, max_num_batched_tokens: 1048576},"
                                   " placement: {memory_gib: 4096}"))
    spec = parse_registry(text, "r.yaml").models[0]
    assert (spec.replicas, spec.engine.block_size, spec.engine.max_num_seqs) == (64, 256, 4096)


def test_every_problem_is_reported_one_per_line():
    text = registry_text(chat("a", ", replicas: -1, engine: {block_size: 3}"))
    with pytest.raises(RegistryError) as info:
        parse_registry(text, "r.yaml")
    assert str(info.value).splitlines() == [
        "r.yaml: models[0].replicas: Input should be greater than or equal to 0",
        "r.yaml: models[0].engine.block_size: must be a power of two, got 3",
    ]
    assert [p.field for p in info.value.problems] == ["models[0].replicas", "models[0].engine.block_size"]


def test_policy_options_reach_the_engine():
    text = registry_text(chat("a", ", policy: {scheduling: multilevel, multilevel: {aging_s: 5, max_long_running: 2},"
                                   " max_queue_len: 8, max_queue_wait_s: 2.5, routing: prefix_affinity,"
                                   " lanes: {interactive_max_tokens: 64}}"))
    spec = parse_registry(text, "r.yaml").models[0]
    queue = replica_launch(spec, 0).queue
    assert queue.multilevel == {"aging_s": 5, "max_long_running": 2}
    assert (queue.scheduling, queue.max_queue_len, queue.max_queue_wait_s) == ("multilevel", 8, 2.5)
    assert spec.policy.routing == "prefix_affinity" and queue.lanes == {"interactive_max_tokens": 64}


def test_registry_validates_from_python_too():
    with pytest.raises(ValidationError, match="duplicate model name"):
        Registry.model_validate({"models": [{"name": "a", "type": "chat", "source": {"path": "/m"}}] * 2})


def test_a_ray_launcher_asks_its_resources_and_says_how_to_install_ray(monkeypatch):
    ray = "{num_cpus: 2, num_gpus: 0.5, memory_gib: 4, resources: {node_b: 1}}"
    registry = parse_registry(registry_text(chat("a", f", launcher: ray, replicas: 2, ray: {ray}")), "r.yaml")
    [spec] = registry.models
    assert spec.ray is not None and spec.ray.ray_options() == {
        "num_cpus": 2.0, "num_gpus": 0.5, "memory": 4 << 30, "resources": {"node_b": 1.0}}
    assert replica_launch(spec, 1).ray == spec.ray
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(RegistryError, match=r"models\[0\]\.launcher: 'ray' needs Ray installed where the gateway "
                                            r"runs: pip install 'multiserve\[ray\]'"):
        parse_registry(registry_text(chat("a", ", launcher: ray")), "r.yaml")


def test_chat_options_reach_the_replica_and_name_the_servers_parsers():
    from registry.schema import ReasoningParserName, ToolParserName
    from runtimes.server.reasoning_parsers import REASONING_PARSERS  # the parsers the worker's app reads with
    from runtimes.server.tool_parsers import TOOL_PARSERS

    spec = ModelSpec.model_validate({"name": "a", "type": "chat", "source": {"path": "m.gguf"},
                                     "chat": {"tool_parser": "mistral", "reasoning_parser": "none"}})
    launch = replica_launch(spec, 0)
    assert (launch.chat.tool_parser, launch.chat.reasoning_parser) == ("mistral", "none")
    plain = ModelSpec.model_validate({"name": "b", "type": "chat", "source": {"path": "m.gguf"}})
    assert replica_launch(plain, 0).chat.tool_parser is None
    assert set(typing.get_args(ToolParserName)) == set(TOOL_PARSERS)
    assert set(typing.get_args(ReasoningParserName)) == {*REASONING_PARSERS, "none"}


def test_replicas_take_a_count_or_a_range_started_on_demand():
    registry = parse_registry(registry_text(
        chat("fixed", ", replicas: 2"), chat("lazy", ", replicas: {max: 3}, scaling: {idle_unload_s: 30}"),
        chat("pinned", ", replicas: {min: 0, max: 1}, scaling: {pinned: true}"),
        extra='gateway: {memory_budget_gib: {cpu: 6, 0: 70.5}}'), "x.yaml")
    fixed, lazy, pinned = registry.models
    assert (fixed.on_demand, fixed.max_replicas, fixed.resident_replicas) == (False, 2, 2)
    assert (lazy.on_demand, lazy.max_replicas, lazy.resident_replicas) == (True, 3, 0)
    assert lazy.scaling.idle_unload_s == 30 and lazy.scaling.cold_start_timeout_s == 120
    assert (pinned.resident_replicas, pinned.scaling.idle_unload_s) == (1, 300)  # pinned: one kept
    assert registry.gateway.memory_budget_gib == {"cpu": 6, "0": 70.5}
