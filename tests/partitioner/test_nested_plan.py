"""Nested plans: mps or timeslice replicas sharing a MIG instance (`placement.mig_instance`) next to mig replicas on
one GPU. The tree they plan to, its text and JSON, the precise refusals, and the nested apply (MIG devices, then a
daemon on the shared one) against the fake backend and the strict MPS fake, with a failure in the middle."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

from multiserve.cli import main
from multiserve.partition_cli import applied_and_live, render_applied_and_live
from partitioner.applying.actions import Action, ApplyError
from partitioner.applying.applied_state import AppliedStateFile
from partitioner.applying.applier import Applier, reconcile
from partitioner.devices.fake_backend import FakeBackend
from partitioner.devices.read import read_inventory
from partitioner.planning.demand import replica_demands
from partitioner.planning.placement import PlanOptions
from partitioner.planning.plan import InfeasiblePlan, PlanAction
from partitioner.planning.planner import plan
from registry.fields import GIB
from registry.schema import Registry
from tests.partitioner.conftest import INVENTORIES, demand, gpus
from tests.partitioner.fake_mps import FakeMpsRunner

MPS = "nvidia-cuda-mps-control"
H200 = str(INVENTORIES / "h200-141gb.json")
MIXED = """\
gateway: {model_roots: [/]}
models:
  - {name: big, type: chat, source: {path: /models/big.gguf}, placement: {isolation: mig, memory_gib: 60}}
  - {name: small, type: chat, source: {path: /models/small.gguf}, placement: {isolation: mig, memory_gib: 30}}
  - name: chat-a
    type: chat
    source: {path: /models/a.gguf}
    placement: {isolation: mps, memory_gib: 16, sm_percent: 30, mig_instance: shared}
  - name: chat-b
    type: chat
    source: {path: /models/b.gguf}
    placement: {isolation: mps, memory_gib: 16, sm_percent: 60, mig_instance: shared}
"""
# the four do not fit at the default 95 % headroom (see test_the_mixed_registry_at_the_default_headroom...)
FULL = PlanOptions(max_memory_fraction=1.0)


def mixed_demands():
    return replica_demands(Registry.model_validate(yaml.safe_load(MIXED)))


def infeasible(inventory, demands, options=None) -> str:
    with pytest.raises(InfeasiblePlan) as exc:
        plan(inventory, demands, options)
    return str(exc.value)


# --- planning --------------------------------------------------------------------------------------------------


def test_the_mixed_registry_plans_mig_instances_with_mps_inside_one():
    result = plan(gpus("h200-141gb"), mixed_demands(), FULL)
    gpu = result.device("gpu0")
    assert gpu.mode == "mig" and gpu.enable_mig
    assert gpu.replica_ids == ("big/0", "chat-a/0", "chat-b/0", "small/0")
    assert [(m.profile, m.start, m.replica_id, m.sharing, m.clients) for m in gpu.mig_devices] == [
        ("3g.71gb", 0, "big/0", None, ()),
        ("1g.35gb", 4, "mig-instance:shared", "mps", ("chat-a/0", "chat-b/0")),  # 32 GiB in all: 1g.35gb holds it
        ("1g.35gb", 6, "small/0", None, ())]
    shared = gpu.mig_devices[1]
    assert shared.device_key == "gpu0-mig4" and shared.mps_pipe_directory == "/tmp/multiserve-mps/gpu0-mig4"
    a, b = result.replica("chat-a/0"), result.replica("chat-b/0")
    assert (a.isolation, a.device_key, a.sm_percent, a.memory_bytes) == ("mps", "gpu0-mig4", 30, 16 * GIB)
    assert (b.sm_percent, b.memory_fraction) == (60, pytest.approx(16 / 32.5))  # of the 32.5 GiB MIG device
    assert a.env == {"CUDA_VISIBLE_DEVICES": "pending-mig:1g.35gb@4",
                     "CUDA_MPS_PIPE_DIRECTORY": "/tmp/multiserve-mps/gpu0-mig4",
                     "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={16 * 1024}M"}
    assert result.replica("big/0").env == {"CUDA_VISIBLE_DEVICES": "pending-mig:3g.71gb@0"}
    assert result.actions() == (
        PlanAction("enable_mig", 0),
        PlanAction("create_mig_device", 0, profile="3g.71gb", start=0),
        PlanAction("create_mig_device", 0, profile="1g.35gb", start=4),
        PlanAction("create_mig_device", 0, profile="1g.35gb", start=6),
        PlanAction("start_mps_daemon", 0, pipe_directory="/tmp/multiserve-mps/gpu0-mig4",
                   mig_device="pending-mig:1g.35gb@4"))


def test_the_tree_nests_replicas_under_their_mig_devices():
    tree = plan(gpus("h200-141gb"), mixed_demands(), FULL).to_dict()["tree"]
    assert [(d["device"], d["mode"], d["replicas"]) for d in tree] == [("gpu0", "mig", [])]
    migs = tree[0]["mig_devices"]
    assert [(m["profile"], m["start"], m["sharing"], m["memory_bytes"]) for m in migs] == [
        ("3g.71gb", 0, "mig", 70330089472), ("1g.35gb", 4, "mps", 34896609280), ("1g.35gb", 6, "mig", 34896609280)]
    assert [(r["replica_id"], r["isolation"], r["sm_percent"], r["memory_bytes"]) for r in migs[1]["replicas"]] == [
        ("chat-a/0", "mps", 30, 16 * GIB), ("chat-b/0", "mps", 60, 16 * GIB)]
    assert [r["replica_id"] for r in migs[0]["replicas"]] == ["big/0"] and migs[1]["instance"] == "shared"


def test_the_mixed_registry_at_the_default_headroom_names_the_missing_slots():
    # 16 + 16 GiB is over 95 % of a 2-slot profile (30.88 GiB), so the instance takes a 3g.71gb and the slots run out
    assert infeasible(gpus("h200-141gb"), mixed_demands()) == (
        "small/0 (mig, needs 30.00 GiB) does not fit: GPU 0 (NVIDIA H200): no free slots for 1g.35gb or larger: "
        "taken by 3g.71gb for big/0 (60.00 GiB), 3g.71gb for MIG instance 'shared' (mps: chat-a/0, chat-b/0) "
        "(32.00 GiB); no slot is left for any profile")


def test_an_instance_larger_than_any_profile_says_by_how_much():
    demands = [demand(n, 0, "mps", 60, mig_instance="huge") for n in ("a", "b", "c")]
    assert infeasible(gpus("h200-141gb"), demands) == (
        "MIG instance 'huge' (mps for a/0, b/0, c/0; needs 180.00 GiB in all) does not fit: GPU 0 (NVIDIA H200): "
        "no MIG profile holds 180.00 GiB: the largest, 7g.141gb, gives 133.00 GiB usable (132 SMs): short by "
        "47.00 GiB")


def test_an_instance_short_of_slots_says_by_how_much_the_largest_free_profile_misses():
    fake = FakeBackend(gpus("h200-141gb"))
    fake.set_mig_mode(0, True)
    busy = fake.create_mig_device(0, "1g.35gb", 4)  # somebody's, in use: slots 4-5 stay taken
    fake.add_process(0, pid=9, used_memory_bytes=GIB, device_uuid=busy.uuid)
    demands = [demand("big", 0, "mig", 60), demand("a", 0, "timeslice", 20, mig_instance="t"),
               demand("b", 0, "timeslice", 20, mig_instance="t")]
    assert infeasible(fake.snapshot(), demands) == (
        "MIG instance 't' (timeslice for a/0, b/0; needs 40.00 GiB in all) does not fit: GPU 0 (NVIDIA H200): no free "
        "slots for 3g.71gb or larger: taken by 1g.35gb at slot 4 (existing), 3g.71gb for big/0 (60.00 GiB); the "
        "largest that still fits, 1g.35gb, gives 30.88 GiB usable: short by 9.12 GiB")
    assert plan(fake.snapshot(), demands[1:]).replica("a/0").isolation == "timeslice"  # alone, the instance fits


def test_mps_percentages_in_one_instance_must_sum_to_at_most_100():
    demands = [demand("a", 0, "mps", 4, sm_percent=50, mig_instance="s"),
               demand("b", 0, "mps", 4, sm_percent=60, mig_instance="s"), demand("m", 0, "mig", 10)]
    assert infeasible(gpus("h200-141gb"), demands) == (
        "MIG instance 's' (mps: a/0, b/0): MPS thread percentages [50, 60] of the instance's SMs would sum to 110 %: "
        "over 100 % by 10")


def test_one_instance_is_shared_one_way():
    demands = [demand("a", 0, "mps", 4, mig_instance="s"), demand("b", 0, "timeslice", 4, mig_instance="s")]
    assert infeasible(gpus("h200-141gb"), demands) == (
        "MIG instance 's': a/0 ask mps and b/0 timeslice; the replicas of one instance share it one way (all mps "
        "or all timeslice)")


def test_timeslice_inside_an_instance_shares_by_weight_without_a_daemon():
    demands = [demand("a", 0, "timeslice", 7, weight=3, mig_instance="t"),  # 14 GiB: within 95 % of 16 GiB
               demand("b", 0, "timeslice", 7, weight=1, mig_instance="t"), demand("m", 0, "mig", 30)]
    result = plan(gpus("h200-141gb"), demands)
    shared = next(m for m in result.device("gpu0").mig_devices if m.instance == "t")
    assert (shared.profile, shared.sharing, shared.mps_pipe_directory) == ("1g.18gb", "timeslice", None)
    a, b = result.replica("a/0"), result.replica("b/0")
    assert (a.weight_share, b.weight_share) == (0.75, 0.25) and a.device_key == b.device_key == shared.device_key
    assert a.env == {"CUDA_VISIBLE_DEVICES": shared.device_ref}  # no MPS variables
    assert [action.kind for action in result.actions()] == ["enable_mig", "create_mig_device", "create_mig_device"]


def test_without_a_mig_gpu_an_instance_needs_the_fallback():
    plain = gpus("h200-141gb")
    l4 = replace(plain, devices=(replace(plain.devices[0], name="NVIDIA L4", mig_mode=None, mig_profiles=()),))
    demands = [demand("a", 0, "mps", 4, sm_percent=30, mig_instance="s")]
    assert infeasible(l4, demands) == ("a/0: shares MIG instance 's', but no GPU it may use can do MIG (GPU 0 (NVIDIA "
                                       "L4)); set a fallback to share a whole GPU instead")
    fallback = plan(l4, demands, PlanOptions(mig_fallback="mps")).replica("a/0")
    assert (fallback.isolation, fallback.device_key, fallback.sm_percent) == ("mps", "gpu0", 30)
    assert "mps on a whole GPU, not in MIG instance 's'" in fallback.note


def test_plain_mps_next_to_mig_still_says_how_to_share():
    message = infeasible(gpus("h200-141gb"), [demand("m", 0, "mig", 30), demand("a", 0, "mps", 4)])
    assert message.endswith("already planned for mig with 1 replica(s) (one mode per GPU; mps/timeslice replicas "
                            "share a MIG GPU only inside a MIG instance: set their placement.mig_instance)")


# --- the command line ------------------------------------------------------------------------------------------


def test_partition_plan_prints_the_tree_and_json(capsys, tmp_path):
    (tmp_path / "reg.yaml").write_text(MIXED)
    argv = ["partition", "plan", "--config", str(tmp_path / "reg.yaml"), "--inventory", H200,
            "--max-memory-fraction", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    tree = out[out.index("tree:"):].splitlines()[:9]
    assert tree == [
        "tree:",
        "  gpu0 (NVIDIA H200): mig",
        "    MIG 3g.71gb at slot 0 (65.50 GiB, to create): pending-mig:3g.71gb@0",
        "      big/0: mig, 60.00 GiB",
        "    MIG 1g.35gb at slot 4 (32.50 GiB, to create, mps in MIG instance 'shared', MPS pipe "
        "/tmp/multiserve-mps/gpu0-mig4): pending-mig:1g.35gb@4",
        "      chat-a/0: mps, 16.00 GiB, 30 % of the SMs",
        "      chat-b/0: mps, 16.00 GiB, 60 % of the SMs",
        "    MIG 1g.35gb at slot 6 (32.50 GiB, to create): pending-mig:1g.35gb@6",
        "      small/0: mig, 30.00 GiB"]
    assert "start an MPS control daemon for MIG device pending-mig:1g.35gb@4 of GPU 0" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    shared = data["tree"][0]["mig_devices"][1]
    assert (shared["instance"], shared["device"], [r["sm_percent"] for r in shared["replicas"]]) == (
        "shared", "pending-mig:1g.35gb@4", [30, 60])
    assert data["actions"][-1]["kind"] == "start_mps_daemon" and data["actions"][-1]["mig_device"] == \
        "pending-mig:1g.35gb@4"


def test_partition_plan_explains_the_default_headroom_refusal(capsys, tmp_path):
    (tmp_path / "reg.yaml").write_text(MIXED)
    assert main(["partition", "plan", "--config", str(tmp_path / "reg.yaml"), "--inventory", H200]) == 1
    assert "3g.71gb for MIG instance 'shared' (mps: chat-a/0, chat-b/0) (32.00 GiB)" in capsys.readouterr().err


# --- applying --------------------------------------------------------------------------------------------------


@pytest.fixture
def h200(tmp_path):
    """One H200 with MIG mode on (the operator's step), someone else's MIG device and MPS daemon on it."""

    def make(fail_on: str | None = None, rollback: bool = False):
        backend = FakeBackend(gpus("h200-141gb"))
        backend.set_mig_mode(0, True)
        theirs = backend.create_mig_device(0, "1g.18gb", 6)  # not in our state file: never ours to destroy
        backend.start_mps("/tmp/their-mps", pid=77, device_uuid=theirs.uuid)
        backend.calls.clear()
        runner = FakeMpsRunner(backend, fail_on=fail_on)
        applier = Applier(backend, runner, AppliedStateFile(tmp_path / "state.json"), rollback=rollback)
        return backend, runner, applier, theirs

    return make


def apply(tmp_path, backend, applier, demands):
    return reconcile(lambda: read_inventory(backend), demands, PlanOptions(mps_pipe_root=str(tmp_path / "mps")),
                     applier, mps_log_root=str(tmp_path / "log"))


# 60 GiB (mig) and a 2 x 14 GiB mps instance beside the existing 1g.18gb at slot 6
NESTED = [demand("big", 0, "mig", 60), demand("a", 0, "mps", 14, sm_percent=30, mig_instance="shared"),
          demand("b", 0, "mps", 14, sm_percent=60, mig_instance="shared")]


def mig_uuids(backend) -> dict[str, str]:
    return {f"{m.profile}@{m.start}": m.uuid for m in backend.snapshot().devices[0].mig_devices}


def test_nested_apply_creates_the_mig_devices_then_a_daemon_on_the_shared_one(tmp_path, h200):
    backend, runner, applier, theirs = h200()
    outcome = apply(tmp_path, backend, applier, NESTED)
    pipe, log = str(tmp_path / "mps/gpu0-mig4"), str(tmp_path / "log/gpu0-mig4")
    assert [(a.kind, a.profile, a.start, a.uuid, a.setting) for a in outcome.actions] == [
        ("create_mig_device", "3g.71gb", 0, None, None),
        ("create_mig_device", "1g.35gb", 4, None, None),
        ("start_mps_daemon", None, None, "pending-mig:1g.35gb@4", None),
        ("set_mps_default", None, None, "pending-mig:1g.35gb@4", "set_default_active_thread_percentage 60"),
        ("set_mps_default", None, None, "pending-mig:1g.35gb@4", "set_default_device_pinned_mem_limit 0 14336M")]
    assert outcome.actions[1].describe().endswith("for mig-instance:shared (a/0, b/0)")
    made = mig_uuids(backend)
    shared = made["1g.35gb@4"]
    assert backend.calls == [("create_mig_device", (0, "3g.71gb", 0)), ("create_mig_device", (0, "1g.35gb", 4)),
                             ("start_mps", (pipe,))]
    assert runner.commands == [  # the daemon runs on the new MIG device's UUID, not the placeholder
        ([MPS, "-d"], {"CUDA_VISIBLE_DEVICES": shared, "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log},
         None),
        ([MPS], {"CUDA_MPS_PIPE_DIRECTORY": pipe}, "set_default_active_thread_percentage 60\n"),
        ([MPS], {"CUDA_MPS_PIPE_DIRECTORY": pipe}, "set_default_device_pinned_mem_limit 0 14336M\n")]
    assert backend.mps_device(pipe) == shared and (tmp_path / "log/gpu0-mig4").is_dir()
    assert outcome.created == {"big/0": made["3g.71gb@0"], "a/0": shared, "b/0": shared}
    state = AppliedStateFile(tmp_path / "state.json").load()
    assert state.mig_devices == {made["3g.71gb@0"]: 0, shared: 0}  # theirs is not recorded
    assert (state.mps_daemons[pipe].device_uuid, state.mps_daemons[pipe].settings) == (
        shared, ["set_default_active_thread_percentage 60", "set_default_device_pinned_mem_limit 0 14336M"])
    again = apply(tmp_path, backend, applier, NESTED)
    assert again.actions == []  # re-applying an applied nested plan does nothing
    a = again.plan.replica("a/0")
    assert (a.env["CUDA_VISIBLE_DEVICES"], a.env["CUDA_MPS_PIPE_DIRECTORY"], a.device_key) == (
        shared, pipe, "gpu0-mig4")
    assert theirs.uuid in made.values() and backend.mps_device("/tmp/their-mps") == theirs.uuid


def test_teardown_stops_our_daemon_before_destroying_its_device_and_leaves_theirs(tmp_path, h200):
    backend, runner, applier, theirs = h200()
    apply(tmp_path, backend, applier, NESTED)
    made = mig_uuids(backend)
    outcome = apply(tmp_path, backend, applier, [])
    pipe = str(tmp_path / "mps/gpu0-mig4")
    assert [(a.kind, a.uuid) for a in outcome.actions] == [  # the fake refuses to destroy a device a daemon serves
        ("stop_mps_daemon", made["1g.35gb@4"]), ("destroy_mig_device", made["3g.71gb@0"]),
        ("destroy_mig_device", made["1g.35gb@4"])]
    assert runner.commands[-1] == ([MPS], {"CUDA_MPS_PIPE_DIRECTORY": pipe}, "quit\n")
    assert list(mig_uuids(backend).values()) == [theirs.uuid] and backend.read_mps().pipe_directories == (
        "/tmp/their-mps",)
    state = AppliedStateFile(tmp_path / "state.json").load()
    assert state.mig_devices == {} and state.mps_daemons == {}


def test_a_failure_mid_apply_keeps_what_was_done_for_the_next_apply(tmp_path, h200):
    backend, runner, applier, _ = h200(fail_on="set_default_device_pinned_mem_limit")
    with pytest.raises(ApplyError, match=r"set_default_device_pinned_mem_limit 0 14336M \| .*: exit status 1: "
                                         r"set_default_device_pinned_mem_limit: refused \(injected\)$"):
        apply(tmp_path, backend, applier, NESTED)
    state = AppliedStateFile(tmp_path / "state.json").load()
    assert len(state.mig_devices) == 2 and len(state.mps_daemons) == 1
    runner.fail_on = None
    finish = apply(tmp_path, backend, applier, NESTED)
    assert [(a.kind, a.setting) for a in finish.actions] == [
        ("set_mps_default", "set_default_device_pinned_mem_limit 0 14336M")]


@pytest.mark.parametrize("fail_on", ["set_default_active_thread_percentage", "-d"])
def test_rollback_undoes_only_what_this_apply_created(tmp_path, h200, fail_on):
    backend, runner, applier, theirs = h200(fail_on=fail_on, rollback=True)
    with pytest.raises(ApplyError) as exc:
        apply(tmp_path, backend, applier, NESTED)
    pipe = str(tmp_path / "mps/gpu0-mig4")
    destroyed = [args[1] for op, args in backend.calls if op == "destroy_mig_device"]
    daemon_started = fail_on != "-d"
    # the daemon (when it started) quits first, or the fake would refuse to destroy the device it serves; then our
    # MIG devices go, newest first
    assert [op for op, _ in backend.calls] == ["create_mig_device", "create_mig_device"] + (
        ["start_mps", "stop_mps"] if daemon_started else []) + ["destroy_mig_device", "destroy_mig_device"]
    undone = ([f"stopped the MPS daemon of {pipe}"] if daemon_started else []) + [
        f"destroyed MIG device {uuid}" for uuid in destroyed]
    assert str(exc.value).endswith(": exit status 1: " + fail_on + ": refused (injected). Rolled back: " +
                                   "; ".join(undone))
    assert runner.commands[-1][2 if daemon_started else 0] == ("quit\n" if daemon_started else [MPS, "-d"])
    assert list(mig_uuids(backend).values()) == [theirs.uuid]
    assert backend.read_mps().pipe_directories == ("/tmp/their-mps",)
    state = AppliedStateFile(tmp_path / "state.json").load()
    assert state.mig_devices == {} and state.mps_daemons == {}


def test_status_names_the_mig_device_a_daemon_serves(tmp_path, h200):
    backend, _, applier, _ = h200()
    apply(tmp_path, backend, applier, NESTED)
    shared = mig_uuids(backend)["1g.35gb@4"]
    text = render_applied_and_live(applied_and_live(str(tmp_path / "state.json"), {"MULTISERVE_RUN_DIR":
                                                                                   str(tmp_path / "run")}))
    assert f"  MIG device {shared} on GPU 0" in text
    assert (f"  MPS daemon for MIG device {shared} of GPU 0 (pipe {tmp_path}/mps/gpu0-mig4): "
            f"set_default_active_thread_percentage 60, set_default_device_pinned_mem_limit 0 14336M") in text


def test_a_daemon_for_a_device_this_apply_did_not_create_is_refused(tmp_path, h200):
    _, runner, applier, _ = h200()
    orphan = Action("start_mps_daemon", 0, uuid="pending-mig:1g.35gb@4", pipe_directory=str(tmp_path / "p"),
                    log_directory=str(tmp_path / "l"))
    with pytest.raises(ApplyError, match=r"its MIG device pending-mig:1g.35gb@4 was not created by this apply"):
        applier.execute([orphan])
    assert runner.commands == []
