"""Inventory JSON (round trip, errors that name the field) and the unprivileged MPS daemon probe."""

from __future__ import annotations

import json

import pytest

from partitioner.devices.fake_backend import FakeBackend
from partitioner.devices.inventory import InventoryFileError, MpsStatus, load_inventory, save_inventory
from partitioner.devices.mps_probe import candidate_pipe_directories, probe_mps
from registry.fields import GIB
from tests.partitioner.conftest import INVENTORIES, gpus


def test_json_round_trip_keeps_everything(tmp_path):
    fake = FakeBackend(gpus("a100-80gb", count=2))
    fake.set_mig_mode(1, True)
    device = fake.create_mig_device(1, "3g.40gb", 0)
    fake.add_process(1, pid=11, used_memory_bytes=3 * GIB, device_uuid=device.uuid)
    fake.add_process(0, pid=12, used_memory_bytes=GIB, reported=False)
    fake.start_mps("/tmp/nvidia-mps", pid=5)
    inventory = fake.snapshot()
    save_inventory(inventory, tmp_path / "inv.json")
    assert load_inventory(tmp_path / "inv.json") == inventory


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["devices"][0].pop("uuid"), "devices[0].uuid: required"),
    (lambda d: d["devices"][0]["mig_profiles"][2].update(memory_bytes="10GB"),
     "devices[0].mig_profiles[2].memory_bytes: expected int, got '10GB'"),
    (lambda d: d["devices"][0].update(index=True), "devices[0].index: expected int, got True"),
    (lambda d: d.update(devices={}), "devices: expected list"),
])
def test_bad_files_name_the_field(tmp_path, edit, message):
    path = tmp_path / "bad.json"
    raw = json.loads((INVENTORIES / "h100-80gb.json").read_text())
    edit(raw)
    path.write_text(json.dumps(raw))
    with pytest.raises(InventoryFileError) as exc:
        load_inventory(path)
    assert str(path) in str(exc.value) and message in str(exc.value)


def test_unreadable_file_is_an_inventory_error(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(InventoryFileError, match=r"x\.json"):
        load_inventory(tmp_path / "x.json")
    with pytest.raises(InventoryFileError, match=r"missing\.json"):
        load_inventory(tmp_path / "missing.json")


def fake_proc(root, pid, argv0):
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "cmdline").write_bytes(argv0.encode() + b"\0-d\0")


def test_mps_probe_finds_the_control_daemon_and_live_pipe_directories(tmp_path):
    proc = tmp_path / "proc"
    fake_proc(proc, 100, "/usr/bin/nvidia-cuda-mps-control")
    fake_proc(proc, 101, "nvidia-cuda-mps-server")  # the server, not the control daemon
    fake_proc(proc, 102, "python")
    (proc / "self").mkdir()
    live, dead = tmp_path / "gpu0", tmp_path / "gpu1"
    live.mkdir()
    dead.mkdir()
    (live / "control").write_text("")
    status = probe_mps([str(live), str(dead)], proc_root=proc)
    assert status == MpsStatus(control_pids=(100,), pipe_directories=(str(live),)) and status.running
    assert not probe_mps([str(dead)], proc_root=tmp_path / "no-proc").running


def test_candidate_pipe_directories(tmp_path):
    (tmp_path / "gpu1").mkdir()
    (tmp_path / "gpu0").mkdir()
    dirs = candidate_pipe_directories({"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"}, own_root=str(tmp_path))
    assert dirs == ["/tmp/nvidia-mps", "/run/mps", str(tmp_path / "gpu0"), str(tmp_path / "gpu1")]
