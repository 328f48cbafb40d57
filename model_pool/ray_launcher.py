"""Replicas on a Ray cluster: each one is a Ray actor that starts the same `multiserve worker` process a local
replica is, on whichever node Ray places it, and reports the worker's URL; the gateway then routes to it like to
any replica (probes, leases, migration), and the pool supervises it the same way: a worker that exits, an actor that
is killed, or a node that dies ends the handle (`exit_code()`), and the pool starts a new actor with its usual
backoff and crash-loop rules, which Ray places on a node that still has the resources.

A replica the partitioner plans on the cluster (`model_pool.ray_plan.RayPlacer`: a model that writes `placement:` or
targets a GPU) is not left to Ray's choice: its actor is pinned to the node of its plan entry (node affinity, not
soft) and its worker gets that node's isolation environment (the GPU or MIG device, the MPS variables, the KV budget
and memory fraction). Each node's inventory is read on that node, by a task pinned there (`read_node_inventory`).

Ray is an optional dependency (`pip install 'multiserve[ray]'`): nothing here imports it until a `launcher: ray`
model is started or checked. What an actor asks of its node is the model's `ray:` section (`RayResources`: CPUs,
fractional GPUs, memory, custom resources such as a node label); Ray itself isolates GPUs (it sets the actor's
CUDA_VISIBLE_DEVICES, which the worker inherits). A registry whose Ray models no node of the cluster could ever
hold, or a cluster that cannot be reached, is refused like any invalid registry (`ray_problems`), so the last good
one keeps serving.

Where a worker listens (`worker_address`): on its node's loopback unless `gateway.ray.worker_host` says otherwise,
so the launch token and the traffic it guards never leave a host unless the operator chose a network for them; a
replica placed on another host than the gateway's then fails its start, naming the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from foundation.http.wire import REPLICA_TOKEN_ENV
from model_pool.launcher import die_with_parent, free_port
from partitioner.devices.inventory import Inventory, inventory_from_dict, inventory_to_dict
from registry.errors import Problem
from registry.fields import GIB
from registry.launch import ReplicaLaunch, ReplicaPlacement
from registry.schema import RayConnection, RayResources, Registry

log = structlog.get_logger(__name__)

ACTOR_LOST = -1  # exit_code() of a replica whose actor died (killed, or its node lost) rather than its worker exiting
LOOPBACK = "127.0.0.1"  # where a worker listens when `gateway.ray.worker_host` is unset
NODE_ADDRESS = "node"  # `worker_host: node`: each worker listens on its node's address, as Ray knows it
ANY_ADDRESS = "0.0.0.0"  # listens on every interface; dialled at its node's address


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached (or runs another Ray version)."""


class WorkerUnreachable(RayUnavailable):
    """A worker would listen where the gateway cannot reach it (loopback, on another host than the gateway's)."""


def worker_address(worker_host: str | None, node_address: str, gateway_address: str) -> tuple[str, str]:
    """Where a Ray replica's worker listens on its node, whose address as Ray knows it is `node_address`, and the
    address the gateway dials it at: `worker_host` (unset: loopback, reachable only from the same host); `node`: the
    node's address; `0.0.0.0`: every interface, dialled at the node's address. WorkerUnreachable for a loopback
    address on another host than the gateway's (`gateway_address`), which the gateway would never reach (or would
    reach a stranger listening on its own loopback)."""
    host = worker_host or LOOPBACK
    if host == NODE_ADDRESS:
        return node_address, node_address
    if host == ANY_ADDRESS:
        return host, node_address
    if _is_loopback(host) and node_address != gateway_address:
        setting = "is unset" if worker_host is None else f"is {worker_host!r}"
        raise WorkerUnreachable(
            f"Ray placed it on node {node_address}, another host than the gateway's ({gateway_address}), but "
            f"gateway.ray.worker_host {setting}, so its worker would listen on {host} there, which the gateway "
            f"cannot reach: set gateway.ray.worker_host: node (each worker listens on its node's address; keep that "
            f"network private, docs/multi-node.md), or keep the model on the gateway's host (a node label in its "
            f"ray.resources)")
    return host, host


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() == "localhost"


class RayCluster:
    """The gateway's connection to one Ray cluster, made on first use (connecting takes seconds) and shared by the
    launcher and the registry check."""

    def __init__(self, connection: RayConnection, address_override: str | None = None) -> None:
        self.connection = connection
        self.address = address_override or connection.address or "auto"
        self._lock = threading.Lock()
        self._actor_class: Any = None
        self._inventory_task: Any = None
        self._gateway_address: str | None = None

    def ray(self) -> Any:
        """The `ray` module, connected; RayUnavailable says why not."""
        try:
            import ray
        except ImportError as err:
            raise RayUnavailable("Ray is not installed where the gateway runs: pip install 'multiserve[ray]'") from err
        with self._lock:
            if not ray.is_initialized():
                try:
                    ray.init(address=self.address, namespace=self.connection.namespace, log_to_driver=False,
                             logging_level=logging.WARNING)
                except Exception as err:  # unreachable, refused, or a version mismatch: Ray says which
                    raise RayUnavailable(f"cannot connect to the Ray cluster at {self.address!r}: {err}") from err
                log.info("ray_connected", address=self.address, ray_version=ray.__version__)
        return ray

    def actor_class(self) -> Any:
        """`ReplicaActor` as a Ray actor class (made once: remote() registers the class with the cluster)."""
        ray = self.ray()
        if self._actor_class is None:
            self._actor_class = ray.remote(max_restarts=0)(ReplicaActor)  # the pool restarts, with its backoff
        return self._actor_class

    def gateway_address(self) -> str:
        """This host's address as Ray knows it (its node's, when the gateway runs on a node of the cluster)."""
        if self._gateway_address is None:
            self._gateway_address = str(self.ray().util.get_node_ip_address())
        return self._gateway_address

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's alive nodes, each with its total resources (`Resources`) and address."""
        return [n for n in self.ray().nodes() if n.get("Alive")]

    @staticmethod
    def node_affinity(node_id: str) -> Any:
        """The scheduling strategy that runs an actor or task on `node_id` only (not soft: never elsewhere). Needs
        Ray installed (`ray()` has said so by then), not connected."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node_id, soft=False)

    def read_inventory(self, node_id: str) -> Inventory:
        """The devices of `node_id`, read there by a task pinned to it (NVML on that node; a CPU inventory without
        it). It asks for no CPU, so it runs even on a node whose CPUs the replicas hold."""
        ray = self.ray()
        with self._lock:
            if self._inventory_task is None:
                self._inventory_task = ray.remote(num_cpus=0, max_retries=0)(read_node_inventory)
            task = self._inventory_task
        timeout_s = self.connection.start_timeout_s
        ref = task.options(scheduling_strategy=self.node_affinity(node_id)).remote()
        try:
            ran_on, inventory = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            ray.cancel(ref, force=True)
            raise RayUnavailable(f"the inventory task did not run on node {node_id} within {timeout_s:g} s") from err
        if ran_on != node_id:  # node affinity is not soft: Ray broke its contract if this happens
            raise RayUnavailable(f"the inventory task for node {node_id} ran on node {ran_on}")
        log.info("ray_node_inventory", node_id=node_id, ran_on=ran_on, source=inventory["source"],
                 gpus=len(inventory["devices"]))
        return inventory_from_dict(inventory)


def read_node_inventory() -> tuple[str, dict[str, Any]]:
    """Runs on a Ray node (a task pinned there): the node's id as Ray knows it, and its inventory as JSON data."""
    import json

    import ray

    from partitioner.devices.read import load_host_inventory

    inventory = load_host_inventory(None, os.environ)
    return ray.get_runtime_context().get_node_id(), json.loads(json.dumps(inventory_to_dict(inventory)))


@dataclass(frozen=True)
class NodePlacement:
    """Where the partitioner's plan puts one Ray replica: its node, and its plan entry on that node's devices."""

    node_id: str
    address: str
    placement: ReplicaPlacement


class NodePlanner(Protocol):
    """The plan per node (`model_pool.ray_plan.RayPlacer`): None for a replica it does not place (Ray does)."""

    def node_placement(self, launch: ReplicaLaunch) -> NodePlacement | None: ...


class ReplicaActor:
    """Runs on a Ray node: starts one `multiserve worker` there and watches it. A plain class, made a Ray actor by
    `RayCluster.actor_class()`, so importing this module needs no Ray."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def node_address(self) -> str:
        """This node's address, as Ray knows it."""
        import ray

        return str(ray.util.get_node_ip_address())

    def start(self, launch_json: str, token: str, host: str, env: dict[str, str]) -> tuple[int, int]:
        """Start the worker on a free port of `host` on this node; returns the port and the worker's pid."""
        port = free_port(host)
        command = [sys.executable, "-m", "multiserve", "worker", "--launch", launch_json, "--host", host,
                   "--port", str(port)]
        # the actor's environment carries Ray's own CUDA_VISIBLE_DEVICES for its GPUs; a plan entry's `env` wins
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", REPLICA_TOKEN_ENV: token}
        self.process = subprocess.Popen(command, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        return port, self.process.pid

    async def wait(self) -> int:
        """The worker's exit status, once it has exited."""
        assert self.process is not None
        while (code := self.process.poll()) is None:
            await asyncio.sleep(0.2)
        return code

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; the exit status."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGKILL)
            return self.process.wait()


@dataclass
class RayHandle:
    """A replica on Ray: its worker's URL, and the actor that owns the worker."""

    base_url: str
    actor: Any = field(repr=False)
    worker_pid: int
    node: str
    token: str | None = field(default=None, repr=False)
    node_id: str | None = None  # the node the plan pinned it to; None: Ray chose
    _exit: int | None = None
    _watch: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.worker_pid  # on its node (the same host in a one-host cluster)

    def exit_code(self) -> int | None:
        return self._exit

    def output_tail(self) -> str:
        return ""  # on its node, in Ray's logs

    def watch(self, cluster: RayCluster) -> None:
        """Follow the worker: its exit status once it exits, ACTOR_LOST if the actor or its node dies first."""
        async def follow() -> None:
            ray = cluster.ray()
            try:
                self._exit = int(await self.actor.wait.remote())
            except ray.exceptions.RayError as err:
                log.warning("ray_actor_lost", url=self.base_url, node=self.node, error=str(err)[:200])
                self._exit = ACTOR_LOST

        self._watch = asyncio.create_task(follow(), name=f"ray-watch {self.base_url}")

    async def stop(self, timeout_s: float) -> None:
        import ray

        if self._exit is None:
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                await asyncio.wait_for(self.actor.stop.remote(timeout_s), timeout_s + 5.0)
        with contextlib.suppress(ray.exceptions.RayError):
            ray.kill(self.actor)
        if self._watch is not None:
            self._watch.cancel()
        if self._exit is None:
            self._exit = 0


class RayLauncher:
    """Starts each replica as a Ray actor with the model's `ray` resources (see the module); a replica that
    `planner` places goes to its planned node with its plan entry."""

    def __init__(self, cluster: RayCluster, planner: NodePlanner | None = None) -> None:
        self.cluster = cluster
        self.planner = planner

    async def start(self, launch: ReplicaLaunch) -> RayHandle:
        resources = launch.ray or RayResources()
        options = resources.ray_options()
        actor_class = await asyncio.to_thread(self.cluster.actor_class)
        gateway_address = await asyncio.to_thread(self.cluster.gateway_address)
        planned = None if self.planner is None else await asyncio.to_thread(self.planner.node_placement, launch)
        if planned is not None:
            options["scheduling_strategy"] = self.cluster.node_affinity(planned.node_id)
            launch = launch.model_copy(update={"placement": planned.placement})
            log.info("ray_replica_planned", replica=launch.replica_id, node_id=planned.node_id,
                     node=planned.address, env=dict(planned.placement.env))
        actor = actor_class.options(**options).remote()
        token = secrets.token_urlsafe(32)
        # the worker inherits its actor's environment (Ray's, on that node: none of the gateway's secrets)
        env = dict(launch.placement.env)
        timeout_s = self.cluster.connection.start_timeout_s
        try:
            url, pid, node = await asyncio.wait_for(self._start_worker(actor, launch, token, env, gateway_address),
                                                    timeout_s)
        except WorkerUnreachable as err:
            self.cluster.ray().kill(actor)
            raise WorkerUnreachable(f"{launch.replica_id}: {err}") from None
        except TimeoutError as err:
            self.cluster.ray().kill(actor)
            where = "" if planned is None else f" on its planned node {planned.address} ({planned.node_id})"
            raise RayUnavailable(f"{launch.replica_id}: Ray did not place and start its actor{where} within "
                                 f"{timeout_s:g} s (asking {resources.ray_options()}); is a node with those "
                                 f"resources free?") from err
        handle = RayHandle(url, actor, int(pid), node, token, node_id=None if planned is None else planned.node_id)
        handle.watch(self.cluster)
        return handle

    async def _start_worker(self, actor: Any, launch: ReplicaLaunch, token: str, env: dict[str, str],
                            gateway_address: str) -> tuple[str, int, str]:
        """Start the replica's worker under its placed actor, listening where `worker_address` says; its URL, pid
        and node's address."""
        node_address = await actor.node_address.remote()
        host, dialled = worker_address(self.cluster.connection.worker_host, node_address, gateway_address)
        port, pid = await actor.start.remote(launch.model_dump_json(), token, host, env)
        return f"http://{dialled}:{port}", pid, node_address


def ray_problems(registry: Registry, cluster: RayCluster | None) -> list[Problem]:
    """Why the registry's `launcher: ray` models cannot run on the cluster: it cannot be reached, or a model asks
    for more than any one of its nodes has (an actor Ray could never place). Empty when there is no such model."""
    models = [(i, m) for i, m in enumerate(registry.models) if m.launcher == "ray" and m.enabled and m.max_replicas]
    if not models:
        return []
    if cluster is None:
        return [Problem("gateway.ray", "launcher 'ray' models need the gateway connected to a Ray cluster")]
    try:
        nodes = cluster.nodes()
    except RayUnavailable as err:
        return [Problem("gateway.ray.address", str(err))]
    problems = []
    for i, model in models:
        asked = asked_resources(model.ray or RayResources())
        if not any(node_holds(node, asked) for node in nodes):
            have = "; ".join(f"{n.get('NodeManagerAddress', '?')}: {resources_text(n.get('Resources', {}))}"
                             for n in nodes)
            problems.append(Problem(f"models[{i}].ray", f"no node of the Ray cluster has {resources_text(asked)} "
                                                        f"for one replica of {model.name!r}; nodes: {have or 'none'}"))
    return problems


def node_holds(node: dict[str, Any], asked: dict[str, float]) -> bool:
    """Whether the node's total resources (as `ray.nodes()` reports them) hold one actor asking `asked`."""
    return all(node.get("Resources", {}).get(k, 0.0) >= v for k, v in asked.items())


def asked_resources(resources: RayResources) -> dict[str, float]:
    """The request in the names Ray reports node resources by."""
    asked = {"CPU": resources.num_cpus, "GPU": resources.num_gpus, **resources.resources}
    if resources.memory_gib is not None:
        asked["memory"] = resources.memory_gib * GIB
    return {k: v for k, v in asked.items() if v > 0}


def resources_text(resources: dict[str, float]) -> str:
    """Resources as messages show them: memory in GiB, Ray's own per-node and object-store entries left out."""
    shown = {k: v for k, v in resources.items() if not k.startswith(("node:", "object_store"))}
    return ", ".join(f"{k} {v / GIB:.1f} GiB" if k == "memory" else f"{k} {v:g}" for k, v in sorted(
        shown.items())) or "nothing"
