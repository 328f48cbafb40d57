"""The planner on fake inventories built from the shipped MIG tables: MIG packing, MPS shares, time-slice
weights, exclusive GPUs, memory admission next to other processes, and what an infeasible plan says."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from partitioner.devices.fake_backend import FakeBackend
from partitioner.devices.inventory import DeviceProcess, Inventory, MpsStatus
from partitioner.planning.placement import PlanOptions
from partitioner.planning.plan import InfeasiblePlan, PlanAction
from partitioner.planning.planner import plan
from registry.fields import GIB, MIB
from tests.partitioner.conftest import demand, gpus


def infeasible(inventory, demands, options=None) -> str:
    with pytest.raises(InfeasiblePlan) as exc:
        plan(inventory, demands, options)
    return str(exc.value)


def test_mig_packs_an_h100_smallest_profile_first():
    demands = [demand("big", 0, "mig", 30), demand("sm", 0, "mig", 15, sm_percent=20),
               demand("small", 0, "mig", 8), demand("small", 1, "mig", 8)]
    result = plan(gpus("h100-80gb"), demands)
    gpu = result.device("gpu0")
    assert gpu.mode == "mig" and gpu.enable_mig
    assert [(m.profile, m.start, m.replica_id) for m in gpu.mig_devices] == [
        ("2g.20gb", 0, "sm/0"), ("1g.10gb", 2, "small/0"), ("1g.10gb", 3, "small/1"), ("3g.40gb", 4, "big/0")]
    big = result.replica("big/0")
    assert big.env == {"CUDA_VISIBLE_DEVICES": "pending-mig:3g.40gb@4"} and big.gpu_index == 0
    assert big.memory_fraction == pytest.approx(30 / 39.5) and big.sm_percent == 45  # 60 of 132 SMs
    assert result.actions() == (PlanAction("enable_mig", 0),
                                PlanAction("create_mig_device", 0, profile="2g.20gb", start=0),
                                PlanAction("create_mig_device", 0, profile="1g.10gb", start=2),
                                PlanAction("create_mig_device", 0, profile="1g.10gb", start=3),
                                PlanAction("create_mig_device", 0, profile="3g.40gb", start=4))
    json.dumps(result.to_dict())  # serializable


def test_mig_on_h200_fills_seven_slices_then_says_what_takes_them():
    sevens = [demand("m", r, "mig", 15) for r in range(7)]
    result = plan(gpus("h200-141gb"), sevens)
    assert sorted(m.start for m in result.device("gpu0").mig_devices) == list(range(7))
    assert {m.profile for m in result.device("gpu0").mig_devices} == {"1g.18gb"}
    message = infeasible(gpus("h200-141gb"), [*sevens, demand("m", 7, "mig", 15)])
    assert message.startswith("m/7 (mig, needs 15.00 GiB) does not fit: GPU 0 (NVIDIA H200): no free slots for "
                              "1g.18gb or larger: taken by 1g.18gb for m/0")


def test_h200_3g_and_4g_share_the_gpu():
    same = plan(gpus("h200-141gb"), [demand("a", 0, "mig", 60), demand("b", 0, "mig", 60, sm_percent=45)])
    assert [(m.profile, m.start) for m in same.device("gpu0").mig_devices] == [("3g.71gb", 0), ("3g.71gb", 4)]
    # 48 % of 132 SMs is 64: only 4g gives that, and 4g can only start at slot 0
    result = plan(gpus("h200-141gb"), [demand("a", 0, "mig", 60), demand("b", 0, "mig", 60, sm_percent=48)])
    assert [(m.profile, m.start, m.replica_id) for m in result.device("gpu0").mig_devices] == [
        ("4g.71gb", 0, "b/0"), ("3g.71gb", 4, "a/0")]


def test_a_demand_larger_than_any_profile_says_by_how_much():
    message = infeasible(gpus("h100-80gb"), [demand("huge", 0, "mig", 100)])
    assert "no MIG profile holds 100.00 GiB: the largest, 7g.80gb, gives 75.29 GiB usable (132 SMs): " \
           "short by 24.71 GiB" in message


def test_existing_free_mig_devices_are_reused_and_busy_ones_left_alone():
    fake = FakeBackend(gpus("h100-80gb"))
    fake.set_mig_mode(0, True)
    free = fake.create_mig_device(0, "3g.40gb", 4)
    busy = fake.create_mig_device(0, "3g.40gb", 0)
    fake.add_process(0, pid=500, used_memory_bytes=GIB, device_uuid=busy.uuid)
    inventory = fake.snapshot()
    result = plan(inventory, [demand("a", 0, "mig", 20)])
    assert result.replica("a/0").env["CUDA_VISIBLE_DEVICES"] == free.uuid
    assert result.actions() == ()
    message = infeasible(inventory, [demand("a", 0, "mig", 20), demand("b", 0, "mig", 20)])
    assert "b/0 (mig, needs 20.00 GiB) does not fit" in message and "3g.40gb at slot 0 (existing)" in message
    # the busy device is ours when its process is one of our replicas
    both = plan(inventory, [demand("a", 0, "mig", 20), demand("b", 0, "mig", 20)],
                PlanOptions(own_pids=frozenset({500})))
    assert {r.env["CUDA_VISIBLE_DEVICES"] for r in both.replicas} == {free.uuid, busy.uuid}


def test_mps_shares_sum_to_at_most_100_and_the_rest_is_split():
    result = plan(gpus(), [demand("a", 0, "mps", 10, sm_percent=30), demand("b", 0, "mps", 10),
                           demand("b", 1, "mps", 10)])
    shares = {r.replica_id: r.sm_percent for r in result.replicas}
    assert shares == {"a/0": 30, "b/0": 35, "b/1": 35}
    env = result.replica("a/0").env
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={10 * GIB // MIB}M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/multiserve-mps/gpu0"
    assert env["CUDA_VISIBLE_DEVICES"] == gpus().devices[0].uuid
    assert result.actions() == (PlanAction("start_mps_daemon", 0, pipe_directory="/tmp/multiserve-mps/gpu0"),)
    running = replace(gpus(), mps=MpsStatus(control_pids=(7,), pipe_directories=("/tmp/multiserve-mps/gpu0",)))
    assert plan(running, [demand("a", 0, "mps", 10)]).actions() == ()


def test_mps_refuses_shares_over_100_percent():
    message = infeasible(gpus(), [demand("a", 0, "mps", 1, sm_percent=60), demand("b", 0, "mps", 1, sm_percent=50)])
    assert "b/0 (mps, needs 1.00 GiB, 50 % SMs) does not fit: GPU 0 (NVIDIA H100 80GB HBM3): MPS thread " \
           "percentages would sum to 110 %: over 100 % by 10" in message
    two = plan(gpus(count=2), [demand("a", 0, "mps", 1, sm_percent=60), demand("b", 0, "mps", 1, sm_percent=50)])
    assert {r.device_key for r in two.replicas} == {"gpu0", "gpu1"}


def test_timeslice_shares_by_weight_on_one_gpu():
    result = plan(gpus(count=2), [demand("a", 0, gib=10, weight=3), demand("b", 0, gib=10, weight=1)])
    assert {r.device_key for r in result.replicas} == {"gpu0"}  # packed; gpu1 stays free
    assert result.replica("a/0").weight_share == 0.75 and result.replica("b/0").weight_share == 0.25
    assert result.device("gpu1").mode == "none" and result.actions() == ()


def test_exclusive_takes_a_gpu_alone():
    result = plan(gpus(count=2), [demand("solo", 0, "exclusive", 40), demand("t", 0, gib=1), demand("t", 1, gib=1)])
    assert result.device("gpu0").replica_ids == ("solo/0",) and result.device("gpu0").mode == "exclusive"
    assert result.device("gpu1").replica_ids == ("t/0", "t/1")
    message = infeasible(gpus(), [demand("solo", 0, "exclusive", 4), demand("t", 0, gib=1)])
    assert "t/0 (timeslice, needs 1.00 GiB) does not fit: GPU 0 (NVIDIA H100 80GB HBM3): already planned for " \
           "exclusive with 1 replica(s)" in message


def test_memory_admission_counts_other_processes_memory():
    inventory = gpus(processes={0: [DeviceProcess(pid=900, used_memory_bytes=60 * GIB)]})
    message = infeasible(inventory, [demand("a", 0, gib=20)])
    assert "a/0 (timeslice, needs 20.00 GiB) does not fit: GPU 0 (NVIDIA H100 80GB HBM3): 15.67 GiB free of " \
           "15.67 GiB usable (0 replica(s) planned, 60.00 GiB used by other processes): short by 4.33 GiB" in message
    assert plan(inventory, [demand("a", 0, gib=20)], PlanOptions(own_pids=frozenset({900}))).replicas
    # memory the driver does not attribute to a process still counts, through the GPU's used memory
    fake = FakeBackend(gpus())
    fake.add_process(0, pid=901, used_memory_bytes=60 * GIB, reported=False)
    assert "short by 4.33 GiB" in infeasible(fake.snapshot(), [demand("a", 0, gib=20)])


def test_gpus_the_config_does_not_name_are_never_touched():
    result = plan(gpus(count=2), [demand("a", 0, "mig", 5), demand("b", 0, "mig", 5)], PlanOptions(gpus=(1,)))
    gpu0 = result.device("gpu0")
    assert not gpu0.managed and gpu0.mode == "none" and gpu0.replica_ids == () and gpu0.capacity_bytes is None
    assert result.device("gpu1").replica_ids == ("a/0", "b/0")
    assert result.actions() and all(a.gpu_index == 1 for a in result.actions())
    message = infeasible(gpus(count=2), [demand("a", 0, gib=5), demand("b", 0, "mig", 5)], PlanOptions(gpus=(1,)))
    assert message == ("a/0 (timeslice, needs 5.00 GiB) does not fit: GPU 1 (NVIDIA H100 80GB HBM3): already "
                       "planned for mig with 1 replica(s) (one mode per GPU; mps/timeslice replicas share a MIG GPU "
                       "only inside a MIG instance: set their placement.mig_instance)")  # GPU 0 is not considered


def test_naming_a_gpu_the_inventory_lacks_is_an_error():
    assert infeasible(gpus(count=2), [demand("a", 0)], PlanOptions(gpus=(1, 3))) == (
        "the config names GPU(s) [3], which the inventory (fake:h100-80gb) does not have (it has [0, 1])")


def test_cpu_inventory_time_slices_everything_on_the_cpu():
    cpu = Inventory(devices=(), source="cpu", note="no NVML: library not found")
    result = plan(cpu, [demand("a", 0, "mig", 2, weight=3), demand("b", 0, gib=None)])
    assert [d.key for d in result.devices] == ["cpu"] and result.device("cpu").mode == "timeslice"
    a = result.replica("a/0")
    assert (a.device_key, a.isolation, a.requested_isolation, a.weight_share) == ("cpu", "timeslice", "mig", 0.75)
    assert a.env == {"CUDA_VISIBLE_DEVICES": ""} and "needs a GPU" in a.note
    assert result.notes == ("no NVML: library not found",)
    message = infeasible(cpu, [demand("c", 0, device="cuda")])
    assert message == "c/0: needs a GPU (device: cuda), but the inventory has none (cpu: no NVML: library not found)"


def test_cpu_models_on_a_gpu_host_stay_on_the_cpu():
    result = plan(gpus(), [demand("c", 0, gib=None, device="cpu"), demand("g", 0, gib=2)])
    assert result.replica("c/0").device_key == "cpu" and result.replica("g/0").device_key == "gpu0"


def test_mig_needs_a_mig_gpu_or_a_fallback():
    l4 = replace(gpus(), devices=(replace(gpus().devices[0], name="NVIDIA L4", mig_mode=None, mig_profiles=()),))
    assert "needs a MIG device, but no GPU it may use can do MIG (GPU 0 (NVIDIA L4)); set a fallback" in \
        infeasible(l4, [demand("a", 0, "mig", 4)])
    result = plan(l4, [demand("a", 0, "mig", 4)], PlanOptions(mig_fallback="mps"))
    assert result.replica("a/0").isolation == "mps" and "mps instead of mig" in result.replica("a/0").note


def test_mig_mode_on_refuses_shared_replicas_and_busy_gpus_cannot_switch():
    assert "MIG mode is on (only mig replicas; the planner never turns MIG off)" in \
        infeasible(gpus(mig_mode=True), [demand("a", 0, gib=1)])
    busy = gpus(processes={0: [DeviceProcess(pid=3, used_memory_bytes=GIB)]})
    assert "MIG mode is off and 1 process(es) run on it (enabling MIG needs it idle)" in \
        infeasible(busy, [demand("a", 0, "mig", 1)])


def test_unknown_memory_cannot_be_admitted_to_a_gpu():
    assert "a/0: its memory is unknown" in infeasible(gpus(), [demand("a", 0, gib=None)])


def test_every_problem_is_reported_at_once():
    message = infeasible(gpus(), [demand("a", 0, gib=None), demand("b", 0, gib=500)])
    assert "a/0: its memory is unknown" in message and "b/0 (timeslice, needs 500.00 GiB)" in message
