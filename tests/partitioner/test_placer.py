"""The pool's plan entries: env per replica from the registry + inventory, an arbiter only where replicas of
models with a `placement:` time-share a device, re-planning on registry edits, the worker's reading of its env,
and a real `multiserve worker` process taking leases from the pool's arbiter. The placer decides (plain data, it
starts nothing); the applier, the pool's hook, starts the arbiters its placements name."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import yaml

from gateway.server import make_state
from model_pool.launcher import free_port
from partitioner.applying.placements import PlacementApplier
from partitioner.devices.inventory import Inventory
from partitioner.planning.demand import DEFAULT_OVERHEAD_BYTES, ModelShape
from partitioner.planning.placer import ArbiterStart, PlacedReplica, ReplicaPlacer, needs_arbiter
from partitioner.timeslice.service import ArbiterService
from registry.launch import ReplicaLaunch, ReplicaPlacement
from registry.schema import Registry
from registry.store import RegistryStore
from tests.partitioner.conftest import gpus
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf
from tests.runtimes.server.test_worker import REPO_ROOT, worker_process

CPU = Inventory(devices=(), source="cpu", note="no NVML (test)")


def registry(**models: dict) -> Registry:
    return Registry.model_validate({"models": [
        {"name": name, "type": "chat", "source": {"path": f"/m/{name}.gguf"}, **fields}
        for name, fields in models.items()]})


SHARED = {"chat": {"device": "cpu", "placement": {"weight": 3}},
          "helper": {"device": "cpu", "placement": {"isolation": "timeslice", "weight": 1}},
          "plain": {"device": "cpu"}}


@pytest.fixture
def placer(tmp_path):
    current = {"registry": registry(**SHARED)}
    made = ReplicaPlacer(lambda: current["registry"], lambda: CPU, tmp_path / "arbiter")
    made.current = current  # type: ignore[attr-defined]  # tests swap the registry through it
    return made


@pytest.fixture
def applier(placer):
    made = PlacementApplier(placer)
    yield made
    made.close()


def spec(placer: ReplicaPlacer, name: str):
    return placer.current["registry"].resolve(name)  # type: ignore[attr-defined]


def test_time_shared_cpu_replicas_get_one_arbiter_and_their_weights(placer, tmp_path):
    """Decided as plain data: the placements, and the arbiter to start first; nothing is started by deciding."""
    chat, helper = placer.place(spec(placer, "chat"), 0), placer.place(spec(placer, "helper"), 0)
    socket_path = tmp_path / "arbiter" / "cpu.sock"
    arbiter = ArbiterStart("cpu", socket_path)
    assert chat == PlacedReplica(ReplicaPlacement(env={"CUDA_VISIBLE_DEVICES": ""}, arbiter_socket=str(socket_path),
                                                  arbiter_weight=3.0, arbiter_client="chat/0"), arbiter)
    assert helper.placement.arbiter_weight == 1.0 and helper.placement.arbiter_socket == str(socket_path)
    assert helper.arbiter == arbiter
    # a model that says nothing about placement steps without a gate, even on the shared CPU
    assert placer.place(spec(placer, "plain"), 0) == PlacedReplica(ReplicaPlacement(env={"CUDA_VISIBLE_DEVICES": ""}))
    assert not socket_path.parent.exists()  # no socket, no thread: the applier starts the arbiter


def test_the_applier_starts_one_arbiter_per_shared_device_as_placements_name_it(placer, applier, tmp_path):
    socket_path = tmp_path / "arbiter" / "cpu.sock"
    assert applier(spec(placer, "plain"), 0) == ReplicaPlacement(env={"CUDA_VISIBLE_DEVICES": ""})
    assert applier.shares() == {} and not socket_path.exists()  # no placement named an arbiter yet
    chat, helper = applier(spec(placer, "chat"), 0), applier(spec(placer, "helper"), 0)
    assert chat == placer.place(spec(placer, "chat"), 0).placement  # what the placer decided, handed on
    assert helper == placer.place(spec(placer, "helper"), 0).placement
    assert socket_path.is_socket()
    assert list(applier.shares()) == ["cpu"] and applier.shares()["cpu"] == []
    applier.close()
    assert applier.shares() == {}


def test_one_replica_alone_needs_no_arbiter_and_edits_re_plan(placer, applier):
    placer.current["registry"] = registry(chat=SHARED["chat"])
    assert applier(spec(placer, "chat"), 0) == ReplicaPlacement(env={"CUDA_VISIBLE_DEVICES": ""})
    assert placer.place(spec(placer, "chat"), 0).arbiter is None and applier.shares() == {}
    placer.current["registry"] = registry(chat={**SHARED["chat"], "replicas": 2})
    assert applier(spec(placer, "chat"), 1).arbiter_client == "chat/1"  # two replicas share it now
    assert list(applier.shares()) == ["cpu"]
    assert applier(spec(placer, "chat"), 5) == ReplicaPlacement()  # not in the plan
    assert placer.place(spec(placer, "chat"), 5) == PlacedReplica(ReplicaPlacement())


def test_a_socket_path_too_long_for_unix_is_refused_before_anything_starts(tmp_path):
    reg = registry(**SHARED)
    deep = tmp_path / ("d" * 120)
    made = ReplicaPlacer(lambda: reg, lambda: CPU, deep)
    with pytest.raises(ValueError, match="MULTISERVE_RUN_DIR"):
        made.place(reg.resolve("chat"), 0)
    assert made.place(reg.resolve("plain"), 0).arbiter is None  # no arbiter: no socket to place


def test_gpu_plan_entries_carry_memory_fraction_and_kv_budget(tmp_path):
    reg = registry(big={"device": "cuda", "placement": {"isolation": "timeslice", "memory_gib": 20}})
    shapes = {"big": ModelShape(num_layers=16, num_kv_heads=8, head_dim=64, weights_bytes=4 << 30)}
    made = ReplicaPlacer(lambda: reg, lambda: gpus("h100-80gb"), tmp_path, shapes=shapes)
    placed = made.place(reg.resolve("big"), 0)
    placement = placed.placement
    assert placement.env["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
    assert placement.memory_fraction == pytest.approx(20 / 79.6, rel=0.01)
    assert placement.kv_cache_bytes == (20 << 30) - (4 << 30) - DEFAULT_OVERHEAD_BYTES
    assert placement.arbiter_socket is None and placed.arbiter is None


def test_an_infeasible_plan_launches_replicas_unpartitioned(tmp_path):
    reg = registry(big={"device": "cuda"})  # no GPU here, and the model insists on one
    made = ReplicaPlacer(lambda: reg, lambda: CPU, tmp_path)
    assert made.place(reg.resolve("big"), 0) == PlacedReplica(ReplicaPlacement()) and made.plan_for(reg) is None


def test_problems_name_what_does_not_fit_and_serve_refuses_such_a_registry(tmp_path):
    huge = {"device": "cuda", "placement": {"isolation": "mps", "memory_gib": 4096}}  # fits no host
    reg = registry(huge=huge)
    made = ReplicaPlacer(lambda: reg, lambda: gpus("h100-80gb"), tmp_path)
    problems = made.problems(reg)
    assert problems and all(p.field == "(partition plan)" for p in problems)
    assert "huge/0" in str(problems[0]), problems
    fits = registry(small={"device": "cuda", "placement": {"isolation": "mps", "memory_gib": 1}})
    assert made.problems(fits) == [] and made.plan_for(fits) is not None
    path = tmp_path / "reg.yaml"
    path.write_text(yaml.safe_dump({"gateway": {"model_roots": ["/"]},
                                    "models": [{"name": "huge", "type": "chat", "source": {"path": "/m/huge.gguf"},
                                                **huge}]}))
    # a process of its own: serve configures logging for the whole process
    done = subprocess.run([sys.executable, "-m", "multiserve", "serve", "--config", str(path), "--port",
                           str(free_port())], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 2, done.stdout + done.stderr  # before any replica or port is touched
    assert done.stdout.startswith(f"error: {path}") and "(partition plan): huge/0" in done.stdout


def test_serve_refuses_a_plan_whose_devices_are_not_set_up_yet(tmp_path):
    """An MPS replica with no MPS daemon running, a MIG replica with no MIG device yet: the plan needs device
    changes. For `serve` (require_applied) that is a problem naming each change and the command to run."""
    mps = registry(small={"device": "cuda", "placement": {"isolation": "mps", "memory_gib": 1}})
    lenient = ReplicaPlacer(lambda: mps, lambda: gpus("h100-80gb"), tmp_path)
    strict = ReplicaPlacer(lambda: mps, lambda: gpus("h100-80gb"), tmp_path, require_applied=True)
    assert lenient.problems(mps) == []  # `partition plan` and tests: the plan itself is fine
    (problem,) = strict.problems(mps)
    assert problem.field == "(partition plan)" and "the devices need 1 change(s)" in problem.message
    assert "start an MPS control daemon for GPU 0" in problem.message
    assert "multiserve partition apply --config" in problem.message and "--apply-partition yes" in problem.message
    mig = registry(sliced={"device": "cuda", "placement": {"isolation": "mig", "memory_gib": 10}})
    (problem,) = strict.problems(mig)
    assert "enable MIG mode on GPU 0" in problem.message and "create MIG device" in problem.message
    plain = registry(whole={"device": "cuda", "placement": {"isolation": "exclusive", "memory_gib": 10}})
    assert strict.problems(plain) == []  # nothing to set up: nothing refused


def test_needs_arbiter_only_for_time_slicing(tmp_path):
    reg = registry(a={"placement": {"isolation": "mps", "memory_gib": 1}},
                   b={"placement": {"isolation": "mps", "memory_gib": 1}})
    current = ReplicaPlacer(lambda: reg, lambda: gpus("h100-80gb"), tmp_path).plan_for(reg)
    assert current is not None and {r.isolation for r in current.replicas} == {"mps"}
    assert not any(needs_arbiter(current, r, reg) for r in current.replicas)


def test_make_state_plans_replicas_and_exports_shares(tmp_path):
    path = tmp_path / "reg.yaml"
    path.write_text(yaml.safe_dump({"gateway": {"model_roots": ["/"]}, "models": [
        {"name": n, "type": "chat", "source": {"path": f"/m/{n}.gguf"}, **f} for n, f in SHARED.items()]}))
    state = make_state(RegistryStore(path), env={"MULTISERVE_RUN_DIR": str(tmp_path / "run")})
    placer = state.pool.placement_for
    assert isinstance(placer, PlacementApplier)
    try:
        placement = placer(state.store.registry.resolve("chat"), 0)
        assert placement.arbiter_socket == str(tmp_path / "run" / "arbiter" / "cpu.sock")
        assert (placement.arbiter_client, placement.arbiter_weight) == ("chat/0", 3.0)
        from partitioner.timeslice.client import LeaseClient

        client = LeaseClient(placement.arbiter_socket, "chat/0", 3.0)
        client.acquire()
        client.release()
        text = state.metrics.render().decode()
        assert 'multiserve_gateway_timeslice_weight{device="cpu",replica="chat/0"} 3.0' in text
        assert 'multiserve_gateway_timeslice_steps_total{device="cpu",replica="chat/0"}' in text
        assert 'multiserve_gateway_timeslice_leases_expired_total{device="cpu",replica="chat/0"} 0.0' in text
        client.close()
    finally:
        placer.close()


def test_a_worker_process_takes_its_leases_from_the_arbiter(tmp_path, monkeypatch):
    service = ArbiterService(tmp_path / "cpu.sock", "cpu").start()
    model = write_gguf(hf_model(TinySpec(), seed=2), tmp_path / "tiny.gguf")
    launch = ReplicaLaunch(model="tiny", index=0, type="chat", source=str(model), device="cpu",
                           engine={"block_size": 4}, placement=ReplicaPlacement(
                               kv_cache_bytes=1 << 20, arbiter_socket=str(service.socket_path),
                               arbiter_client="tiny/0", arbiter_weight=3.0))
    args = ["--launch", launch.model_dump_json()]
    try:
        with worker_process(args, tmp_path / "worker.log") as base_url:
            response = httpx.post(f"{base_url}/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
            shares = {s.client_id: s for s in service.shares()}
            assert shares["tiny/0"].weight == 3.0 and shares["tiny/0"].num_steps >= 5
        assert service.shares() == []  # the worker left the arbiter when it stopped
    finally:
        service.close()


def test_a_model_on_demand_is_planned_for_its_max_so_a_cold_start_never_needs_a_partition_change(tmp_path):
    """Its MIG slices are planned (and must exist) when the registry is validated, for `max` replicas, none running:
    a registry whose slices do not exist is refused then, with the command, never at a cold start."""
    lazy = registry(sliced={"device": "cuda", "replicas": {"min": 0, "max": 2},
                            "placement": {"isolation": "mig", "memory_gib": 10}})
    strict = ReplicaPlacer(lambda: lazy, lambda: gpus("h100-80gb"), tmp_path, require_applied=True)
    (problem,) = strict.problems(lazy)
    assert "create MIG device" in problem.message and "multiserve partition apply --config" in problem.message
    plan = ReplicaPlacer(lambda: lazy, lambda: gpus("h100-80gb"), tmp_path).plan_for(lazy)
    assert plan is not None and [r.replica_id for r in plan.replicas] == ["sliced/0", "sliced/1"]
