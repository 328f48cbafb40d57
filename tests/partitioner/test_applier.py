"""The applier against the fake backend and a strict fake of the MPS control command (fake_mps.py): the exact
actions and commands for MIG and MPS plans, idempotent re-applies, dry runs, and the error paths (MIG mode off,
NoPermission with and without a fallback, InUse, InsufficientResources, a failing MPS command)."""

from __future__ import annotations

import pytest

from partitioner.applying.actions import Action, ApplyError, MigUnavailable
from partitioner.applying.applied_state import AppliedStateFile
from partitioner.applying.applier import Applier, reconcile
from partitioner.devices.fake_backend import FakeBackend
from partitioner.devices.read import read_inventory
from partitioner.planning.placement import PlanOptions
from registry.fields import GIB
from tests.partitioner.conftest import demand, gpus
from tests.partitioner.fake_mps import FakeMpsRunner

MPS = "nvidia-cuda-mps-control"


@pytest.fixture
def world(tmp_path):
    """Idle H100s, MIG mode on where the operator turned it on (`mig_gpus`); state file under tmp_path."""

    def make(mig_gpus: tuple[int, ...] = (0,), count: int = 1, runner_rc: int = 0):
        backend = FakeBackend(gpus("h100-80gb", count=count))
        for index in mig_gpus:  # the operator's step, before multiserve runs
            backend.set_mig_mode(index, True)
        backend.calls.clear()
        runner = FakeMpsRunner(backend, runner_rc)
        applier = Applier(backend, runner, AppliedStateFile(tmp_path / "state.json"))
        return backend, runner, applier

    return make


def options(tmp_path, **kw) -> PlanOptions:
    return PlanOptions(mps_pipe_root=str(tmp_path / "mps"), **kw)


def run(tmp_path, backend, applier, demands, dry_run=False, **kw):
    return reconcile(lambda: read_inventory(backend), demands, options(tmp_path, **kw), applier, dry_run=dry_run,
                     mps_log_root=str(tmp_path / "log"))


MIG_DEMANDS = [demand("big", 0, "mig", 30), demand("small", 0, "mig", 8)]


def test_mig_plan_creates_devices_once(tmp_path, world):
    backend, runner, applier = world()
    outcome = run(tmp_path, backend, applier, MIG_DEMANDS)
    assert outcome.actions == [  # in slot order, as the planner laid them out
        Action("create_mig_device", 0, profile="3g.40gb", start=0, replica_id="big/0"),
        Action("create_mig_device", 0, profile="1g.10gb", start=4, replica_id="small/0")]
    assert backend.calls == [
        ("create_mig_device", (0, "3g.40gb", 0)), ("create_mig_device", (0, "1g.10gb", 4))]
    devices = {m.profile: m.uuid for m in backend.snapshot().devices[0].mig_devices}
    assert outcome.created == {"small/0": devices["1g.10gb"], "big/0": devices["3g.40gb"]}
    assert AppliedStateFile(tmp_path / "state.json").load().mig_devices == {u: 0 for u in devices.values()}
    assert runner.commands == []
    again = run(tmp_path, backend, applier, MIG_DEMANDS)
    assert again.actions == []  # the devices exist: re-applying an applied state does nothing
    assert again.plan.replica("big/0").env == {"CUDA_VISIBLE_DEVICES": devices["3g.40gb"]}


def test_mig_devices_we_made_and_no_longer_use_are_destroyed_others_are_not(tmp_path, world):
    backend, _, applier = world()
    run(tmp_path, backend, applier, MIG_DEMANDS)
    ours = {m.profile: m.uuid for m in backend.snapshot().devices[0].mig_devices}
    theirs = backend.create_mig_device(0, "1g.10gb", 5)  # somebody else's
    outcome = run(tmp_path, backend, applier, [demand("big", 0, "mig", 30)])
    assert outcome.actions == [Action("destroy_mig_device", 0, uuid=ours["1g.10gb"])]
    assert {m.uuid for m in backend.snapshot().devices[0].mig_devices} == {ours["3g.40gb"], theirs.uuid}


def test_mig_mode_off_is_the_operators_step_and_the_fallback_applies(tmp_path, world):
    backend, runner, applier = world(mig_gpus=())
    with pytest.raises(MigUnavailable) as exc:
        run(tmp_path, backend, applier, MIG_DEMANDS)
    assert "MIG mode is off" in str(exc.value) and "sudo nvidia-smi -i 0 -mig 1" in str(exc.value)
    assert "never takes" in str(exc.value) and backend.calls == [] and runner.commands == []
    outcome = run(tmp_path, backend, applier, MIG_DEMANDS, mig_fallback="mps")
    assert "MIG mode is off" in (outcome.fallback_reason or "") and "mps isolation instead" in outcome.fallback_reason
    assert backend.calls == [("start_mps", (str(tmp_path / "mps/gpu0"),))]  # never set_mig_mode
    pipe, log = str(tmp_path / "mps/gpu0"), str(tmp_path / "log/gpu0")
    uuid = backend.snapshot().devices[0].uuid
    assert runner.commands == [
        ([MPS, "-d"], {"CUDA_VISIBLE_DEVICES": uuid, "CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log},
         None),
        ([MPS], {"CUDA_MPS_PIPE_DIRECTORY": pipe}, "set_default_active_thread_percentage 50\n"),
        ([MPS], {"CUDA_MPS_PIPE_DIRECTORY": pipe}, "set_default_device_pinned_mem_limit 0 30720M\n")]
    assert outcome.plan.replica("big/0").env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


@pytest.mark.parametrize("fallback", [None, "timeslice"])
def test_no_permission_for_mig_is_a_clear_error_or_the_fallback(tmp_path, world, fallback):
    backend, runner, applier = world(mig_gpus=(0,), count=2)  # GPU 1 can take what GPU 0 (MIG only) cannot
    backend.inject("create_mig_device", "no_permission")
    if fallback is None:
        with pytest.raises(MigUnavailable, match=r"needs root: run `multiserve partition apply` as root"):
            run(tmp_path, backend, applier, MIG_DEMANDS)
        return
    outcome = run(tmp_path, backend, applier, MIG_DEMANDS, mig_fallback=fallback)
    assert "[no_permission]" in (outcome.fallback_reason or "")
    assert outcome.actions == [] and runner.commands == []  # time-slicing needs no device change
    assert {(r.isolation, r.device_key) for r in outcome.plan.replicas} == {("timeslice", "gpu1")}
    assert backend.calls == [("create_mig_device", (0, "3g.40gb", 0))]  # the one refused attempt


def test_insufficient_resources_stops_after_what_was_done(tmp_path, world):
    backend, _, applier = world()
    real_create = backend.create_mig_device

    def create_then_refuse(index, profile, start):  # the first create succeeds, then the slots are gone
        if backend.snapshot().devices[0].mig_devices:
            backend.inject("create_mig_device", "insufficient_resources")
        return real_create(index, profile, start)

    backend.create_mig_device = create_then_refuse
    with pytest.raises(ApplyError) as exc:
        run(tmp_path, backend, applier, MIG_DEMANDS)
    assert not isinstance(exc.value, MigUnavailable)
    assert "create MIG device 1g.10gb at slot 4" in str(exc.value) and "apply again to re-plan" in str(exc.value)
    made = backend.snapshot().devices[0].mig_devices
    assert [m.profile for m in made] == ["3g.40gb"]
    assert AppliedStateFile(tmp_path / "state.json").load().mig_devices == {made[0].uuid: 0}
    backend.create_mig_device = real_create
    assert run(tmp_path, backend, applier, MIG_DEMANDS).actions == [  # the next apply finishes the job
        Action("create_mig_device", 0, profile="1g.10gb", start=4, replica_id="small/0")]


def test_in_use_mig_device_is_reported(tmp_path, world):
    backend, _, applier = world()
    run(tmp_path, backend, applier, MIG_DEMANDS)
    backend.inject("destroy_mig_device", "in_use")  # a process started on it after we read the inventory
    with pytest.raises(ApplyError, match=r"destroy MIG device .*\[in_use\]; processes still run on it"):
        run(tmp_path, backend, applier, [demand("big", 0, "mig", 30)])
    assert len(AppliedStateFile(tmp_path / "state.json").load().mig_devices) == 2  # still ours to destroy later


MPS_DEMANDS = [demand("a", 0, "mps", 10, sm_percent=30), demand("b", 0, "mps", 12, sm_percent=70)]


def test_mps_daemon_with_defaults_then_nothing_then_stopped(tmp_path, world):
    backend, runner, applier = world(mig_gpus=())
    outcome = run(tmp_path, backend, applier, MPS_DEMANDS)
    pipe = str(tmp_path / "mps/gpu0")
    assert [(a.kind, a.setting) for a in outcome.actions] == [
        ("start_mps_daemon", None), ("set_mps_default", "set_default_active_thread_percentage 70"),
        ("set_mps_default", "set_default_device_pinned_mem_limit 0 12288M")]
    assert (tmp_path / "mps/gpu0").is_dir() and (tmp_path / "log/gpu0").is_dir()
    assert outcome.plan.replica("a/0").env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert run(tmp_path, backend, applier, MPS_DEMANDS).actions == []
    bigger = [MPS_DEMANDS[0], demand("b", 0, "mps", 12, sm_percent=60)]
    assert [a.setting for a in run(tmp_path, backend, applier, bigger).actions] == [
        "set_default_active_thread_percentage 60"]
    runner.commands.clear()
    stopped = run(tmp_path, backend, applier, [demand("a", 0, "timeslice", 10)])
    assert stopped.actions == [Action("stop_mps_daemon", 0, uuid=backend.snapshot().devices[0].uuid,
                                      pipe_directory=pipe)]
    assert runner.commands == [([MPS], {"CUDA_MPS_PIPE_DIRECTORY": pipe}, "quit\n")]
    assert not backend.read_mps().running and AppliedStateFile(tmp_path / "state.json").load().mps_daemons == {}


def test_a_failing_mps_command_names_the_action_and_its_output(tmp_path, world):
    backend, _, applier = world(mig_gpus=(), runner_rc=1)
    with pytest.raises(ApplyError, match=r"nvidia-cuda-mps-control -d: exit status 1: An instance of this daemon"):
        run(tmp_path, backend, applier, MPS_DEMANDS)


def test_dry_run_decides_everything_and_executes_nothing(tmp_path, world):
    backend, runner, applier = world(mig_gpus=())
    outcome = run(tmp_path, backend, applier, MPS_DEMANDS, dry_run=True)
    assert [a.kind for a in outcome.actions] == ["start_mps_daemon", "set_mps_default", "set_mps_default"]
    assert outcome.actions[0].describe().startswith(f"GPU 0: CUDA_VISIBLE_DEVICES={backend.snapshot().devices[0].uuid}")
    assert outcome.actions[1].describe().endswith(f"echo set_default_active_thread_percentage 70 | "
                                                  f"CUDA_MPS_PIPE_DIRECTORY={tmp_path}/mps/gpu0 {MPS}")
    assert backend.calls == [] and runner.commands == [] and not (tmp_path / "state.json").exists()


def test_gpus_the_config_does_not_name_are_left_alone(tmp_path, world):
    backend, _, applier = world()
    outcome = run(tmp_path, backend, applier, [demand("a", 0, "timeslice", 1.0, device="cpu")], gpus=())
    assert outcome.actions == [] and backend.calls == []
    assert outcome.plan.device("gpu0").managed is False and GIB  # the GPU stays listed, untouched
