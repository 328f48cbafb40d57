"""The registry check for `launcher: ray` models, against a stand-in cluster (the real one: tests/e2e/test_ray_e2e.py):
an unreachable cluster, or resources no node has, are refused naming the field; what fits passes. And what the
launcher asks of Ray: a planned replica's actor pinned to its node, its worker given that node's plan entry, and
listening on its node's loopback unless `worker_host` says otherwise."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray import exceptions as ray_exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from model_pool.ray_launcher import (
    RayCluster,
    RayHandle,
    RayLauncher,
    RayUnavailable,
    WorkerUnreachable,
    ray_problems,
    worker_address,
)
from model_pool.ray_plan import RayPlacer
from partitioner.devices.inventory import Inventory
from registry.launch import ReplicaLaunch, replica_launch
from registry.schema import RayConnection, Registry
from registry.store import parse_registry
from tests.model_pool.test_ray_plan import NODE_B as PLAN_NODE_B
from tests.model_pool.test_ray_plan import SHAPE
from tests.model_pool.test_ray_plan import Cluster as PlanCluster
from tests.model_pool.test_ray_plan import registry as plan_registry

NODES = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0, "memory": 32.0 * (1 << 30),
                                                                          "node:10.0.0.1": 1.0}},
         {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 4.0, "GPU": 1.0, "a100": 1.0}},
         {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 64.0, "GPU": 8.0}}]


class Cluster:
    def __init__(self, nodes: list[dict[str, Any]] | None = None, error: str | None = None) -> None:
        self._nodes, self.error = nodes, error

    def nodes(self) -> list[dict[str, Any]]:
        if self.error is not None:
            raise RayUnavailable(self.error)
        return [n for n in self._nodes or [] if n["Alive"]]


def registry(ray: str, launcher: str = "ray") -> Any:
    head = "gateway: {model_roots: [/]}\nmodels:\n"
    if launcher == "ray":
        return parse_registry(f"{head}  - {{name: m, type: chat, source: {{path: /m}}, launcher: ray, ray: {ray}}}\n",
                              "r.yaml")
    return parse_registry(f"{head}  - {{name: m, type: chat, source: {{path: /m}}}}\n", "r.yaml")


def test_resources_some_alive_node_has_pass():
    for ray in ("{num_cpus: 8, memory_gib: 16}", "{num_gpus: 0.5, resources: {a100: 1}}", "{}"):
        assert ray_problems(registry(ray), Cluster(NODES)) == []  # type: ignore[arg-type]


def test_resources_no_alive_node_has_are_refused_naming_what_each_node_has():
    [problem] = ray_problems(registry("{num_gpus: 2}"), Cluster(NODES))  # type: ignore[arg-type]
    assert problem.field == "models[0].ray"
    assert problem.message.startswith("no node of the Ray cluster has CPU 1, GPU 2 for one replica of 'm'; nodes: "
                                      "10.0.0.1: CPU 8, memory 32.0 GiB; 10.0.0.2: CPU 4, GPU 1, a100 1")
    # (the dead node's 8 GPUs do not count) and one node must have it all, not the cluster in sum
    assert ray_problems(registry("{num_cpus: 6, num_gpus: 1}"), Cluster(NODES))  # type: ignore[arg-type]


def test_an_unreachable_cluster_is_a_problem_of_the_address_and_no_ray_model_needs_none():
    [problem] = ray_problems(registry("{}"), Cluster(error="cannot connect to the Ray cluster at 'h:6379': refused")
                             )  # type: ignore[arg-type]
    assert (problem.field, problem.message) == ("gateway.ray.address",
                                              "cannot connect to the Ray cluster at 'h:6379': refused")
    assert ray_problems(registry("", launcher="local"), Cluster(error="unused")) == []  # type: ignore[arg-type]


class _Method:
    """An actor method as Ray's handle offers it: `.remote(...)` gives an awaitable of its result."""

    def __init__(self, result: Any) -> None:
        self.result, self.calls = result, []  # type: ignore[var-annotated]

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        self.calls.append(args)
        future = asyncio.get_running_loop().create_future()
        if self.result is not None:  # None: never resolves (a worker that keeps running)
            future.set_result(self.result)
        return future


GATEWAY_HOST = "10.0.0.1"  # the gateway's host, a node of the cluster


class _Actor:
    def __init__(self, options: dict[str, Any], node_address: str) -> None:
        self.options = options
        self.node_address, self.start, self.wait = _Method(node_address), _Method((9999, 4321)), _Method(None)


class LaunchCluster(RayCluster):
    """The launcher's side of Ray: actors are recorded with the options they were created with, and never run (each
    on a node at `node_address`); nodes and their inventories are the stand-in cluster's of test_ray_plan."""

    def __init__(self, worker_host: str | None = "127.0.0.1", node_address: str = GATEWAY_HOST) -> None:
        super().__init__(RayConnection(worker_host=worker_host))
        self.stand_in = PlanCluster()
        self.actors: list[_Actor] = []
        self.node_address = node_address
        self.killed: list[_Actor] = []

    def ray(self) -> Any:
        # installed, never connected: the handle only needs its exception types
        return SimpleNamespace(exceptions=ray_exceptions, kill=self.killed.append)

    def gateway_address(self) -> str:
        return GATEWAY_HOST

    def actor_class(self) -> Any:
        cluster = self

        class Options:
            def __init__(self, options: dict[str, Any]) -> None:
                self.options = options

            def remote(self) -> _Actor:
                cluster.actors.append(_Actor(self.options, cluster.node_address))
                return cluster.actors[-1]

        class ActorClass:
            @staticmethod
            def options(**options: Any) -> Options:
                return Options(options)

        return ActorClass

    def nodes(self) -> list[dict[str, Any]]:
        return self.stand_in.nodes()

    def read_inventory(self, node_id: str) -> Inventory:
        return self.stand_in.read_inventory(node_id)


def _start(reg: Registry, index: int, cluster: LaunchCluster | None = None) -> tuple[LaunchCluster, RayHandle]:
    cluster = cluster or LaunchCluster()
    launcher = RayLauncher(cluster, RayPlacer(lambda: reg, cluster, shapes={"big": SHAPE}))

    async def start() -> RayHandle:
        handle = await launcher.start(replica_launch(reg.models[0], index))
        assert handle._watch is not None
        handle._watch.cancel()
        return handle

    return cluster, asyncio.run(start())


def test_a_planned_replica_is_pinned_to_its_node_and_its_worker_gets_that_nodes_plan_entry():
    reg = plan_registry(big={"device": "cuda", "replicas": 2, "engine": {"kv_cache_gib": 1},
                             "ray": {"num_cpus": 2, "num_gpus": 1}})
    cluster, handle = _start(reg, 1)
    [actor] = cluster.actors
    strategy = actor.options.pop("scheduling_strategy")
    assert isinstance(strategy, NodeAffinitySchedulingStrategy)
    assert (strategy.node_id, strategy.soft) == (PLAN_NODE_B, False)  # its node, never another
    assert actor.options == {"num_cpus": 2, "num_gpus": 1}  # and the model's ray: ask as before
    [(launch_json, _token, host, env)] = actor.start.calls
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-b-h200"}  # the worker's environment: node b's GPU
    placement = ReplicaLaunch.model_validate_json(launch_json).placement
    assert placement.env == env and placement.kv_cache_bytes == 1 << 30 and placement.memory_fraction is not None
    assert (handle.node_id, handle.base_url, host) == (PLAN_NODE_B, "http://127.0.0.1:9999", "127.0.0.1")


def test_a_replica_the_plan_does_not_place_is_left_to_ray():
    cluster, handle = _start(plan_registry(free={"device": "cpu", "ray": {"num_cpus": 0.5}}), 0)
    [actor] = cluster.actors
    assert actor.options == {"num_cpus": 0.5, "num_gpus": 0.0}
    [(_launch, _token, _host, env)] = actor.start.calls
    assert env == {} and handle.node_id is None
    assert (cluster.stand_in.node_calls, cluster.stand_in.reads) == (0, [])


def _free(cluster: LaunchCluster) -> tuple[LaunchCluster, RayHandle]:
    return _start(plan_registry(free={"device": "cpu", "ray": {"num_cpus": 0.5}}), 0, cluster)


def test_an_unset_worker_host_listens_on_loopback_on_the_gateways_host():
    cluster, handle = _free(LaunchCluster(worker_host=None))
    [(_launch, _token, host, _env)] = cluster.actors[0].start.calls
    assert host == "127.0.0.1" and handle.base_url == "http://127.0.0.1:9999"
    assert handle.node == GATEWAY_HOST  # the node it runs on, as logs show it


def test_an_unset_worker_host_on_another_host_fails_the_start_naming_the_setting():
    cluster = LaunchCluster(worker_host=None, node_address="10.0.0.2")
    with pytest.raises(WorkerUnreachable) as err:
        _free(cluster)
    message = str(err.value)
    assert message.startswith("free/0: Ray placed it on node 10.0.0.2, another host than the gateway's (10.0.0.1)")
    assert "gateway.ray.worker_host is unset" in message and "set gateway.ray.worker_host: node" in message
    [actor] = cluster.actors
    assert actor.start.calls == [] and cluster.killed == [actor]  # no worker started; its actor let go


def test_worker_host_node_listens_on_each_nodes_address():
    cluster, handle = _free(LaunchCluster(worker_host="node", node_address="10.0.0.2"))
    [(_launch, _token, host, _env)] = cluster.actors[0].start.calls
    assert (host, handle.base_url) == ("10.0.0.2", "http://10.0.0.2:9999")


@pytest.mark.parametrize("worker_host, node, listens, dialled", [
    (None, "10.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("127.0.0.1", "10.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("node", "10.0.0.2", "10.0.0.2", "10.0.0.2"),
    ("0.0.0.0", "10.0.0.2", "0.0.0.0", "10.0.0.2"),  # every interface, dialled at the node's address
    ("10.0.0.2", "10.0.0.2", "10.0.0.2", "10.0.0.2"),  # an address of one node, as written
])
def test_worker_address(worker_host, node, listens, dialled):
    assert worker_address(worker_host, node, "10.0.0.1") == (listens, dialled)


@pytest.mark.parametrize("worker_host", [None, "127.0.0.1", "localhost", "::1"])
def test_a_loopback_worker_on_another_host_is_unreachable(worker_host):
    with pytest.raises(WorkerUnreachable, match=r"node 10\.0\.0\.2, another host than the gateway's"):
        worker_address(worker_host, "10.0.0.2", "10.0.0.1")
