"""Models on demand through the gateway: a request to a cold model waits for its start and is served (its wait and
TTFT in the metrics), /ready counts a cold model as ready, a start with no room in the budget is a 503 with
Retry-After naming the budget, and the admin API pins a model resident. Fakes at the pool's seams (fakes.py)."""

from __future__ import annotations

import yaml

from registry.fields import GIB
from registry.launch import Footprint
from tests.gateway.fakes import ADMIN_TOKEN, FakeGateway, chat, error_of

REGISTRY = """\
gateway: {host: 127.0.0.1, port: 0, model_roots: [/], memory_budget_gib: {cpu: 1.5}, eviction_wait_s: 0.5}
models:
  - name: lazy
    type: chat
    source: {path: /models/lazy.gguf}
    replicas: {min: 0, max: 1}
  - name: other
    type: chat
    source: {path: /models/other.gguf}
    replicas: {min: 0, max: 1}
    scaling: {idle_unload_s: 60}
"""
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def one_gib(spec, index):
    return Footprint("cpu", GIB)


def test_a_request_to_a_cold_model_starts_it_and_is_served(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        await gw.pool.apply(gw.store.registry)  # as the gateway's start does
        ready = await gw.client.get("/ready")
        assert ready.status_code == 200, ready.text  # nothing runs, nothing is failing
        assert ready.json()["models"]["lazy"] == {"ready_replicas": 0, "replicas": 0, "states": [],
                                                  "on_demand": True}
        assert gw.launcher.handles == []
        response = await gw.client.post("/v1/chat/completions", json=chat("lazy", stream=True))
        assert response.status_code == 200 and "data:" in response.text
        assert [h.request.model for h in gw.launcher.handles] == ["lazy"]
        assert gw.metric("multiserve_gateway_cold_starts_total", model="lazy", outcome="ok") == 1
        assert gw.metric("multiserve_gateway_cold_start_wait_seconds_count", model="lazy") == 1
        assert gw.metric("multiserve_gateway_cold_time_to_first_byte_seconds_count", model="lazy") == 1
        assert gw.metric("multiserve_gateway_memory_held_bytes", device="cpu") == GIB
        assert gw.metric("multiserve_gateway_memory_budget_bytes", device="cpu") == 1.5 * GIB
        again = await gw.client.post("/v1/chat/completions", json=chat("lazy", stream=True))
        assert again.status_code == 200
        assert gw.metric("multiserve_gateway_cold_time_to_first_byte_seconds_count", model="lazy") == 1  # warm now
        health = (await gw.client.get("/health/models")).json()
        assert health["models"]["lazy"]["residency"] == "resident"
        assert health["models"]["other"]["residency"] == "cold"
        assert health["memory"] == {"cpu": {"budget_bytes": int(1.5 * GIB), "held_bytes": GIB}}

    with_gateway(scenario, registry_text=REGISTRY, ready=False, footprint_for=one_gib)


def test_a_cold_start_with_no_room_is_a_503_with_retry_after_naming_the_budget(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        await gw.pool.apply(gw.store.registry)
        lazy = await gw.pool.cold_start(gw.pool.groups["lazy"])
        lease = gw.pool.lease(lazy)  # a request in flight: not evictable
        response = await gw.client.post("/v1/chat/completions", json=chat("other"))
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        error = error_of(response)
        assert error["code"] == "memory_budget_full"
        assert "under gateway.memory_budget_gib.cpu = 1.50 GiB: held by lazy/0 1.00 GiB (1 in flight)" in error[
            "message"]
        assert gw.metric("multiserve_gateway_cold_starts_total", model="other", outcome="refused") == 1
        lease.release()
        served = await gw.client.post("/v1/chat/completions", json=chat("other"))
        assert served.status_code == 200  # `lazy` idle now: evicted for it
        assert gw.metric("multiserve_gateway_replica_unloads_total", model="lazy", reason="evicted") == 1

    with_gateway(scenario, registry_text=REGISTRY, ready=False, footprint_for=one_gib)


def test_the_admin_api_pins_a_model_resident_and_unpins_it(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        await gw.pool.apply(gw.store.registry)
        pinned = await gw.client.post("/admin/models/other/pin", headers=ADMIN)
        assert pinned.status_code == 200, pinned.text
        assert pinned.json()["diff"]["changed"] == ["other"]
        assert [h.request.model for h in gw.launcher.handles] == ["other"]  # started with the edit
        entry = yaml.safe_load(gw.path.read_text())["models"][1]
        assert entry["scaling"] == {"idle_unload_s": 60, "pinned": True}
        assert (await gw.client.get("/health/models")).json()["models"]["other"]["pinned"] is True
        unpinned = await gw.client.post("/admin/models/other/unpin", headers=ADMIN)
        assert unpinned.status_code == 200
        assert yaml.safe_load(gw.path.read_text())["models"][1]["scaling"]["pinned"] is False
        missing = await gw.client.post("/admin/models/nope/pin", headers=ADMIN)
        assert missing.status_code == 404

    with_gateway(scenario, registry_text=REGISTRY, ready=False, footprint_for=one_gib)


def test_a_model_with_a_fixed_count_cannot_be_pinned(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.post("/admin/models/beta/pin", headers=ADMIN)
        assert response.status_code == 400
        error = error_of(response)
        assert error["code"] == "registry_rejected" and error["param"] == "scaling.pinned"
        assert "models[1].scaling: only for a model started on demand" in error["message"]

    with_gateway(scenario)


def test_a_stream_whose_replica_is_drained_goes_on_on_a_replica_started_for_it(with_gateway):
    """A model on demand with no replica left for a broken stream's continuation starts one (within the
    continuation's wait), instead of ending the stream."""
    registry = REGISTRY.replace("    replicas: {min: 0, max: 1}\n  - name: other",
                                "    replicas: {min: 0, max: 2}\n  - name: other")
    registry = registry.replace("memory_budget_gib: {cpu: 1.5}", "memory_budget_gib: {cpu: 3}")

    async def scenario(gw: FakeGateway) -> None:
        await gw.pool.apply(gw.store.registry)
        gw.replicas.set("lazy/0", "break_midstream")

        def drain(received) -> None:  # its only replica leaves routing once the stream started
            if received.host == "fake-lazy-0":
                gw.pool.drain("lazy/0")

        gw.replicas.on_request = drain
        response = await gw.client.post("/v1/chat/completions", json=chat("lazy", stream=True))
        assert response.status_code == 200
        assert "stream_interrupted" not in response.text
        assert [h.request.index for h in gw.launcher.handles] == [0, 1]  # the second started for the continuation
        resumed = [r for r in gw.replicas.received if "multiserve_resume" in r.body]
        assert [r.host for r in resumed] == ["fake-lazy-1"]

    with_gateway(scenario, registry_text=registry, ready=False, footprint_for=one_gib)
