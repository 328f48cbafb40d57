"""The vLLM check's parts that need neither a GPU nor vLLM (tests/gpu/vllm_replica.py, tests/gpu/serving.py): its
registry validates and plans, on the shipped H200 inventory, to the `vllm serve` command line with the preset's and
the check's flags; the launcher script passes its arguments through; the import probe's answers; a process group
found whole and gone after it is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundation.config_files import config_path
from partitioner.devices.read import load_host_inventory
from tests.gpu.serving import descendants, group_members
from tests.gpu.vllm_replica import (
    MEMORY_GIB,
    MODEL_NAME,
    command_problems,
    flags,
    planned_command,
    probe_result,
    registry_text,
    write_launcher,
)

H200 = config_path("inventories", "h200-141gb.json")
H200_BYTES = 150754820096  # memory_total_bytes in that file
PORT = 8123


@pytest.fixture
def registry_file(tmp_path: Path) -> Path:
    model_dir = tmp_path / "models" / MODEL_NAME
    model_dir.mkdir(parents=True)
    binary = write_launcher(tmp_path / "bin-vllm")  # a stand-in: validation only needs an executable
    path = tmp_path / "registry.yaml"
    path.write_text(registry_text(PORT, model_dir, binary))
    return path


def test_the_registry_plans_to_vllm_serve_with_the_planned_memory_share(registry_file, tmp_path):
    inventory = load_host_inventory(str(H200), {})
    argv, placement = planned_command(registry_file, inventory, PORT, tmp_path / "arbiter")
    model_dir = tmp_path / "models" / MODEL_NAME
    assert argv[:3] == [str(tmp_path / "bin-vllm"), "serve", str(model_dir)]
    fraction = MEMORY_GIB * 2**30 / H200_BYTES
    assert placement.memory_fraction == pytest.approx(fraction)
    assert placement.env == {"CUDA_VISIBLE_DEVICES": inventory.devices[0].uuid}  # exclusive: no MPS variables
    assert flags(argv) == {"--host": "127.0.0.1", "--port": str(PORT), "--served-model-name": MODEL_NAME,
                           "--gpu-memory-utilization": "0.05698", "--dtype": "bfloat16", "--max-model-len": "512",
                           "--enforce-eager": None, "--max-num-seqs": "16"}
    assert command_problems(argv, model_dir, fraction, PORT) == []


def test_command_problems_name_each_flag_that_differs(tmp_path):
    argv = ["vllm", "serve", "/elsewhere", "--host", "127.0.0.1", "--port", "1", "--served-model-name", MODEL_NAME,
            "--gpu-memory-utilization", "0.9", "--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "16"]
    assert command_problems(argv, tmp_path, 0.05698, 1) == [
        "--gpu-memory-utilization: '0.9', expected '0.05698'",
        "--enforce-eager: '(missing)', expected None",
        f"no `serve {tmp_path}` in ['vllm', 'serve', '/elsewhere', '--host']"]


def test_the_launcher_runs_the_entry_point_with_every_argument(tmp_path):
    (tmp_path / "fake_cli.py").write_text("import json, sys\n\ndef main():\n    print(json.dumps(sys.argv))\n")
    launcher = write_launcher(tmp_path / "vllm", entry="fake_cli:main")
    done = subprocess.run([str(launcher), "serve", "/models/a b", "--port", "1"], capture_output=True, text=True,
                          timeout=30, check=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert json.loads(done.stdout) == ["vllm", "serve", "/models/a b", "--port", "1"]


@pytest.mark.parametrize(("code", "expected"), [
    ("print('{\"version\": \"0.9.2\", \"entry\": \"vllm.entrypoints.cli.main:main\"}')",
     {"version": "0.9.2", "entry": "vllm.entrypoints.cli.main:main"}),
    ("import vllm_not_here", {"error": "ModuleNotFoundError: No module named 'vllm_not_here'"}),
])
def test_the_probe_answers_a_version_or_why_not(code, expected):
    probe = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert probe_result(probe, timeout_s=30) == expected


def test_a_process_group_is_found_whole_and_gone_once_killed():
    leader = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not descendants(leader.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        [child] = descendants(leader.pid)
        assert group_members(leader.pid) == sorted([leader.pid, child])
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(10)
    deadline = time.monotonic() + 10
    while group_members(leader.pid) and time.monotonic() < deadline:  # the orphaned sleep is reaped by init
        time.sleep(0.05)
    assert group_members(leader.pid) == []
