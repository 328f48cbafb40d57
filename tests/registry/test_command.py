"""`launcher: command`: the presets' command lines against each server's documented CLI, placeholders filled at
launch, and every mistake refused at validation by field (an unknown preset or placeholder, a binary this host does
not have, our engine's options, time-slicing, a GPU replica without its memory)."""

from __future__ import annotations

import sys

import pytest

from registry.command import PLACEHOLDERS, PRESETS, CommandSpec
from registry.errors import RegistryError
from registry.launch import launch_key, replica_launch
from registry.store import parse_registry

PYTHON = sys.executable  # an executable every host running the tests has
VALUES = {"host": "127.0.0.1", "port": "8123", "model_path": "/models/m", "served_name": "qwen", "threads": "4",
          "gpu_memory_fraction": "0.45"}


def model(command: str, more: str = "") -> str:
    return (f"models:\n  - {{name: ext, type: chat, source: {{path: m.gguf}}, launcher: command, "
            f"command: {command}{more}}}\n")


def problems(text: str) -> list[str]:
    with pytest.raises(RegistryError) as info:
        parse_registry(text, "r.yaml")
    return [str(p) for p in info.value.problems]


def flags(argv: list[str]) -> dict[str, str]:
    """`--flag value` pairs of a command line."""
    return {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}


# What each server's own documentation gives as its command line (read for these presets):
# - vLLM, `vllm serve --help`: `vllm serve <model> --host --port --served-model-name --gpu-memory-utilization`;
#   the API key from VLLM_API_KEY; GET /health.
# - SGLang, `python -m sglang.launch_server --help`: `--model-path --host --port --served-model-name
#   --mem-fraction-static`; GET /health.
# - llama.cpp's server (tools/server/README.md): `-m/--model --host --port -a/--alias -t/--threads`; the API key from
#   LLAMA_API_KEY; GET /health (503 while the model loads).
def test_vllm_preset_follows_vllm_serve():
    argv = CommandSpec(preset="vllm", binary=PYTHON).argv_for(VALUES)
    assert argv[:3] == [PYTHON, "serve", "/models/m"]
    assert flags(argv) == {"--host": "127.0.0.1", "--port": "8123", "--served-model-name": "qwen",
                           "--gpu-memory-utilization": "0.45"}
    assert PRESETS["vllm"].binary == "vllm" and PRESETS["vllm"].token_env == "VLLM_API_KEY"
    assert CommandSpec(preset="vllm", binary=PYTHON).probe_path == "/health"


def test_sglang_preset_follows_launch_server():
    argv = CommandSpec(preset="sglang", binary=PYTHON).argv_for(VALUES)
    assert argv[:3] == [PYTHON, "-m", "sglang.launch_server"]
    assert flags(argv) == {"--model-path": "/models/m", "--host": "127.0.0.1", "--port": "8123",
                           "--served-model-name": "qwen", "--mem-fraction-static": "0.45"}
    assert PRESETS["sglang"].token_env is None and PRESETS["sglang"].health_path == "/health"


def test_llamacpp_preset_follows_llama_server():
    spec = CommandSpec(preset="llamacpp", binary=PYTHON, args=["--ctx-size", "8192"])
    argv = spec.argv_for(VALUES)
    assert flags(argv) == {"--model": "/models/m", "--host": "127.0.0.1", "--port": "8123", "--alias": "qwen",
                           "--threads": "4", "--ctx-size": "8192"}  # args are appended
    assert spec.api_key_env == "LLAMA_API_KEY" and spec.probe_path == "/health"


def test_argv_takes_every_placeholder_and_literal_braces():
    argv = [PYTHON, "-m", "server"] + [f"--{p}={{{p}}}" for p in PLACEHOLDERS] + ["{{not a placeholder}}"]
    spec = CommandSpec(argv=argv, health_path="/ready", token_env="MY_KEY")
    filled = spec.argv_for(VALUES)
    assert filled[3:-1] == [f"--{p}={VALUES[p]}" for p in PLACEHOLDERS] and filled[-1] == "{not a placeholder}"
    assert (spec.probe_path, spec.api_key_env, CommandSpec(argv=[PYTHON]).probe_path) == ("/ready", "MY_KEY", "/health")


@pytest.mark.parametrize(("command", "expected"), [
    ("{preset: tgi}", "models[0].command.preset: Input should be 'vllm', 'sglang' or 'llamacpp'"),
    ("{}", "models[0].command.preset: give exactly one of preset (vllm, sglang, llamacpp) or argv"),
    (f"{{preset: vllm, argv: [{PYTHON}]}}", "models[0].command.preset: give exactly one of preset"),
    (f"{{argv: [{PYTHON}], binary: {PYTHON}}}", "models[0].command.binary: only with a preset"),
    ("{preset: vllm, binary: /no/such/vllm}", "models[0].command.binary: '/no/such/vllm' is not an executable on "
                                              "this host"),
    ("{argv: [no-such-server-anywhere]}", "models[0].command.argv[0]: 'no-such-server-anywhere' is not an "
                                          "executable"),
    (f"{{argv: [{PYTHON}, '--port={{prot}}']}}", "models[0].command.argv[1]: unknown placeholder {prot} in "
                                                   "'--port={prot}'; known: {host}, {port}"),
    (f"{{preset: vllm, binary: {PYTHON}, args: ['{{model}}']}}", "models[0].command.args[0]: unknown placeholder "
                                                                 "{model}"),
    (f"{{argv: [{PYTHON}, '{{port!r}}']}}", "models[0].command.argv[1]: '{port!r}': a placeholder takes no conversion"),
    (f"{{argv: [{PYTHON}, '{{port']}}", "models[0].command.argv[1]: '{port' is not a valid template"),
    (f"{{argv: [{PYTHON}], health_path: health}}", "models[0].command.health_path: String should match pattern"),
    (f"{{argv: [{PYTHON}], ready_timeout_s: 0}}", "models[0].command.ready_timeout_s: Input should be greater than 0"),
])
def test_a_bad_command_is_refused_by_field(command, expected):
    [found] = problems(model(command))
    assert found.startswith(expected), found


def test_a_missing_binary_is_found_at_validation_for_the_presets_default_too(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    [found] = problems(model("{preset: vllm}"))
    assert found.startswith("models[0].command.binary: 'vllm' is not an executable on this host")


@pytest.mark.parametrize(("more", "expected"), [
    (", engine: {max_num_seqs: 8}", "models[0].engine: options of multiserve's own engine"),
    (", placement: {isolation: timeslice}", "models[0].placement.isolation: timeslice needs multiserve's own engine"),
    (", device: cuda, placement: {isolation: mps}", "models[0].placement.memory_gib: required for a command replica "
                                                    "on a GPU"),
])
def test_what_a_command_replica_cannot_take_is_refused(more, expected):
    [found] = problems(model(f"{{argv: [{PYTHON}]}}", more))
    assert found.startswith(expected), found


def test_a_command_section_needs_launcher_command_and_the_other_way_round():
    text = f"models:\n  - {{name: a, type: chat, source: {{path: m.gguf}}, command: {{argv: [{PYTHON}]}}}}\n"
    assert problems(text) == ["models[0].command: only used with launcher 'command' (launcher is 'local')"]
    text = "models:\n  - {name: a, type: chat, source: {path: m.gguf}, launcher: command}\n"
    assert problems(text)[0].startswith("models[0].command: launcher 'command' needs a command")


def test_a_command_travels_in_the_launch_and_a_change_to_it_rolls_the_replicas():
    registry = parse_registry(model(f"{{argv: [{PYTHON}, '{{port}}'], served_name: Qwen/Qwen2.5-7B}}",
                                    ", device: cuda, placement: {isolation: mps, memory_gib: 20}"), "r.yaml")
    spec = registry.models[0]
    launch = replica_launch(spec, 1)
    assert launch.command == spec.command and launch.served_name == "Qwen/Qwen2.5-7B" == spec.served_name
    changed = spec.model_copy(update={"command": spec.command.model_copy(update={"args": ["--x"]})})
    assert launch_key(changed) != launch_key(spec)
    plain = parse_registry("models:\n  - {name: a, type: chat, source: {path: m.gguf}}\n", "r.yaml").models[0]
    assert plain.served_name == "a" and replica_launch(plain, 0).served_name is None
