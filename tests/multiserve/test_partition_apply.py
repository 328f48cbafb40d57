"""`multiserve partition apply [--dry-run]` and what `partition status` says about applied state and live shares."""

from __future__ import annotations

import io
import json

import pytest

from multiserve.partition_apply import prepare_devices
from partitioner.applying.commands import CommandResult
from partitioner.timeslice.client import LeaseClient
from partitioner.timeslice.service import ArbiterService
from tests.multiserve.test_partition_cli import H100, REGISTRY, SHAPES, no_nvml, run


@pytest.fixture
def files(tmp_path):
    (tmp_path / "reg.yaml").write_text(REGISTRY)
    (tmp_path / "shapes.json").write_text(json.dumps(SHAPES))
    return tmp_path


def apply(capsys, files, *extra: str) -> tuple[int, str, str]:
    return run(capsys, "apply", "--config", str(files / "reg.yaml"), "--inventory", H100, "--shapes",
               str(files / "shapes.json"), "--state-file", str(files / "state.json"), *extra)


def test_mig_mode_off_is_an_error_naming_the_operator_step(capsys, files):
    code, out, err = apply(capsys, files, "--dry-run")
    assert code == 1 and out == ""
    assert "error: apply failed: GPU 0 (NVIDIA H100 80GB HBM3): the plan puts MIG devices on it but its MIG " \
           "mode is off" in err
    assert "sudo nvidia-smi -i 0 -mig 1" in err and "--mig-fallback" in err


def test_dry_run_with_the_mps_fallback_prints_every_command(capsys, files):
    code, out, err = apply(capsys, files, "--dry-run", "--mig-fallback", "mps")
    assert code == 0, err
    assert "warning: GPU 0" in err and "Fallback: the mig replicas run with mps isolation instead" in err
    lines = out.splitlines()
    assert lines[0] == "dry run: would run 3 action(s):"
    assert lines[1].startswith("  - GPU 0: CUDA_VISIBLE_DEVICES=GPU-") and lines[1].endswith(
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/multiserve-mps/gpu0 CUDA_MPS_LOG_DIRECTORY=/tmp/multiserve-mps-log/gpu0 "
        "nvidia-cuda-mps-control -d")
    assert lines[2] == ("  - GPU 0: echo set_default_active_thread_percentage 50 | "
                        "CUDA_MPS_PIPE_DIRECTORY=/tmp/multiserve-mps/gpu0 nvidia-cuda-mps-control")
    assert lines[3].startswith("  - GPU 0: echo set_default_device_pinned_mem_limit 0 ")
    assert "llama/0   gpu0    mps" in out and not (files / "state.json").exists()


def test_apply_to_a_fake_inventory_changes_nothing_here(capsys, files):
    code, out, _ = apply(capsys, files, "--mig-fallback", "timeslice")
    assert code == 0 and out.startswith("applied 0 action(s) (the devices match)")
    assert "llama/1   gpu0    timeslice" in out and not (files / "state.json").exists()


def test_infeasible_apply_exits_1(capsys, files):
    code, _, err = apply(capsys, files, "--max-memory-fraction", "0.3", "--mig-fallback", "mps")
    assert code == 1 and "error: infeasible plan" in err


@no_nvml
def test_apply_on_a_cpu_host_has_nothing_to_do(capsys, tmp_path):
    code, out, _ = run(capsys, "apply", "--state-file", str(tmp_path / "state.json"))
    assert code == 0 and out.startswith("applied 0 action(s) (the devices match)")


def test_status_shows_applied_state_and_live_shares(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTISERVE_RUN_DIR", str(tmp_path / "run"))
    (tmp_path / "state.json").write_text(json.dumps({"mig_devices": {"MIG-abc": 0}, "mps_daemons": {}}))
    code, out, _ = run(capsys, "status", "--inventory", H100, "--state-file", str(tmp_path / "state.json"))
    assert code == 0 and "MIG device MIG-abc on GPU 0" in out and "time-slice shares: no arbiter running" in out
    service = ArbiterService(tmp_path / "run" / "arbiter" / "cpu.sock", "cpu").start()
    client = LeaseClient(service.socket_path, "chat/0", 3.0)
    try:
        client.acquire()
        client.release()
        code, out, _ = run(capsys, "status", "--inventory", H100, "--json")
        live = json.loads(out)["time_shares"]
        assert [(d["device"], [c["client_id"] for c in d["clients"]]) for d in live] == [("cpu", ["chat/0"])]
        code, out, _ = run(capsys, "status", "--inventory", H100)
        assert "cpu: chat/0 weight 3: 100.0% recently" in out
    finally:
        client.close()
        service.close()


@pytest.mark.parametrize("command", ["plan", "apply"])
def test_plan_and_apply_take_the_same_plan_arguments(capsys, files, command):
    code, _, err = run(capsys, command, "--config", str(files / "reg.yaml"), "--gpus", "first")
    assert code == 2 and "--gpus: expected GPU indices" in err


MPS_REGISTRY = """\
gateway: {model_roots: [/]}
models:
  - name: small
    type: chat
    source: {path: /m/small.gguf}
    device: cuda
    placement: {isolation: mps, memory_gib: 2}
"""


class _Commands:
    def __init__(self) -> None:
        self.argv: list[list[str]] = []

    def run(self, argv, env, input_text=None) -> CommandResult:
        self.argv.append(list(argv))
        return CommandResult(0)


@pytest.mark.parametrize("mode, euid, applied", [("auto", 1000, True), ("yes", 1000, True), ("no", 0, False)])
def test_serve_starts_the_mps_daemons_its_plan_needs(tmp_path, monkeypatch, mode, euid, applied):
    (tmp_path / "reg.yaml").write_text(MPS_REGISTRY)
    monkeypatch.chdir(tmp_path)  # the applied-state file goes to the working directory
    err, commands = io.StringIO(), _Commands()
    code = prepare_devices(tmp_path / "reg.yaml", mode, env={}, err=err, inventory_file=H100, runner=commands,
                           euid=euid)
    assert code == 0, err.getvalue()
    assert (commands.argv[:1] == [["nvidia-cuda-mps-control", "-d"]]) is applied
    assert ("applied 3 action(s)" in err.getvalue()) is applied


def test_serve_leaves_mig_to_root_and_reports_what_it_cannot_apply(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reg.yaml").write_text(MPS_REGISTRY.replace("isolation: mps", "isolation: mig"))
    err, commands = io.StringIO(), _Commands()
    code = prepare_devices(tmp_path / "reg.yaml", "auto", env={}, err=err, inventory_file=H100, runner=commands,
                           euid=1000)  # MIG devices to create, not root: serve's registry check refuses it instead
    assert code == 0 and commands.argv == [] and "the plan needs MIG changes, which need root" in err.getvalue()
    err = io.StringIO()
    code = prepare_devices(tmp_path / "reg.yaml", "yes", env={}, err=err, inventory_file=H100, runner=commands)
    assert code == 1 and "its MIG mode is off" in err.getvalue()  # never changed by us: the operator's step
    (tmp_path / "bad.yaml").write_text("models: [{name: x}]\n")
    assert prepare_devices(tmp_path / "bad.yaml", "yes", env={}, err=err, inventory_file=H100) == 0  # serve says
