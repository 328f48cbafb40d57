"""The plan across nodes (partitioner/planning/cluster.py) on fake inventories from the shipped tables: two nodes with
one H200 each and a CPU-only node. Replicas go to the first node whose own plan takes them (largest first), get
that node's devices in their env, and a replica no node takes is refused naming every node and its shortfall."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from partitioner.devices.fake_backend import FakeBackend
from partitioner.devices.inventory import Inventory
from partitioner.planning.cluster import (
    ClusterNode,
    ClusterPlan,
    cluster_demands,
    plan_cluster,
    read_node_inventories,
    refuse_time_slicing,
    unapplied_changes,
)
from partitioner.planning.demand import DEFAULT_OVERHEAD_BYTES, ModelShape, ReplicaDemand
from partitioner.planning.plan import InfeasiblePlan
from registry.fields import GIB
from registry.schema import Registry
from tests.partitioner.conftest import demand, gpus

CPU = Inventory(devices=(), source="cpu", note="no NVML (test)")


def h200(node: str, mig_mode: bool = False) -> Inventory:
    """One idle H200 whose UUID says which node it is on."""
    inventory = gpus("h200-141gb", mig_mode=mig_mode)
    device = inventory.devices[0]
    return replace(inventory, devices=(replace(device, uuid=f"GPU-{node}-h200"),))


NODE_A = ClusterNode("aaaa0000111122223333", "10.0.0.1", h200("a"))
NODE_B = ClusterNode("bbbb0000111122223333", "10.0.0.2", h200("b"))
NODE_C = ClusterNode("cccc0000111122223333", "10.0.0.3", CPU)
NODES = [NODE_C, NODE_B, NODE_A]  # given in any order: the plan orders them
USABLE = int(h200("a").devices[0].memory_total_bytes * 0.95)  # the default headroom of an H200


def env_of(plan: ClusterPlan, replica_id: str) -> tuple[str, dict[str, str]]:
    node, entry = plan.replica(replica_id)
    return node.address, entry.env


def test_replicas_too_big_to_share_a_gpu_go_one_per_gpu_node_each_with_its_nodes_device():
    plan = plan_cluster(NODES, [demand("big", r, gib=100) for r in range(2)])
    assert env_of(plan, "big/0") == ("10.0.0.1", {"CUDA_VISIBLE_DEVICES": "GPU-a-h200"})
    assert env_of(plan, "big/1") == ("10.0.0.2", {"CUDA_VISIBLE_DEVICES": "GPU-b-h200"})
    _, entry = plan.replica("big/1")
    assert entry.memory_fraction == pytest.approx(100 * GIB / h200("b").devices[0].memory_total_bytes)
    assert set(plan.plans) == {NODE_A.node_id, NODE_B.node_id}  # the CPU node has nothing


def test_small_replicas_fill_the_first_node_before_the_next():
    plan = plan_cluster(NODES, [demand("small", r, gib=30) for r in range(4)] + [demand("big", 0, gib=100)])
    # largest first: big takes node a; the small ones fill what is left there (33 GiB: one), then node b
    assert plan.assignment == {"big/0": NODE_A.node_id, "small/0": NODE_A.node_id, "small/1": NODE_B.node_id,
                               "small/2": NODE_B.node_id, "small/3": NODE_B.node_id}


def test_a_replica_no_node_holds_is_refused_naming_each_node_and_by_how_much_it_falls_short():
    with pytest.raises(InfeasiblePlan) as refused:
        plan_cluster(NODES, [demand("big", r, gib=100) for r in range(3)])
    [problem] = refused.value.problems
    free = (USABLE - 100 * GIB) / GIB
    short = 100 - free
    assert problem.startswith("big/2 (timeslice, device auto, needs 100.00 GiB) fits no node of the cluster: ")
    assert (f"node 10.0.0.1 (aaaa00001111): big/2 (timeslice, needs 100.00 GiB) does not fit: GPU 0 (NVIDIA H200): "
            f"{free:.2f} GiB free of {USABLE / GIB:.2f} GiB usable (1 replica(s) planned, 0.00 GiB used by other "
            f"processes): short by {short:.2f} GiB") in problem
    assert "node 10.0.0.2 (bbbb00001111): big/2" in problem and f"short by {short:.2f} GiB" in problem
    # device auto means a GPU while the cluster has one, as it does on one host: the CPU node does not take it
    assert "node 10.0.0.3 (cccc00001111): a CPU-only node, and device 'auto' runs on a GPU" in problem


def test_cpu_replicas_go_to_the_cpu_node_first_and_gpu_nodes_take_them_after_it():
    plan = plan_cluster(NODES, [demand("cpu-model", 0, gib=None, device="cpu")])
    assert env_of(plan, "cpu-model/0") == ("10.0.0.3", {"CUDA_VISIBLE_DEVICES": ""})
    assert plan.replica("cpu-model/0")[1].device_key == "cpu"
    plan = plan_cluster([NODE_A], [demand("cpu-model", 0, gib=None, device="cpu")])
    assert env_of(plan, "cpu-model/0") == ("10.0.0.1", {"CUDA_VISIBLE_DEVICES": ""})


def test_a_gpu_replica_on_a_cluster_without_gpus_is_refused_naming_the_node():
    with pytest.raises(InfeasiblePlan) as refused:
        plan_cluster([NODE_C], [demand("gpu-model", 0, gib=10, device="cuda")])
    assert refused.value.problems == (
        "gpu-model/0 (timeslice, device cuda, needs 10.00 GiB) fits no node of the cluster: node 10.0.0.3 "
        "(cccc00001111): gpu-model/0: needs a GPU (device: cuda), but the inventory has none (cpu: no NVML (test))",)
    # on a cluster of CPU nodes only, device auto runs on a CPU, as on a host without a GPU
    assert env_of(plan_cluster([NODE_C], [demand("auto-model", 0, gib=10)]), "auto-model/0")[0] == "10.0.0.3"


def mig_node(node_id: str, address: str, existing: tuple[str, ...] = ()) -> ClusterNode:
    """An H200 node with MIG mode on and the MIG devices `existing` made at slot 0, 4, ..."""
    backend = FakeBackend(h200(address, mig_mode=True))
    for i, profile in enumerate(existing):
        backend.create_mig_device(0, profile, 4 * i)
    return ClusterNode(node_id, address, backend.snapshot())


def test_a_node_whose_plan_needs_device_changes_is_passed_over_for_one_where_they_exist():
    node_b = mig_node(NODE_B.node_id, "10.0.0.2", existing=("3g.71gb",))
    mig = [demand("sliced", 0, isolation="mig", gib=40)]
    # without the refusal node a (MIG off) comes first: it would need MIG enabled and a device created
    assert plan_cluster([NODE_A, node_b], mig).assignment == {"sliced/0": NODE_A.node_id}
    plan = plan_cluster([NODE_A, node_b], mig, refusals=(unapplied_changes,))
    existing = node_b.inventory.devices[0].mig_devices[0].uuid
    assert env_of(plan, "sliced/0") == ("10.0.0.2", {"CUDA_VISIBLE_DEVICES": existing})
    assert plan.plans[node_b.node_id].actions() == ()
    with pytest.raises(InfeasiblePlan) as refused:  # a second one: node b's only device is taken
        plan_cluster([NODE_A, node_b], [*mig, demand("sliced", 1, isolation="mig", gib=40)],
                     refusals=(unapplied_changes,))
    [problem] = refused.value.problems
    assert "node 10.0.0.1 (aaaa00001111): its devices need 2 change(s) before the replicas can start isolated " \
           "there: enable MIG mode on GPU 0" in problem
    assert "node 10.0.0.2 (bbbb00001111): its devices need 1 change(s)" in problem
    assert "create MIG device 3g.71gb at slot 4 on GPU 0 (make them on that node first)" in problem


def test_mps_replicas_go_to_the_node_whose_mps_daemon_runs_and_get_its_pipe():
    pipe = "/tmp/multiserve-mps/gpu0"
    node_b = replace(NODE_B, inventory=replace(NODE_B.inventory, mps=replace(NODE_B.inventory.mps,
                                                                             pipe_directories=(pipe,))))
    demands = [demand("chat", r, isolation="mps", gib=30, sm_percent=40) for r in range(2)]
    plan = plan_cluster([NODE_A, node_b], demands, refusals=(unapplied_changes,))
    for r in range(2):
        address, env = env_of(plan, f"chat/{r}")
        assert address == "10.0.0.2"
        assert env == {"CUDA_VISIBLE_DEVICES": "GPU-b-h200", "CUDA_MPS_PIPE_DIRECTORY": pipe,
                       "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=30720M"}


def test_the_replicas_of_one_shared_mig_instance_go_to_one_node():
    nodes = [mig_node(NODE_A.node_id, "10.0.0.1", existing=("4g.71gb",)), mig_node(NODE_B.node_id, "10.0.0.2")]
    demands = [demand("big", 0, isolation="mig", gib=60),
               *(demand("pair", r, isolation="mps", gib=15, sm_percent=50, mig_instance="shared") for r in range(2))]
    plan = plan_cluster(nodes, demands)
    # the pair (30 GiB together) is placed as one, after big (60 GiB), which takes node a's existing device
    assert plan.assignment["big/0"] == NODE_A.node_id
    assert plan.assignment["pair/0"] == plan.assignment["pair/1"]
    assert plan.replica("pair/0")[1].device_key == plan.replica("pair/1")[1].device_key


def test_a_re_plan_keeps_each_replica_on_the_node_it_runs_on_while_that_node_takes_it():
    demands = [demand("m", r, gib=10) for r in range(2)]
    assert set(plan_cluster(NODES, demands).assignment.values()) == {NODE_A.node_id}
    plan = plan_cluster(NODES, demands, previous={"m/1": NODE_B.node_id})
    assert plan.assignment == {"m/0": NODE_A.node_id, "m/1": NODE_B.node_id}


def test_a_node_the_replica_may_not_use_is_skipped_and_named_with_its_reason():
    def eligible(d: ReplicaDemand, node: ClusterNode) -> str | None:
        return None if node.node_id == NODE_B.node_id else "lacks the label node_b"

    assert plan_cluster(NODES, [demand("m", 0, gib=10)], eligible=eligible).assignment == {"m/0": NODE_B.node_id}
    with pytest.raises(InfeasiblePlan, match=re.escape("node 10.0.0.1 (aaaa00001111): lacks the label node_b")):
        plan_cluster(NODES, [demand("m", 0, gib=200)], eligible=eligible)


def test_time_slicing_that_needs_an_arbiter_spreads_over_nodes_and_is_refused_naming_the_field_when_it_cannot():
    registry = Registry.model_validate({"models": [
        {"name": "chat", "type": "chat", "source": {"path": "/m"}, "placement": {"isolation": "timeslice"}},
        {"name": "plain", "type": "chat", "source": {"path": "/m"}}]})  # no `placement:`: no arbiter asked
    refusal = refuse_time_slicing(registry, "no arbiter here")
    cpu_nodes = [NODE_C, ClusterNode("dddd0000111122223333", "10.0.0.4", CPU)]
    demands = [demand("chat", r, gib=None, device="cpu") for r in range(2)]
    plan = plan_cluster(cpu_nodes, demands, refusals=(refusal,))
    assert plan.assignment == {"chat/0": NODE_C.node_id, "chat/1": "dddd0000111122223333"}
    with pytest.raises(InfeasiblePlan) as refused:
        plan_cluster([NODE_C], demands, refusals=(refusal,))
    assert refused.value.problems == (
        "chat/1 (timeslice, device cpu) fits no node of the cluster: node 10.0.0.3 (cccc00001111): "
        "it would time-slice cpu between chat/0, chat/1 (models[0].placement.isolation: 'timeslice'), which needs "
        "an arbiter on that node: no arbiter here",)
    # replicas of models that do not ask for time-slicing in the registry share a device with no arbiter
    assert plan_cluster([NODE_C], [demand("plain", r, gib=None, device="cpu") for r in range(2)],
                        refusals=(refusal,)).assignment == {"plain/0": NODE_C.node_id, "plain/1": NODE_C.node_id}


def test_inventories_are_read_once_per_node_and_a_node_that_cannot_be_read_is_left_out_and_named():
    reads = []

    def read_one(node_id: str) -> Inventory:
        reads.append(node_id)
        if node_id == "dead":
            raise RuntimeError("the node died")
        return h200("b")

    nodes, unread = read_node_inventories([("known", "10.0.0.1"), ("fresh", "10.0.0.2"), ("dead", "10.0.0.9")],
                                          read_one, known={"known": h200("a")})
    assert reads == ["fresh", "dead"]
    assert [(n.node_id, n.inventory.devices[0].uuid) for n in nodes] == [("known", "GPU-a-h200"),
                                                                           ("fresh", "GPU-b-h200")]
    assert unread == {"node 10.0.0.9 (dead)": "its inventory could not be read: the node died"}
    with pytest.raises(InfeasiblePlan, match=re.escape("node 10.0.0.9 (dead): its inventory could not be read")):
        plan_cluster(nodes, [demand("m", 0, gib=200)], unread=unread)


def test_demands_are_made_for_ray_models_that_write_placement_or_target_a_gpu_only():
    registry = Registry.model_validate({"models": [
        {"name": name, "type": "chat", "source": {"path": f"/m/{name}.gguf"}, **fields} for name, fields in {
            "placed": {"launcher": "ray", "device": "cpu", "replicas": 2, "placement": {"isolation": "timeslice"}},
            "on-gpu": {"launcher": "ray", "device": "cuda", "engine": {"kv_cache_gib": 1}},
            "ray-chooses": {"launcher": "ray", "ray": {"num_gpus": 1}},
            "local": {"device": "cpu", "placement": {"weight": 2}},
            "off": {"launcher": "ray", "device": "cuda", "enabled": False}}.items()]})
    shapes = {"on-gpu": ModelShape(num_layers=16, num_kv_heads=8, head_dim=64, weights_bytes=4 * GIB)}
    demands = {d.replica_id: d for d in cluster_demands(registry, shapes)}
    assert sorted(demands) == ["on-gpu/0", "placed/0", "placed/1"]
    assert demands["on-gpu/0"].memory_bytes == 4 * GIB + GIB + DEFAULT_OVERHEAD_BYTES
    assert demands["on-gpu/0"].device == "cuda" and demands["placed/1"].device == "cpu"
