"""The plan per node for Ray replicas (model_pool/ray_plan.py) against a stand-in cluster: two nodes with one H200
each (read through the cluster, once per node) and a CPU-only node. What the registry store is told, what each
planned replica is launched with, and what happens when a node leaves."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from model_pool.ray_launcher import RayUnavailable
from model_pool.ray_plan import NO_ARBITER, PLAN_FIELD, RayPlacer
from partitioner.devices.inventory import Inventory
from partitioner.planning.demand import DEFAULT_OVERHEAD_BYTES, ModelShape
from registry.fields import GIB
from registry.launch import ReplicaPlacement, replica_launch
from registry.schema import Registry
from tests.partitioner.conftest import gpus

NODE_A, NODE_B, NODE_C = "aa" * 28, "bb" * 28, "cc" * 28
CPU = Inventory(devices=(), source="cpu", note="no NVML (test)")


def h200(node: str) -> Inventory:
    inventory = gpus("h200-141gb")
    return replace(inventory, devices=(replace(inventory.devices[0], uuid=f"GPU-{node}-h200"),))


class Cluster:
    """Alive nodes as `ray.nodes()` reports them, and each node's inventory as the task on it would read it."""

    def __init__(self) -> None:
        self.alive = {NODE_A: ("10.0.0.1", {"CPU": 16.0, "GPU": 1.0, "node_a": 1.0}, h200("a")),
                      NODE_B: ("10.0.0.2", {"CPU": 16.0, "GPU": 1.0, "node_b": 1.0}, h200("b")),
                      NODE_C: ("10.0.0.3", {"CPU": 8.0}, CPU)}
        self.reads: list[str] = []
        self.node_calls = 0

    def nodes(self) -> list[dict[str, Any]]:
        self.node_calls += 1
        return [{"NodeID": node_id, "Alive": True, "NodeManagerAddress": address, "Resources": resources}
                for node_id, (address, resources, _) in self.alive.items()]

    def read_inventory(self, node_id: str) -> Inventory:
        self.reads.append(node_id)
        return self.alive[node_id][2]


SHAPE = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, weights_bytes=90 * GIB)  # + 1 GiB KV + overhead: 92 GiB


def registry(**models: dict) -> Registry:
    return Registry.model_validate({"models": [
        {"name": name, "type": "chat", "source": {"path": f"/m/{name}.gguf"}, "launcher": "ray", **fields}
        for name, fields in models.items()]})


def big(replicas: int, **fields: Any) -> dict:
    return {"device": "cuda", "replicas": replicas, "engine": {"kv_cache_gib": 1}, **fields}


def placer_for(reg: Registry, cluster: Cluster) -> RayPlacer:
    current = {"registry": reg}
    placer = RayPlacer(lambda: current["registry"], cluster, shapes={"big": SHAPE})
    placer.current = current  # type: ignore[attr-defined]  # tests swap the registry through it
    return placer


def test_each_planned_replica_is_launched_on_its_node_with_that_nodes_device():
    cluster = Cluster()
    reg = registry(big=big(2))
    placer = placer_for(reg, cluster)
    assert placer.problems(reg) == []
    placed = [placer.node_placement(replica_launch(reg.models[0], r)) for r in range(2)]
    memory = 90 * GIB + GIB + DEFAULT_OVERHEAD_BYTES
    assert [(p.node_id, p.address) for p in placed if p is not None] == [(NODE_A, "10.0.0.1"), (NODE_B, "10.0.0.2")]
    assert placed[1] is not None and placed[1].placement == ReplicaPlacement(
        env={"CUDA_VISIBLE_DEVICES": "GPU-b-h200"}, kv_cache_bytes=GIB,
        memory_fraction=memory / h200("b").devices[0].memory_total_bytes)
    assert sorted(cluster.reads) == sorted([NODE_A, NODE_B, NODE_C])  # each node read once, for every plan since


def test_a_plan_no_node_can_satisfy_is_a_problem_naming_the_nodes_and_the_shortfall():
    cluster = Cluster()
    reg = registry(big=big(3))
    [problem] = placer_for(reg, cluster).problems(reg)
    assert problem.field == PLAN_FIELD
    assert problem.message.startswith("big/2 (timeslice, device cuda, needs 92.00 GiB) fits no node of the cluster: "
                                      "node 10.0.0.1 (aaaaaaaaaaaa): big/2 (timeslice, needs 92.00 GiB) does not fit")
    assert "node 10.0.0.2 (bbbbbbbbbbbb)" in problem.message and "short by 50.62 GiB" in problem.message
    assert "node 10.0.0.3 (cccccccccccc): big/2: needs a GPU (device: cuda), but the inventory has none" \
        in problem.message


def test_a_models_ray_resources_narrow_its_nodes():
    cluster = Cluster()
    reg = registry(big=big(1, ray={"resources": {"node_b": 1}}))
    placer = placer_for(reg, cluster)
    placed = placer.node_placement(replica_launch(reg.models[0], 0))
    assert placed is not None and placed.node_id == NODE_B
    reg = registry(big=big(2, ray={"resources": {"node_b": 1}}))
    [problem] = placer.problems(reg)
    assert ("node 10.0.0.1 (aaaaaaaaaaaa): its Ray resources (CPU 16, GPU 1, node_a 1) do not hold 'big''s ray: ask "
            "(CPU 1, node_b 1)") in problem.message


def test_time_slicing_between_ray_replicas_is_refused_naming_the_model_field_when_no_node_avoids_it():
    cluster = Cluster()
    del cluster.alive[NODE_A], cluster.alive[NODE_B]
    one = registry(tiny={"device": "cpu", "placement": {"isolation": "timeslice"}})
    placer = placer_for(one, cluster)
    assert placer.problems(one) == []
    placed = placer.node_placement(replica_launch(one.models[0], 0))
    assert placed is not None and (placed.node_id, placed.placement) == (
        NODE_C, ReplicaPlacement(env={"CUDA_VISIBLE_DEVICES": ""}))
    two = registry(tiny={"device": "cpu", "replicas": 2, "placement": {"isolation": "timeslice"}})
    [problem] = placer.problems(two)
    assert problem.message == (
        "tiny/1 (timeslice, device cpu) fits no node of the cluster: node 10.0.0.3 (cccccccccccc): "
        f"it would time-slice cpu between tiny/0, tiny/1 (models[0].placement.isolation: 'timeslice'), which needs "
        f"an arbiter on that node: {NO_ARBITER}")
    # a model that says nothing about placement is Ray's to place, and not planned at all
    assert placer.problems(registry(tiny={"device": "cpu", "replicas": 2})) == []


def test_models_the_plan_does_not_place_never_touch_the_cluster():
    cluster = Cluster()
    reg = registry(free={"device": "cpu", "replicas": 2, "ray": {"num_gpus": 1}})
    placer = placer_for(reg, cluster)
    assert placer.problems(reg) == []
    assert placer.node_placement(replica_launch(reg.models[0], 0)) is None
    assert (cluster.node_calls, cluster.reads) == (0, [])


def test_a_node_that_leaves_moves_only_its_replicas_and_one_that_no_longer_fits_fails_its_start_alone():
    cluster = Cluster()
    reg = registry(big=big(1), small=big(2))
    placer = RayPlacer(lambda: reg, cluster, shapes={
        "big": SHAPE, "small": replace(SHAPE, weights_bytes=20 * GIB)})  # 22 GiB each

    def node_of(model: int, index: int) -> str:
        placed = placer.node_placement(replica_launch(reg.models[model], index))
        assert placed is not None
        return placed.node_id

    assert [node_of(0, 0), node_of(1, 0), node_of(1, 1)] == [NODE_A, NODE_A, NODE_B]
    del cluster.alive[NODE_A]  # big/0 and small/0 must move; small/1 keeps node b, where it runs
    assert node_of(0, 0) == NODE_B and node_of(1, 1) == NODE_B
    with pytest.raises(RayUnavailable) as failed:  # 92 + 2 x 22 GiB exceed one H200: the last one waits
        node_of(1, 0)
    assert str(failed.value).startswith("small/0: the cluster has no place for it now: small/0 (timeslice, device "
                                        "cuda, needs 22.00 GiB) fits no node of the cluster: node 10.0.0.2")
    assert "short by 2.62 GiB" in str(failed.value)
    [problem] = placer.problems(reg)  # and an edit now would be refused for it
    assert problem.message.startswith("small/0 (timeslice, device cuda, needs 22.00 GiB) fits no node")


def test_an_unreachable_cluster_is_a_problem_of_the_address():
    class Unreachable(Cluster):
        def nodes(self) -> list[dict[str, Any]]:
            raise RayUnavailable("cannot connect to the Ray cluster at 'h:6379': refused")

    reg = registry(big=big(1))
    assert [tuple(p) for p in placer_for(reg, Unreachable()).problems(reg)] == [
        ("gateway.ray.address", "cannot connect to the Ray cluster at 'h:6379': refused")]


def test_a_ray_model_written_with_an_mps_placement_gets_its_share_on_the_node_whose_daemon_runs():
    """From the registry file on: the schema takes `placement:` for a Ray model, and the plan puts its replicas
    under the MPS daemon of the node that has one (node B), each with its thread percentage and memory limit."""
    cluster = Cluster()
    pipe = "/tmp/multiserve-mps/gpu0"
    address, resources, inventory = cluster.alive[NODE_B]
    cluster.alive[NODE_B] = (address, resources, replace(inventory, mps=replace(inventory.mps, control_pids=(42,),
                                                                                pipe_directories=(pipe,))))
    reg = registry(chat={"device": "cuda", "replicas": 2, "engine": {"kv_cache_gib": 1},
                         "placement": {"isolation": "mps", "memory_gib": 20, "sm_percent": 40}})
    placer = placer_for(reg, cluster)
    assert placer.problems(reg) == []
    for r in range(2):
        placed = placer.node_placement(replica_launch(reg.models[0], r))
        assert placed is not None and placed.node_id == NODE_B
        assert placed.placement.env == {"CUDA_VISIBLE_DEVICES": "GPU-b-h200", "CUDA_MPS_PIPE_DIRECTORY": pipe,
                                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
                                        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M"}


def test_a_scaled_down_replica_is_forgotten():
    """The placer remembers where each replica runs, to keep it there (`previous`); a replica a scale-down removed is
    forgotten at the next plan, so the record does not grow with every scale-up and -down."""
    cluster = Cluster()
    placer = placer_for(registry(big=big(2)), cluster)

    def node_of(index: int) -> str:
        reg = placer.current["registry"]  # type: ignore[attr-defined]
        placed = placer.node_placement(replica_launch(reg.models[0], index))
        assert placed is not None
        return placed.node_id

    assert [node_of(0), node_of(1)] == [NODE_A, NODE_B]
    placer.current["registry"] = registry(big=big(1))  # type: ignore[attr-defined]
    assert node_of(0) == NODE_A and placer._running_on == {"big/0": NODE_A}
