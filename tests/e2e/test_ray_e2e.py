"""Replicas on a Ray cluster (`launcher: ray`): a local cluster started for this module (head on loopback, no
dashboard, a small object store; two "nodes" as custom resources `node_a` and `node_b`), a real gateway and real
workers started by Ray actors, the official openai client. Killing an actor, or its worker, mid-load loses no
stream (they go on on the other replica) and the replica comes back; scaling works; a resource no node has is
refused and the last registry keeps serving. A model that writes `placement:` is planned per node: the node's
inventory is read on it (a CPU inventory here), its replica is pinned there with the plan entry, and a plan that
needs an arbiter on the node is refused by name. A second raylet that dies takes its replica with it, and the
replica starts again on a third node that has its resource."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model_pool.launcher import free_port
from tests.e2e.conftest import ADMIN_TOKEN, Gateway, replica_get, running_gateway
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

pytest.importorskip("ray", reason="launcher: ray needs the ray extra (make install installs it)")

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
# A throwaway cluster on loopback, for this module only: no token (Ray's default for a real one is token auth)
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}
# Its nodes stop at once on SIGTERM. By default a node's `ray start --block` first asks the GCS to drain it and waits
# up to 30 s for that: the GCS got the same SIGTERM (the whole process group is stopped) and never answers, so every
# node's stop took the full 30 s and then a SIGKILL. Draining is for Serve replicas on a node going away (Kubernetes
# upgrades); nothing here needs it, and with it off the node still shuts its processes down gracefully.
NODE_ENV = {**NO_AUTH, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
MAX_TOKENS = 400
REGISTRY = """\
gateway:
  host: 127.0.0.1
  port: {port}
  ray: {{address: "127.0.0.1:{ray_port}", worker_host: 127.0.0.1, start_timeout_s: 60}}
models:
  - name: tiny-ray
    type: chat
    source: {{path: {model}}}
    replicas: 2
    launcher: ray
    ray: {{num_cpus: 0.5, resources: {{node_a: 1}}}}
    device: cpu
    engine: {{block_size: 16, kv_cache_gib: 0.02, max_model_len: 512, max_num_seqs: 16}}
  - name: tiny-planned
    type: chat
    source: {{path: {model}}}
    launcher: ray
    ray: {{num_cpus: 0.5, resources: {{node_b: 1}}}}
    device: cpu
    placement: {{isolation: timeslice}}
    engine: {{block_size: 16, kv_cache_gib: 0.02, max_model_len: 512, max_num_seqs: 16}}
"""


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A one-machine Ray cluster: `ray start --head --block` in a process of its own, stopped with it."""
    port = free_port()
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    temp = tmp_path_factory.mktemp("ray")
    log = (temp / "head.log").open("wb")
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
         "--num-cpus=4", '--resources={"node_a": 4, "node_b": 2}', "--include-dashboard=false",
         "--object-store-memory=100000000", "--disable-usage-stats", f"--temp-dir={temp}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **NODE_ENV})
    try:
        yield port
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()


@pytest.fixture(scope="module")
def gateway(ray_head: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("ray-gateway")
    model = write_gguf(hf_model(TinySpec(max_position_embeddings=512), seed=3), root / "tiny.gguf")
    port = free_port()
    with running_gateway(root, REGISTRY.format(port=port, ray_port=ray_head, model=model), port, model,
                         extra_env=NO_AUTH) as gw:
        yield gw


def _replicas(gateway: Gateway, model: str = "tiny-ray") -> list[dict]:
    return httpx.get(f"{gateway.url}/health/models", timeout=10).json()["models"][model]["replicas"]


def _wait_ready(gateway: Gateway, count: int, timeout_s: float = 120.0, model: str = "tiny-ray") -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = [r for r in _replicas(gateway, model) if r["state"] != "stopped"]
        if len(replicas) == count and all(r["state"] == "ready" for r in replicas):
            return replicas
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def _stream(client: openai.AsyncOpenAI, i: int) -> str:
    """One greedy stream's text."""
    stream = await client.completions.create(model="tiny-ray", prompt=f"ray {i}: the story goes", max_tokens=MAX_TOKENS,
                                             temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    text = ""
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
    return text


async def _load(gateway: Gateway, count: int) -> list[str]:
    """`count` streams at once; their texts."""
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        return list(await asyncio.gather(*(_stream(client, i) for i in range(count))))


def test_ray_replicas_serve_the_openai_client(gateway):
    replicas = _wait_ready(gateway, 2)
    assert all(r["url"].startswith("http://127.0.0.1:") for r in replicas)
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(model="tiny-ray", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 8


def _running(replica: dict) -> float:
    """Requests the replica's engine is running now, by its own gauge."""
    text = replica_get(replica, "/metrics").text
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "multiserve_num_requests_running")


@pytest.mark.parametrize("target", ["actor", "worker"])
def test_a_killed_actor_or_worker_loses_no_stream_and_comes_back(gateway, target):
    """SIGKILL of the Ray actor that owns the busier replica's worker (the worker gets SIGTERM with it, and its
    graceful stop ends its streams), or of the worker itself (its streams break and go on on the other replica),
    while 8 streams run: every stream completes with its undisturbed text, and the pool starts a new actor, which
    Ray places, and whose worker becomes ready.

    The kill comes as soon as a replica's engine is seen running streams, by its own gauge, polled from a thread
    of its own from before the streams start: on a quick machine the tiny model finishes its streams long before
    their clients have read them (the rest waits in buffers on the way), so a kill timed by what the clients had
    received, or polled from their busy event loop, came too late to break anything. A scrape that fails is retried,
    and a round in which no poll caught an engine busy runs again (up to 3)."""
    _wait_ready(gateway, 2)
    reference = asyncio.run(_load(gateway, 8))
    replicas = _replicas(gateway)
    killed: list[tuple[dict, float]] = []
    missed: list[str] = []  # why a poll saw nothing (a slow or failed scrape), for the message if no round kills

    def kill_when_busy(load_done: threading.Event) -> None:
        while not killed and not load_done.is_set():
            for replica in replicas:
                try:
                    busy = _running(replica)
                except Exception as exc:  # a scrape that fails must not end the poller
                    missed.append(f"{replica['id']}: {exc!r}")
                    continue
                if busy > 0:
                    killed.append((replica, busy))
                    os.kill(_parent_of(replica["pid"]) if target == "actor" else replica["pid"], signal.SIGKILL)
                    return

    broke = False  # a killed worker's running streams broke and went on elsewhere
    for _ in range(3):  # a round whose streams all finish between two polls (a quick machine) runs again
        killed.clear()
        load_done = threading.Event()
        killer = threading.Thread(target=kill_when_busy, args=(load_done,))
        killer.start()
        try:
            assert asyncio.run(_load(gateway, 8)) == reference
        finally:
            load_done.set()
            killer.join()
        if not killed:
            continue
        [(victim, _)] = killed
        back = _restarted(gateway, victim)
        assert back["pid"] != victim["pid"]
        if target == "actor":
            break
        text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        broke = 'multiserve_gateway_stream_migrations_total{cause="replica_failed",model="tiny-ray"}' in text
        if broke:
            break
        # The engine's gauge said running, but the kill landed once every stream had been generated (the rest of
        # them waiting in buffers on the way): nothing broke, so this round proved nothing. Again, with the
        # replicas as they are now.
        replicas = _replicas(gateway)
    assert killed, f"no replica's engine was seen running the streams in 3 rounds; failed polls: {missed[-5:]}"
    if target == "worker":  # its running streams broke, and went on elsewhere
        assert broke, "in 3 rounds no kill of a busy worker broke a stream"


def _restarted(gateway: Gateway, victim: dict) -> dict:
    """The killed replica once the pool noticed (the actor's exit, or its worker's) and a new one is ready."""
    deadline = time.monotonic() + 120
    while True:
        back = next(r for r in _replicas(gateway) if r["id"] == victim["id"])
        if back["restarts"] > victim["restarts"] and back["state"] == "ready":
            return back
        assert time.monotonic() < deadline, back
        time.sleep(0.2)


def test_ray_replicas_scale_1_3_1_through_the_admin_api(gateway):
    for count in (1, 3, 1):
        reply = httpx.post(f"{gateway.url}/admin/models/tiny-ray/scale", json={"replicas": count}, headers=ADMIN,
                           timeout=180)
        assert reply.status_code == 200, reply.text
        _wait_ready(gateway, count)
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        assert client.completions.create(model="tiny-ray", prompt="hi", max_tokens=4).usage is not None
    reply = httpx.post(f"{gateway.url}/admin/models/tiny-ray/scale", json={"replicas": 2}, headers=ADMIN,
                       timeout=180)
    assert reply.status_code == 200, reply.text


def test_a_resource_no_node_has_is_refused_by_name_and_the_last_registry_keeps_serving(gateway):
    _wait_ready(gateway, 2)
    entry = {"type": "chat", "source": {"path": str(gateway.model_path)}, "replicas": 2, "launcher": "ray",
             "device": "cpu", "ray": {"num_cpus": 0.5, "resources": {"gpu_node": 1}},
             "engine": {"block_size": 16, "kv_cache_gib": 0.02, "max_model_len": 512, "max_num_seqs": 16}}
    reply = httpx.put(f"{gateway.url}/admin/models/tiny-ray", json=entry, headers=ADMIN, timeout=60)
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "no node of the Ray cluster has" in message and "gpu_node 1" in message and "node_a 4" in message
    status = httpx.get(f"{gateway.url}/admin/registry/status", headers=ADMIN, timeout=10).json()
    assert "gpu_node" in str(status)
    assert [r["state"] for r in _replicas(gateway)] == ["ready", "ready"]
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        assert client.completions.create(model="tiny-ray", prompt="hi", max_tokens=4).usage is not None


def _log_events(gateway: Gateway, event: str) -> list[dict]:
    """The gateway's log lines (JSON) of one event."""
    lines = [line for line in gateway.log_path.read_text().splitlines() if line.startswith("{")]
    return [e for e in map(json.loads, lines) if e.get("event") == event]


def test_a_planned_replica_runs_on_the_node_whose_inventory_was_read_there_with_its_plan_entry(gateway):
    [replica] = _wait_ready(gateway, 1, model="tiny-planned")
    [inventory] = _log_events(gateway, "ray_node_inventory")  # read once, on the one node
    assert inventory["ran_on"] == inventory["node_id"] and inventory["source"] == "cpu" and inventory["gpus"] == 0
    placed = [e for e in _log_events(gateway, "ray_replica_planned") if e["replica"] == "tiny-planned/0"]
    assert placed and all((e["node_id"], e["env"]) == (inventory["node_id"], {"CUDA_VISIBLE_DEVICES": ""})
                          for e in placed)
    assert not [e for e in _log_events(gateway, "ray_replica_planned") if e["replica"].startswith("tiny-ray/")]
    # its worker was launched with the CPU plan's entry (Ray chose for tiny-ray: no plan entry there)
    args = Path(f"/proc/{replica['pid']}/cmdline").read_bytes().split(b"\0")
    launch = json.loads(args[args.index(b"--launch") + 1])
    assert launch["placement"]["env"] == {"CUDA_VISIBLE_DEVICES": ""}
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        assert client.completions.create(model="tiny-planned", prompt="hi", max_tokens=4).usage is not None


def test_a_plan_that_needs_an_arbiter_on_the_node_is_refused_by_name_and_the_last_registry_keeps_serving(gateway):
    _wait_ready(gateway, 1, model="tiny-planned")
    [node] = {(e["node"], e["node_id"]) for e in _log_events(gateway, "ray_replica_planned")}
    reply = httpx.post(f"{gateway.url}/admin/models/tiny-planned/scale", json={"replicas": 2}, headers=ADMIN,
                       timeout=60)
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert f"tiny-planned/1 (timeslice, device cpu) fits no node of the cluster: node {node[0]} ({node[1][:12]}): " \
           f"it would time-slice cpu" in message
    assert "time-slice cpu between tiny-planned/0, tiny-planned/1 (models[1].placement.isolation: 'timeslice')" \
        in message
    status = httpx.get(f"{gateway.url}/admin/registry/status", headers=ADMIN, timeout=10).json()
    assert "models[1].placement.isolation" in str(status)
    assert [r["state"] for r in _replicas(gateway, "tiny-planned")] == ["ready"]


def _raylet(ray_port: int, temp: Path, name: str, resources: str) -> subprocess.Popen:
    """A second Ray node on this machine (its own raylet joining the head), in a process group of its own."""
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    with (temp / f"{name}.log").open("wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [ray_cli, "start", "--block", f"--address=127.0.0.1:{ray_port}", "--node-ip-address=127.0.0.1",
             "--num-cpus=1", f"--resources={resources}", "--disable-usage-stats"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **NODE_ENV})


def _ancestors(pid: int) -> list[int]:
    """`pid`'s parent, its parent, and so on up to init."""
    chain = []
    while pid > 1:
        pid = _parent_of(pid)
        chain.append(pid)
    return chain


def _stop(node: subprocess.Popen, sig: signal.Signals = signal.SIGTERM) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(node.pid, sig)
    try:
        node.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def test_a_dead_nodes_replica_is_started_again_on_a_node_that_has_its_resources(gateway, ray_head, tmp_path):
    """A second raylet joins with a resource only it has (`roam`); a model asking for it gets its replica there.
    That node is killed (SIGKILL of its whole process group: raylet, actor, worker): the pool sees the actor die and
    starts it again, and Ray places it on a third node that joined with `roam` meanwhile; it serves again."""
    entry = {"type": "chat", "source": {"path": str(gateway.model_path)}, "launcher": "ray", "device": "cpu",
             "ray": {"num_cpus": 0.5, "resources": {"roam": 1}},
             "engine": {"block_size": 16, "kv_cache_gib": 0.02, "max_model_len": 512, "max_num_seqs": 16}}
    second = _raylet(ray_head, tmp_path, "second", '{"roam": 1}')
    third = None
    try:
        deadline = time.monotonic() + 90
        while True:  # refused ("no node of the Ray cluster has roam 1") until the second node has joined
            reply = httpx.put(f"{gateway.url}/admin/models/tiny-roam", json=entry, headers=ADMIN, timeout=60)
            if reply.status_code == 200:
                break
            assert reply.status_code == 400 and "roam 1" in reply.text, reply.text
            assert time.monotonic() < deadline, reply.text
            time.sleep(1)
        [before] = _wait_ready(gateway, 1, model="tiny-roam")
        assert second.pid in _ancestors(before["pid"])  # its worker runs under the second node's raylet
        _stop(second, signal.SIGKILL)  # the node dies at once, its actor and worker with it
        third = _raylet(ray_head, tmp_path, "third", '{"roam": 1}')
        deadline = time.monotonic() + 180
        while True:
            [after] = _replicas(gateway, "tiny-roam")
            if after["restarts"] > before["restarts"] and after["state"] == "ready":
                break
            assert time.monotonic() < deadline, after
            time.sleep(0.5)
        assert after["pid"] != before["pid"] and third.pid in _ancestors(after["pid"])  # now under the third's
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            assert client.completions.create(model="tiny-roam", prompt="hi", max_tokens=4).usage is not None
    finally:
        httpx.delete(f"{gateway.url}/admin/models/tiny-roam", headers=ADMIN, timeout=60)
        for node in (second, third):
            if node is not None:
                _stop(node)
