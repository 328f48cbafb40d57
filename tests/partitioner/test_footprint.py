"""What a replica holds of which device's memory budget (planning/footprint.py), each device's default budget, and
the registry check that the replicas always resident fit a budget the registry sets (`placer.budget_problems`)."""

from __future__ import annotations

from typing import Any

import pytest

from partitioner.devices.inventory import Inventory
from partitioner.planning.footprint import CPU_PROCESS_OVERHEAD_BYTES, device_budget, host_memory_bytes
from partitioner.planning.placer import ReplicaPlacer, budget_problems
from registry.engine import CPU_KV_CACHE_BYTES
from registry.fields import GIB, MIB
from registry.launch import Footprint
from registry.schema import Registry
from tests.partitioner.conftest import gpus

CPU = Inventory(devices=(), source="cpu", note="no NVML (test)")


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "w.gguf"
    path.write_bytes(b"\0" * (3 * MIB))
    return str(path)


def chat(name: str, source: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "type": "chat", "source": {"path": source}, **fields}


def placer_for(registry: Registry, inventory: Inventory, tmp_path) -> ReplicaPlacer:
    return ReplicaPlacer(lambda: registry, lambda: inventory, tmp_path / "arbiter")


def test_a_cpu_replica_holds_its_weight_files_its_kv_budget_and_a_worker_process(weights, tmp_path):
    registry = Registry.model_validate({"models": [
        chat("sized", weights, engine={"kv_cache_gib": 0.25}), chat("default", weights),
        chat("given", weights, placement={"memory_gib": 2}),
        {"name": "cmd", "type": "chat", "launcher": "command", "source": {"path": weights},
         "command": {"argv": ["python3", "-m", "srv", "{port}"]}},
        chat("gone", str(tmp_path / "missing.gguf"))]})
    placer = placer_for(registry, CPU, tmp_path)
    sized, default, given, cmd, gone = (placer.footprint(m, 0) for m in registry.models)
    assert sized == Footprint("cpu", 3 * MIB + GIB // 4 + CPU_PROCESS_OVERHEAD_BYTES)
    assert default == Footprint("cpu", 3 * MIB + CPU_KV_CACHE_BYTES + CPU_PROCESS_OVERHEAD_BYTES)
    assert given == Footprint("cpu", 2 * GIB)  # placement.memory_gib wins
    assert cmd == Footprint("cpu", None) and gone == Footprint("cpu", None)  # nothing known: not counted


def test_a_replica_with_a_draft_model_holds_its_files_and_a_second_kv_cache(weights, tmp_path):
    draft = tmp_path / "d.gguf"
    draft.write_bytes(b"\0" * MIB)
    registry = Registry.model_validate({"models": [
        chat("t", weights, engine={"kv_cache_gib": 0.25, "speculative": {"method": "draft", "draft_model": "d"}}),
        chat("d", str(draft))]})
    footprint = placer_for(registry, CPU, tmp_path).footprint(registry.models[0], 0)
    assert footprint == Footprint("cpu", 3 * MIB + MIB + 2 * (GIB // 4) + CPU_PROCESS_OVERHEAD_BYTES)
    draft.unlink()  # the draft's files gone: the model's own bytes and both KV caches still count
    footprint = placer_for(registry, CPU, tmp_path).footprint(registry.models[0], 0)
    assert footprint == Footprint("cpu", 3 * MIB + 2 * (GIB // 4) + CPU_PROCESS_OVERHEAD_BYTES)


def test_a_gpu_replica_holds_its_planned_memory_on_its_gpu(weights, tmp_path):
    registry = Registry.model_validate({"models": [
        chat("g", weights, device="cuda", placement={"memory_gib": 10}, replicas={"min": 0, "max": 2})]})
    placer = placer_for(registry, gpus("h100-80gb"), tmp_path)
    assert placer.footprint(registry.models[0], 1) == Footprint("0", 10 * GIB)
    assert placer.budget("0") == gpus("h100-80gb").devices[0].memory_total_bytes
    assert placer.budget("3") is None  # no such GPU: no budget known
    assert device_budget("cpu", CPU) == host_memory_bytes() and (host_memory_bytes() or 0) > GIB


def test_a_budget_must_hold_the_replicas_always_resident_and_each_model_on_demand(weights, tmp_path):
    per_replica = 3 * MIB + GIB // 4 + CPU_PROCESS_OVERHEAD_BYTES  # ~0.77 GiB
    small = {"kv_cache_gib": 0.25}

    def check(models: list[dict[str, Any]], budget: float) -> list[str]:
        registry = Registry.model_validate({"gateway": {"memory_budget_gib": {"cpu": budget}}, "models": models})
        plan = placer_for(registry, CPU, tmp_path).plan_for(registry)
        return [str(p) for p in budget_problems(registry, plan)]

    on_demand = [chat(f"m{i}", weights, engine=small, replicas={"min": 0, "max": 1}) for i in range(6)]
    assert check(on_demand, 1.0) == []  # six models, one at a time fits
    resident = [chat("a", weights, engine=small), chat("b", weights, engine=small, replicas={"min": 1, "max": 2})]
    problems = check(resident + on_demand, 1.0)
    assert problems == [f"gateway.memory_budget_gib.cpu: 1 GiB cannot hold the replicas always resident there "
                        f"({2 * per_replica / GIB:.2f} GiB: a/0 {per_replica / GIB:.2f} GiB, b/0 "
                        f"{per_replica / GIB:.2f} GiB); raise it, or start models on demand "
                        f"(replicas: {{min: 0, max: N}})"]
    assert check([chat("big", weights, replicas={"min": 0, "max": 1})], 1.0) == [
        f"models[0].replicas: a replica of big holds {(3 * MIB + GIB + CPU_PROCESS_OVERHEAD_BYTES) / GIB:.2f} GiB, "
        f"more than gateway.memory_budget_gib.cpu = 1 GiB: it could never start"]
    assert check(resident, 2.0) == []
