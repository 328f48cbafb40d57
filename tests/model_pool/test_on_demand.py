"""Models on demand in the pool: a cold start shared by every request that waits for it, idle unload down to `min`,
admission under a device's memory budget (least recently used idle replicas evicted first, replicas in use waited
for, then a refusal naming the budget and what holds it), pinning, and what /health/models shows. Fake replicas and
launcher, a fake clock (tests/model_pool/test_pool.py's harness); every replica holds 1 GiB of a 2 GiB CPU budget."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from model_pool.pool import ColdStartFailed
from model_pool.replica import ReplicaState
from registry.fields import GIB
from registry.launch import Footprint, ReplicaLaunch
from registry.schema import Registry
from tests.gateway.fakes import FakeHandle, FakeLauncher
from tests.model_pool.test_pool import Harness, open_pool

READY, DRAINING = ReplicaState.READY, ReplicaState.DRAINING
BUDGET = 2 * GIB


def on_demand(name: str, **scaling: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "type": "chat", "source": {"path": f"/models/{name}.gguf"},
                             "replicas": {"min": 0, "max": 1}}
    if scaling:
        entry["scaling"] = scaling
    return entry


def resident(name: str) -> dict[str, Any]:
    return {"name": name, "type": "chat", "source": {"path": f"/models/{name}.gguf"}, "replicas": 1}


def registry(*models: dict[str, Any], eviction_wait_s: float = 1.0) -> Registry:
    return Registry.model_validate({"gateway": {"memory_budget_gib": {"cpu": BUDGET / GIB},
                                                "eviction_wait_s": eviction_wait_s}, "models": list(models)})


class WatchedLauncher(FakeLauncher):
    """Checks, at every start, that what the pool counts on the CPU (the new replica included) is within budget;
    a start can be held back (`gate`) to keep a cold start under way."""

    def __init__(self) -> None:
        super().__init__()
        self.harness: Harness | None = None
        self.held_at_start: list[int] = []
        self.gate: asyncio.Event | None = None

    async def start(self, request: ReplicaLaunch) -> FakeHandle:
        if self.gate is not None:
            await self.gate.wait()
        assert self.harness is not None
        held = self.harness.pool.memory()["cpu"]["held_bytes"]
        self.held_at_start.append(held)
        assert held <= BUDGET, f"{request.model}/{request.index} started with {held / GIB:g} GiB held"
        return await super().start(request)


def run(scenario: Callable[[Harness, WatchedLauncher], Awaitable[None]], **options: Any) -> None:
    async def main() -> None:
        launcher = WatchedLauncher()
        async with open_pool(launcher=launcher, footprint_for=lambda spec, index: Footprint("cpu", GIB),
                             **options) as h:
            launcher.harness = h
            await scenario(h, launcher)

    asyncio.run(main())


async def settle() -> None:
    """Let the background unloads run (a fake replica stops at once)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def use(h: Harness, name: str) -> None:
    """One request to `name`: a lease taken and released at the clock's now."""
    replica = h.pool.choose(h.group(name), set()) or await h.pool.cold_start(h.group(name))
    h.pool.lease(replica).release()


def test_a_model_on_demand_starts_nothing_until_asked_and_one_start_serves_every_waiting_request():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a")))
        assert launcher.handles == [] and h.pool.health()["a"]["residency"] == "cold"
        h.replicas.set("a/0", "not_ready")  # loading: the waiters see it starting until a probe answers 200
        probes = 0

        def loaded(_: float) -> None:
            nonlocal probes
            probes += 1
            if probes == 5:
                h.replicas.set("a/0", "ok")

        h.sleep.on_sleep = loaded
        first, second, third = await asyncio.gather(*(h.pool.cold_start(h.group("a")) for _ in range(3)))
        assert first is second is third and first.state == READY
        assert len(launcher.handles) == 1  # one start for the three
        assert h.pool.stats.cold_starts == {("a", "ok"): 1}
        assert h.group("a").waiters == 0
        view = h.pool.health()["a"]
        assert (view["residency"], view["on_demand"], view["replicas_min"], view["replicas_max"]) == (
            "resident", True, 0, 1)
        assert await h.pool.cold_start(h.group("a")) is first  # ready already: no second start
        assert len(launcher.handles) == 1

    run(scenario)


def test_an_idle_replica_is_unloaded_after_idle_unload_s_and_a_later_request_starts_it_again():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a", idle_unload_s=60)))
        await use(h, "a")
        h.clock.advance(30)
        await use(h, "a")  # used again: its idle time starts over
        h.clock.advance(59)
        await h.pool.tick()
        assert [r.state for r in h.group("a").replicas] == [READY]
        h.clock.advance(2)
        await h.pool.tick()
        await settle()
        assert h.group("a").replicas == [] and launcher.handles[0].stopped
        assert h.pool.stats.unloads == {("a", "idle"): 1}
        view = h.pool.health()["a"]
        assert view["residency"] == "cold" and view["last_unload"]["reason"] == "idle"
        await use(h, "a")
        assert len(launcher.handles) == 2 and h.pool.stats.cold_starts[("a", "ok")] == 2

    run(scenario)


def test_a_replica_in_use_is_never_unloaded_for_idleness_nor_one_at_its_min():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        kept = {**on_demand("kept", idle_unload_s=10), "replicas": {"min": 1, "max": 2}}
        await h.pool.apply(registry(on_demand("busy", idle_unload_s=10), kept))
        assert len(launcher.handles) == 1  # `kept`'s min
        await h.pool.tick()
        lease = h.pool.lease(await h.pool.cold_start(h.group("busy")))
        h.clock.advance(100)
        await h.pool.tick()
        await settle()
        assert [r.state for r in h.group("busy").replicas] == [READY]  # a long request: in flight, not idle
        assert [r.state for r in h.group("kept").replicas] == [READY]  # idle, but its min is 1
        lease.release()
        h.clock.advance(11)
        await h.pool.tick()
        await settle()
        assert h.group("busy").replicas == [] and len(h.group("kept").replicas) == 1

    run(scenario)


def test_a_start_over_budget_evicts_the_least_recently_used_idle_replica_and_never_exceeds_the_budget():
    """Least recently used by the second most recent request (LRU-2): a model asked once goes before one asked
    steadily, even when the steady one's last request is the older."""
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a"), on_demand("b"), on_demand("c"), on_demand("d")))
        await use(h, "a")
        h.clock.advance(1)
        await use(h, "b")
        h.clock.advance(1)
        await use(h, "b")
        h.clock.advance(1)
        await use(h, "a")  # both asked twice: `b`'s second-last request (t=1) is after `a`'s (t=0)
        h.clock.advance(1)
        await use(h, "c")
        await settle()
        assert h.group("a").replicas == [] and len(h.group("b").replicas) == 1
        assert h.pool.stats.unloads == {("a", "evicted"): 1}
        assert h.pool.health()["a"]["residency"] == "evicted"
        h.clock.advance(1)
        await use(h, "d")  # `c`, asked once (and last), goes before `b`, asked twice
        await settle()
        assert h.group("c").replicas == [] and len(h.group("b").replicas) == 1
        h.clock.advance(1)
        await use(h, "b")
        await use(h, "c")  # `d`, asked once, goes before `b`, asked steadily
        await settle()
        assert h.group("d").replicas == [] and len(h.group("b").replicas) == 1
        assert max(launcher.held_at_start) == BUDGET  # two replicas of 1 GiB, never three
        assert h.pool.memory() == {"cpu": {"budget_bytes": BUDGET, "held_bytes": BUDGET}}

    run(scenario)


def test_a_start_waits_for_a_replica_in_use_to_go_idle_then_evicts_it():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a"), on_demand("b"), on_demand("c"), eviction_wait_s=10))
        lease_a = h.pool.lease(await h.pool.cold_start(h.group("a")))
        lease_b = h.pool.lease(await h.pool.cold_start(h.group("b")))
        waited = 0.0

        def finish_b_after_a_while(seconds: float) -> None:
            nonlocal waited
            waited += seconds
            if waited >= 2 and lease_b._held:
                lease_b.release()

        h.sleep.on_sleep = finish_b_after_a_while
        replica = await h.pool.cold_start(h.group("c"))
        assert replica.state == READY and 2 <= waited < 10
        assert h.group("b").replicas == [] and h.pool.stats.unloads == {("b", "evicted"): 1}
        assert len(h.group("a").replicas) == 1  # still in use: kept
        lease_a.release()

    run(scenario)


def test_a_start_with_no_room_is_refused_after_eviction_wait_s_naming_the_budget_and_what_holds_it():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a"), on_demand("pinned", pinned=True), on_demand("c"),
                                    eviction_wait_s=1.5))
        assert h.pool.health()["pinned"]["residency"] == "starting"  # pinned: started with the registry
        lease = h.pool.lease(await h.pool.cold_start(h.group("a")))
        await h.pool.tick()
        start = h.clock()
        with pytest.raises(ColdStartFailed) as refused:
            await h.pool.cold_start(h.group("c"))
        assert h.clock() - start == pytest.approx(1.5, abs=0.1)
        message = str(refused.value)
        assert refused.value.budget and refused.value.retry_after_s > 0
        assert "no room for model 'c' (1.00 GiB) under gateway.memory_budget_gib.cpu = 2.00 GiB" in message
        assert "a/0 1.00 GiB (1 in flight)" in message and "pinned/0 1.00 GiB (pinned)" in message
        assert h.pool.stats.cold_starts[("c", "refused")] == 1
        assert h.group("c").replicas == [] and len(launcher.handles) == 2  # nothing started, nothing evicted
        lease.release()
        await use(h, "c")  # `a` is idle now: evicted for `c`; the pinned one never is
        await settle()
        assert h.group("a").replicas == [] and len(h.group("pinned").replicas) == 1

    run(scenario)


def test_a_replica_that_exits_while_starting_fails_its_cold_start_with_its_output():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a")))
        h.replicas.set("a/0", "not_ready")

        def crash(_: float) -> None:
            if launcher.handles:
                launcher.handles[-1].crash(3)

        h.sleep.on_sleep = crash
        with pytest.raises(ColdStartFailed) as failed:
            await h.pool.cold_start(h.group("a"))
        assert "replica a/0 exited while starting: output of pid 40000" in str(failed.value)
        assert not failed.value.budget and h.pool.stats.cold_starts == {("a", "failed"): 1}

    run(scenario)


def test_a_request_waits_at_most_cold_start_timeout_s_and_the_start_goes_on_for_later_ones():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a", cold_start_timeout_s=0.05)))
        launcher.gate = asyncio.Event()  # the launch hangs (a slow host): real time passes
        with pytest.raises(ColdStartFailed) as late:
            await h.pool.cold_start(h.group("a"))
        assert "not ready within scaling.cold_start_timeout_s = 0.05 s (its start goes on)" in str(late.value)
        assert h.group("a").waiters == 0
        starting = h.group("a").starting
        assert starting is not None and not starting.done()
        launcher.gate.set()
        replica = await starting
        assert replica.state == READY and len(launcher.handles) == 1
        assert await h.pool.cold_start(h.group("a")) is replica

    run(scenario)


def test_pinning_keeps_one_replica_resident_and_unpinning_lets_it_go_idle():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a", idle_unload_s=5, pinned=True)))
        assert len(launcher.handles) == 1
        await h.pool.tick()
        h.clock.advance(100)
        await h.pool.tick()
        await settle()
        assert [r.state for r in h.group("a").replicas] == [READY]  # pinned: never idle-unloaded
        await h.pool.apply(registry(on_demand("a", idle_unload_s=5, pinned=False)))
        assert len(launcher.handles) == 1  # unpinning stops nothing by itself
        await h.pool.tick()
        await settle()
        assert h.group("a").replicas == []

    run(scenario)


def test_a_resident_model_added_to_a_full_budget_evicts_idle_replicas_on_demand_first():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a"), on_demand("b")))
        await use(h, "a")
        h.clock.advance(1)
        await use(h, "b")
        await h.pool.apply(registry(on_demand("a"), on_demand("b"), resident("fixed")))
        assert h.group("a").replicas == [] and len(h.group("b").replicas) == 1  # `a` least recently used
        assert [r.replica_id for r in h.group("fixed").replicas] == ["fixed/0"]
        assert h.pool.stats.unloads == {("a", "evicted"): 1}
        assert h.pool.health()["fixed"]["on_demand"] is False

    run(scenario)


def test_a_start_waits_for_a_replica_already_stopping_instead_of_evicting_another():
    """A cold start for one model while another's idle replica unloads: the budget counts the one stopping until it
    is gone, so the new start waits for it instead of evicting a second replica."""
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a", idle_unload_s=5), on_demand("b", idle_unload_s=500),
                                    on_demand("c")))
        await use(h, "a")
        await use(h, "b")
        handle_a, stopped = launcher.latest("a/0"), asyncio.Event()
        stop_a = handle_a.stop

        async def slow_stop(timeout_s: float) -> None:  # its process takes a while to exit
            await stopped.wait()
            await stop_a(timeout_s)

        handle_a.stop = slow_stop  # type: ignore[method-assign]
        h.clock.advance(10)
        await h.pool.tick()  # `a` idle: unloading in the background
        await settle()
        assert [r.state for r in h.group("a").replicas] == [DRAINING]
        sleeps = 0

        def exit_a_later(_: float) -> None:
            nonlocal sleeps
            sleeps += 1
            if sleeps == 10:
                stopped.set()

        h.sleep.on_sleep = exit_a_later
        await use(h, "c")
        stopped.set()
        await settle()
        assert sleeps >= 10  # `c` waited for `a` to be gone
        assert len(h.group("b").replicas) == 1 and h.pool.stats.unloads == {("a", "idle"): 1}

    run(scenario)


def test_a_cold_start_behind_a_drained_replica_is_refused_after_eviction_wait_s_and_shutdown_cancels_starts():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a"), on_demand("b"), eviction_wait_s=2))
        replica = await h.pool.cold_start(h.group("a"))
        h.pool.drain(replica.replica_id)  # an operator's drain: it stays, draining, at the model's max of 1
        with pytest.raises(ColdStartFailed, match=r"every replica it may run \(1\) is draining \(a/0\); undrain one"):
            await h.pool.cold_start(h.group("a"))
        launcher.gate = asyncio.Event()  # a start that hangs in its launch: shutdown must not wait for it
        waiting = asyncio.ensure_future(h.pool.cold_start(h.group("b")))
        await settle()
        starting = h.group("b").starting
        await h.pool.shutdown()
        assert starting is not None and starting.cancelled()
        waiting.cancel()

    run(scenario)


def test_an_operators_drain_is_not_counted_as_memory_about_to_free():
    """A replica drained by hand keeps running: a start that needs its room is refused after eviction_wait_s (not
    left waiting for it), and a resident model the registry adds starts without waiting for it either."""
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a"), on_demand("b"), on_demand("c"), eviction_wait_s=2))
        drained = await h.pool.cold_start(h.group("a"))
        h.pool.drain(drained.replica_id)
        lease = h.pool.lease(await h.pool.cold_start(h.group("b")))
        with pytest.raises(ColdStartFailed, match="no room for model 'c'") as refused:
            await h.pool.cold_start(h.group("c"))
        assert "a/0 1.00 GiB (draining)" in str(refused.value)
        await asyncio.wait_for(h.pool.apply(registry(on_demand("a"), on_demand("b"), on_demand("c"),
                                                     resident("fixed"), eviction_wait_s=2)), timeout=10)
        assert [r.replica_id for r in h.group("fixed").replicas] == ["fixed/0"]
        lease.release()

    run(scenario)


def test_a_rolled_out_replica_is_counted_under_the_budget():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry({**resident("fixed"), "device": "cpu"}))
        await h.pool.tick()
        changed = {**resident("fixed"), "device": "cpu", "engine": {"block_size": 32}}
        await h.pool.apply(registry(changed))  # relaunched: a new replica beside the old (CPU surge), then the old goes
        await settle()
        assert [r.replica_id for r in h.group("fixed").replicas] == ["fixed/0-r1"]
        assert h.pool.memory()["cpu"]["held_bytes"] == GIB
        assert max(launcher.held_at_start) == 2 * GIB  # the surge: old and new side by side, within the budget

    run(scenario)


def test_an_edit_while_a_replica_unloads_neither_fails_nor_leaves_a_pinned_model_without_one():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a", idle_unload_s=5)))
        await use(h, "a")
        handle, stopped = launcher.latest("a/0"), asyncio.Event()
        stop = handle.stop

        async def slow_stop(timeout_s: float) -> None:
            await stopped.wait()
            await stop(timeout_s)

        handle.stop = slow_stop  # type: ignore[method-assign]
        h.clock.advance(10)
        await h.pool.tick()  # idle: unloading in the background, its process slow to exit
        await settle()
        assert [r.state for r in h.group("a").replicas] == [DRAINING]
        await h.pool.apply(registry(on_demand("a", idle_unload_s=5, pinned=True)))
        stopped.set()
        await settle()
        assert [r.replica_id for r in h.group("a").replicas] == ["a/1"]  # the pinned floor, beside the one leaving
        await h.pool.tick()
        assert h.pool.health()["a"]["residency"] == "resident"

    run(scenario)


def test_a_start_slower_than_idle_unload_s_is_not_unloaded_as_it_becomes_ready():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a", idle_unload_s=5)))
        h.replicas.set("a/0", "not_ready")
        probes = 0

        def slow_load(_: float) -> None:
            nonlocal probes
            probes += 1
            if probes == 200:  # 10 s of the fake clock: twice idle_unload_s
                h.replicas.set("a/0", "ok")

        h.sleep.on_sleep = slow_load
        replica = await h.pool.cold_start(h.group("a"))
        await h.pool.tick()
        await settle()
        assert replica.state == READY and h.pool.stats.unloads == {}

    run(scenario)


def test_a_ready_replica_with_its_breaker_open_fails_over_at_once_instead_of_starting_another():
    async def scenario(h: Harness, launcher: WatchedLauncher) -> None:
        await h.pool.apply(registry(on_demand("a")))
        replica = await h.pool.cold_start(h.group("a"))
        for _ in range(3):
            replica.breaker.record_failure()
        assert not replica.routable()
        start = h.clock()
        assert await h.pool.cold_start(h.group("a")) is replica  # the gateway finds it unroutable: fallbacks next
        assert h.clock() - start < 1 and len(launcher.handles) == 1
        assert h.pool.stats.cold_starts == {("a", "ok"): 1}  # that second call started nothing

    run(scenario)
