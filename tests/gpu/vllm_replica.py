"""The parts of the vLLM check (check_vllm.py) that need neither a GPU nor vLLM, so the CPU suite tests them
(tests/gpu/test_vllm_replica.py): the tiny model directory vLLM loads, the `vllm` launcher script, the registry of
one `launcher: command`, `preset: vllm` model, and the command line the pool starts for it on a planned device.

The model: a tiny random Llama (tests/runtimes/llm/tiny.py) saved as a Hugging Face directory (config.json,
model.safetensors, tokenizer.json with its chat template). Its LM head is zero but for the rows of the letters a-z,
so greedy decoding yields letters only (any of the 26 with a positive logit beats the rest's 0): a reply's text
cannot come back empty because the random model chose control tokens or bytes that are not UTF-8 on their own.
"""

from __future__ import annotations

import itertools
import json
import shlex
import string
import subprocess
import sys
from pathlib import Path

import yaml

from model_pool.command_launcher import CommandLauncher
from partitioner.devices.inventory import Inventory
from partitioner.planning.placer import ReplicaPlacer
from registry.launch import ReplicaPlacement, replica_launch
from registry.store import parse_registry

MODEL_NAME = "tiny-vllm"
MEMORY_GIB = 8
READY_TIMEOUT_S = 300
STOP_GRACE_S = 20
# bf16 (the model is saved in fp32; FlashAttention takes 16-bit types only), a short context, no CUDA graph capture
# (most of a tiny model's start-up) and a small batch: start-up in about a minute, little memory.
VLLM_ARGS = ("--dtype", "bfloat16", "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "16")
VLLM_ENTRY = "vllm.entrypoints.cli.main:main"  # what the `vllm` console script runs, when no other is found

_PROBE = """\
import json, vllm
from importlib.metadata import entry_points
found = [e.value for e in entry_points(group="console_scripts", name="vllm")]
print(json.dumps({"version": vllm.__version__, "entry": found[0] if found else None}))
"""


def start_probe(python: str = sys.executable) -> subprocess.Popen[str]:
    """Ask, in a subprocess (importing vLLM takes seconds and much memory, so it runs while other work goes on),
    whether `import vllm` works in `python`; `probe_result` reads the answer."""
    return subprocess.Popen([python, "-c", _PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def probe_result(probe: subprocess.Popen[str], timeout_s: float = 120.0) -> dict[str, str | None]:
    """{"version", "entry"} (the entry point of its `vllm` console script, if it has one), or {"error": why not}."""
    try:
        out, err = probe.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        probe.kill()
        probe.communicate()
        return {"error": f"`import vllm` took over {timeout_s:.0f} s"}
    if probe.returncode != 0:
        lines = err.strip().splitlines() or [f"exit code {probe.returncode}"]
        return {"error": lines[-1][:300]}
    return dict(json.loads(out.strip().splitlines()[-1]))


def write_launcher(path: Path, python: str = sys.executable, entry: str | None = None) -> Path:
    """An executable `vllm` that runs vLLM's command with `python`, the Python whose `import vllm` was probed: a
    `vllm` on PATH may belong to another Python, and a venv's bin has none of the host's console scripts."""
    module, _, function = (entry or VLLM_ENTRY).partition(":")
    code = f"import sys; from {module} import {function} as main; sys.argv[0] = 'vllm'; sys.exit(main())"
    path.write_text(f"#!/bin/sh\n# vLLM's `vllm` command, run by the Python the GPU checks use\n"
                    f"exec {shlex.quote(python)} -c {shlex.quote(code)} \"$@\"\n")
    path.chmod(0o755)
    return path


def letter_ids() -> list[int]:
    from tests.runtimes.llm.tiny import TOKENS

    return [TOKENS.index(c) for c in string.ascii_lowercase]


def write_model(path: Path) -> Path:
    """The tiny Llama as a Hugging Face directory vLLM loads (head_dim 64, GQA, 259 tokens, untied LM head)."""
    import torch

    from tests.runtimes.llm.tiny import TinySpec, hf_model, save_hf_dir

    model = hf_model(TinySpec(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                              max_position_embeddings=1024, tie_word_embeddings=False), seed=3)
    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    keep[letter_ids()] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0.0
    path.mkdir(parents=True, exist_ok=True)
    save_hf_dir(model, path)
    # Named, so AutoTokenizer (what vLLM calls) reads tokenizer.json as it is instead of a Llama tokenizer class's
    # own rebuilding of it from the model type.
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def registry_text(port: int, model_dir: Path, binary: Path, extra_args: tuple[str, ...] = ()) -> str:
    """A registry of one `preset: vllm` model on a GPU of its own (`exclusive`: no MPS daemon to start) with
    `memory_gib`, whose share of the device's memory the plan turns into `--gpu-memory-utilization`."""
    return yaml.safe_dump({
        "gateway": {"host": "127.0.0.1", "port": port, "model_roots": [str(model_dir.parent)]},
        "models": [{
            "name": MODEL_NAME, "type": "chat", "source": {"path": str(model_dir)}, "replicas": 1,
            "launcher": "command", "device": "cuda",
            "placement": {"isolation": "exclusive", "memory_gib": MEMORY_GIB},
            "command": {"preset": "vllm", "binary": str(binary), "args": [*VLLM_ARGS, *extra_args],
                        "ready_timeout_s": READY_TIMEOUT_S, "stop_grace_s": STOP_GRACE_S},
        }]}, sort_keys=False)


def planned_command(registry_path: Path, inventory: Inventory, port: int,
                    socket_dir: Path) -> tuple[list[str], ReplicaPlacement]:
    """The command line the pool would start for replica 0 of the registry at `registry_path`, planned onto
    `inventory` as `multiserve serve` plans it, and the placement the plan gave it."""
    registry = parse_registry(registry_path.read_text(), registry_path)
    spec = registry.resolve(MODEL_NAME)
    assert spec is not None
    placement = ReplicaPlacer(lambda: registry, lambda: inventory, socket_dir).place(spec, 0).placement
    return CommandLauncher().command(replica_launch(spec, 0, placement), port), placement


def flags(argv: list[str]) -> dict[str, str | None]:
    """The `--flag` options of a command line: each with its value, or None when the next item is another flag."""
    found: dict[str, str | None] = {}
    for i, item in enumerate(argv):
        if item.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else None
            found[item] = None if following is None or following.startswith("--") else following
    return found


def command_problems(argv: list[str], model_dir: Path, fraction: float, port: int) -> list[str]:
    """What in `argv` (a planned command line, or a running server's) is not the vLLM command this registry must
    give: `serve <model dir>` and the flags with their values. Empty: all of it is."""
    expected: dict[str, str | None] = {
        "--host": "127.0.0.1", "--port": str(port), "--served-model-name": MODEL_NAME,
        "--gpu-memory-utilization": f"{fraction:.4g}", "--dtype": "bfloat16", "--max-model-len": "512",
        "--enforce-eager": None, "--max-num-seqs": "16"}
    found = flags(argv)
    problems = [f"{flag}: {found.get(flag, '(missing)')!r}, expected {value!r}"
                for flag, value in expected.items() if flag not in found or found[flag] != value]
    if ("serve", str(model_dir)) not in set(itertools.pairwise(argv)):
        problems.append(f"no `serve {model_dir}` in {argv[:4]}")
    return problems
