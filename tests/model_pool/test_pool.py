"""ModelPool: apply a registry, supervise replicas (probe, restart with backoff, give up on crash loops), drain,
choose. Replicas are fakes behind an httpx mock transport, launched by a fake launcher, on a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from model_pool.health import BreakerConfig
from model_pool.launcher import RemoteHandle, UrlLauncher
from model_pool.pool import InstanceGroup, ModelPool, PoolSettings
from model_pool.replica import Lease, Replica, ReplicaState
from registry.launch import ReplicaPlacement
from registry.schema import ModelSpec, Registry
from tests.gateway.fakes import FakeClock, FakeLauncher, FakeReplicas, FakeSleep

READY, STARTING, UNHEALTHY = ReplicaState.READY, ReplicaState.STARTING, ReplicaState.UNHEALTHY


def model(name: str, replicas: int = 1, **fields: Any) -> dict[str, Any]:
    return {"name": name, "type": "chat", "source": {"path": f"/models/{name}.gguf"}, "replicas": replicas,
            **fields}


def registry(*models: dict[str, Any]) -> Registry:
    """A new Registry object each call, as the store hands the pool after every change."""
    return Registry.model_validate({"models": list(models)})


@dataclass
class Harness:
    pool: ModelPool
    launcher: FakeLauncher
    replicas: FakeReplicas
    clock: FakeClock
    sleep: FakeSleep

    def group(self, name: str) -> InstanceGroup:
        group = self.pool.group(name)
        assert group is not None, f"no group {name!r}; groups: {sorted(self.pool.groups)}"
        return group

    def replica(self, replica_id: str) -> Replica:
        replica = self.pool.find_replica(replica_id)
        assert replica is not None, f"no replica {replica_id!r}"
        return replica

    def states(self, name: str) -> list[ReplicaState]:
        return [r.state for r in self.group(name).replicas]

    async def ticks(self, count: int, every_s: float = 0.0) -> None:
        for _ in range(count):
            await self.pool.tick()
            self.clock.advance(every_s)


@asynccontextmanager
async def open_pool(settings: PoolSettings | None = None,
                    placement_for: Callable[[ModelSpec, int], ReplicaPlacement] | None = None,
                    launcher: FakeLauncher | None = None, **pool_options: Any) -> AsyncIterator[Harness]:
    clock = FakeClock()
    launcher, replicas, sleep = launcher or FakeLauncher(), FakeReplicas(), FakeSleep(clock)
    async with httpx.AsyncClient(transport=httpx.MockTransport(replicas.handler)) as http:
        pool = ModelPool({"local": launcher, "url": UrlLauncher()}, http, settings, placement_for=placement_for,
                         clock=clock, sleep=sleep, **pool_options)
        try:
            yield Harness(pool, launcher, replicas, clock, sleep)
        finally:
            await pool.shutdown()


def stream_on(h: Harness, replica_id: str, moved: list[str]) -> Lease:
    """A stream the gateway relays from the replica: a movable lease. Moving it notes where from and lets go of the
    lease (its relay goes on elsewhere); `release()` is the stream finishing in place."""
    lease = h.pool.lease(h.replica(replica_id))

    def move() -> None:
        moved.append(replica_id)
        lease.release()

    lease.movable(move)
    return lease


def run(scenario: Callable[[Harness], Awaitable[None]], **options: Any) -> None:
    async def main() -> None:
        async with open_pool(**options) as harness:
            await scenario(harness)

    asyncio.run(main())


# ------------------------------------------------------------------------------------ apply


def test_apply_starts_the_wanted_replicas_of_each_enabled_model():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(
            model("alpha", 2, aliases=["a"], device="cpu", engine={"block_size": 32}),
            {"name": "beta", "type": "chat", "source": {"package": "llm-pkg", "file": "w.gguf"}},
            model("off", 2, enabled=False),
        ))
        assert sorted(h.pool.groups) == ["alpha", "beta"]
        assert [(h.request.model, h.request.index) for h in h.launcher.handles] == [
            ("alpha", 0), ("alpha", 1), ("beta", 0)]
        assert h.states("alpha") == [STARTING, STARTING]
        first = h.launcher.latest("alpha/0").request
        assert (first.source, first.aliases, first.device) == ("/models/alpha.gguf", ("a",), "cpu")
        assert first.engine.block_size == 32 and first.type == "chat"
        assert first.placement.env == {"SLOT": "alpha-0"}  # what the partitioner's plan (placement_for) says
        assert h.launcher.latest("beta/0").request.source == "llm-pkg:w.gguf"

    run(scenario, placement_for=lambda spec, index: ReplicaPlacement(env={"SLOT": f"{spec.name}-{index}"}))


def test_replicas_become_ready_after_a_successful_probe():
    async def scenario(h: Harness) -> None:
        h.replicas.set("beta/0", "not_ready")
        await h.pool.apply(registry(model("alpha", 2), model("beta")))
        await h.pool.tick()
        assert h.states("alpha") == [READY, READY]
        assert h.states("beta") == [STARTING]  # still loading: stays starting, never routable
        assert h.pool.choose(h.group("beta"), set()) is None
        assert h.replicas.probes["fake-alpha-0"] == 1
        h.replicas.set("beta/0", "ok")
        await h.pool.tick()
        assert h.states("beta") == [READY]
        assert [s for _, s in h.replica("beta/0").transitions] == ["ready"]

    run(scenario)


def test_run_probes_starting_replicas_and_fires_due_restarts_between_ticks_and_ready_ones_once_a_tick():
    """`run()`: a tick every probe interval (2 s); between two, every rollout_poll_s (0.25 s), a pass over the
    replicas still starting and the restarts that are due. A replica ready 3.1 s in serves from 3.25 s, not from the
    tick at 4 s; a crash seen at the tick at 6 s restarts when its 0.5 s backoff ends, not at the tick at 8 s; the
    ready replica is probed once a tick."""
    async def scenario(h: Harness) -> None:
        h.replicas.set("beta/0", "not_ready")
        await h.pool.apply(registry(model("alpha"), model("beta")))
        start = h.clock()
        seen: dict[float, tuple[ReplicaState, int]] = {}  # at each sleep's end, before that pass
        done = asyncio.Event()

        def on_sleep(_: float) -> None:
            now = h.clock() - start
            seen[now] = (h.replica("beta/0").state, len(h.launcher.handles_of("alpha/0")))
            if now >= 3.1:
                h.replicas.set("beta/0", "ok")
            first = h.launcher.latest("alpha/0")
            if now >= 5.0 and len(h.launcher.handles_of("alpha/0")) == 1 and first.exit_code() is None:
                first.crash()
            if now >= 9.9:
                done.set()

        h.sleep.on_sleep = on_sleep
        supervisor = asyncio.create_task(h.pool.run())
        await done.wait()
        supervisor.cancel()
        assert sorted(seen) == [i / 4 for i in range(1, 41)]  # a pass every 0.25 s (a tick on the even seconds)
        assert seen[3.25][0] == STARTING and seen[3.5][0] == READY  # the pass at 3.25 s found it ready
        assert seen[6.5][1] == 1 and seen[6.75][1] == 2  # crashed at 5 s, seen at 6 s, started again at 6.5 s
        assert h.replicas.probes["fake-alpha-0"] == 5  # ticks at 0, 2, 4, 8 s; the pass at 6.75 s (starting)

    run(scenario, settings=PoolSettings(probe_interval_s=2.0, rollout_poll_s=0.25, restart_backoff_s=0.5))


def test_scaling_up_starts_only_the_new_replicas():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2), model("beta")))
        await h.pool.tick()
        before = list(h.group("alpha").replicas)
        beta = h.replica("beta/0")
        await h.pool.apply(registry(model("alpha", 3), model("beta")))
        assert len(h.launcher.handles) == 4
        assert h.launcher.handles[-1].request.index == 2
        assert h.group("alpha").replicas[:2] == before
        assert all(a is b for a, b in zip(h.group("alpha").replicas, before, strict=False))  # same objects
        assert h.states("alpha") == [READY, READY, STARTING]
        assert h.replica("beta/0") is beta
        assert not any(handle.stopped for handle in h.launcher.handles)

    run(scenario)


def test_scaling_down_stops_only_the_highest_indexes():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 3)))
        await h.pool.tick()
        keep = h.replica("alpha/0")
        await h.pool.apply(registry(model("alpha", 1)))
        assert h.group("alpha").replicas == [keep]
        assert h.group("alpha").replicas[0] is keep and keep.state == READY
        assert [h.launcher.latest(f"alpha/{i}").stopped for i in range(3)] == [False, True, True]
        assert len(h.launcher.handles) == 3  # nothing restarted
        await h.pool.apply(registry(model("alpha", 0)))  # defined, not running
        assert h.group("alpha").replicas == [] and h.launcher.running() == []

    run(scenario)


def test_reapplying_an_equal_registry_touches_nothing():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        replicas = list(h.group("alpha").replicas)
        await h.pool.apply(registry(model("alpha", 2)))
        assert len(h.launcher.handles) == 2 and h.launcher.running() == h.launcher.handles
        assert all(a is b for a, b in zip(h.group("alpha").replicas, replicas, strict=True))
        assert h.states("alpha") == [READY, READY]

    run(scenario)


def test_a_changed_spec_rolls_out_new_replicas_before_stopping_the_old_ones():
    events: list[str] = []

    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2, device="cpu"), model("beta")))
        await h.pool.tick()
        old, beta = list(h.group("alpha").replicas), h.replica("beta/0")
        real_start = h.launcher.start

        async def start(request):  # type: ignore[no-untyped-def]
            events.append(f"start {request.model}/{request.index} running={len(h.launcher.running('alpha'))}")
            return await real_start(request)

        h.launcher.start = start  # type: ignore[method-assign]
        for handle in h.launcher.running("alpha"):
            real_stop = handle.stop

            async def stop(timeout_s: float, real_stop=real_stop, handle=handle) -> None:  # type: ignore[no-untyped-def]
                events.append(f"stop {handle.request.model}/{handle.request.index}")
                await real_stop(timeout_s)

            handle.stop = stop  # type: ignore[method-assign]
        await h.pool.apply(registry(model("alpha", 2, device="cpu", engine={"block_size": 32}), model("beta")))
        # one at a time, each new replica up (and ready) before the old one of its index stops
        assert events == ["start alpha/0 running=2", "stop alpha/0", "start alpha/1 running=2", "stop alpha/1"]
        new = h.group("alpha").replicas
        assert [r.replica_id for r in new] == ["alpha/0-r1", "alpha/1-r1"] and not any(n in old for n in new)
        assert all(o.state == ReplicaState.STOPPED for o in old)
        assert [handle.request.engine.block_size for handle in h.launcher.running("alpha")] == [32, 32]
        assert h.replica("beta/0") is beta and not h.launcher.latest("beta/0").stopped
        assert h.states("alpha") == [READY, READY]
        health = h.pool.health()["alpha"]
        assert health["engine"]["block_size"] == 32
        assert health["rollout"] == {"revision": 1, "state": "done", "replaced": 2, "of": 2}

    run(scenario)


def test_a_rollout_whose_new_replica_never_gets_ready_keeps_the_old_ones():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2, device="cpu")))
        await h.pool.tick()
        old = list(h.group("alpha").replicas)
        real_start = h.launcher.start

        async def start_broken(request):  # type: ignore[no-untyped-def]
            handle = await real_start(request)
            handle.crash()  # say, the new engine settings do not fit: the worker exits at once
            return handle

        h.launcher.start = start_broken  # type: ignore[method-assign]
        await h.pool.apply(registry(model("alpha", 2, device="cpu", engine={"block_size": 32})))
        assert h.group("alpha").replicas == old and h.states("alpha") == [READY, READY]
        assert [handle.request.engine.block_size for handle in h.launcher.running("alpha")] == [16, 16]
        rollout = h.pool.health()["alpha"]["rollout"]
        assert rollout["state"] == "failed" and "alpha/0-r1" in rollout["reason"] and rollout["replaced"] == 0

    run(scenario)


def test_a_rollout_without_room_for_two_moves_the_old_replicas_streams_first():
    """A GPU (here any device but the CPU) leaves no room for a second copy: the old replica is drained with
    migration (its streams go on on the other replicas), stopped, then replaced."""
    order: list[str] = []

    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        for replica in h.group("alpha").replicas:
            replica.movable.add(lambda r=replica: order.append(f"moved from {r.replica_id}"))
        real_start = h.launcher.start

        async def start(request):  # type: ignore[no-untyped-def]
            order.append(f"start {request.index}")
            return await real_start(request)

        h.launcher.start = start  # type: ignore[method-assign]
        await h.pool.apply(registry(model("alpha", 2, engine={"block_size": 32})))
        assert order == ["moved from alpha/0", "start 0", "moved from alpha/1", "start 1"]
        assert h.states("alpha") == [READY, READY]

    run(scenario, placement_for=lambda spec, index: ReplicaPlacement(memory_fraction=0.4))


def test_a_rollout_without_room_for_two_stops_at_a_replica_that_never_gets_ready():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 3, device="cuda")))
        await h.pool.tick()
        real_start = h.launcher.start

        async def start_broken(request):  # type: ignore[no-untyped-def]
            handle = await real_start(request)
            handle.crash()
            return handle

        h.launcher.start = start_broken  # type: ignore[method-assign]
        await h.pool.apply(registry(model("alpha", 3, device="cuda", engine={"block_size": 32})))
        # the first was replaced by one that does not start (supervised, restarted like any); the others are kept
        assert [r.replica_id for r in h.group("alpha").replicas] == ["alpha/1", "alpha/2", "alpha/0-r1"]
        assert h.states("alpha")[:2] == [READY, READY]
        rollout = h.pool.health()["alpha"]["rollout"]
        assert rollout["state"] == "failed" and rollout["replaced"] == 0

    run(scenario)


def test_gateway_side_edits_keep_the_replicas_running():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2), model("beta")))
        await h.pool.tick()
        replicas, routing = list(h.group("alpha").replicas), h.group("alpha").routing
        edited = model("alpha", 2, aliases=["a"], fallbacks=["beta"],
                       policy={"routing": "prefix_affinity", "request_timeout_s": 30, "load_bound": 1.5})
        await h.pool.apply(registry(edited, model("beta")))
        assert all(a is b for a, b in zip(h.group("alpha").replicas, replicas, strict=True))
        assert len(h.launcher.handles) == 3 and h.states("alpha") == [READY, READY]
        assert h.group("alpha").routing is not routing and h.group("alpha").routing.load_bound == 1.5
        assert h.group("alpha").spec.fallbacks == ["beta"]  # the new spec is in force
        await h.pool.apply(registry({**edited, "policy": {"routing": "prefix_affinity", "max_queue_len": 4}},
                                    model("beta")))
        # an engine-side limit needs new replicas
        assert [r.replica_id for r in h.group("alpha").replicas] == ["alpha/0-r1", "alpha/1-r1"]

    run(scenario)


def test_removing_or_disabling_a_model_stops_its_replicas():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2), model("beta"), model("gamma")))
        await h.pool.tick()
        await h.pool.apply(registry(model("alpha", 2), model("gamma", enabled=False)))
        assert sorted(h.pool.groups) == ["alpha"]
        assert h.launcher.latest("beta/0").stopped and h.launcher.latest("gamma/0").stopped
        assert sorted(h.pool.health()) == ["alpha"]
        assert h.launcher.running() == h.launcher.handles_of("alpha/0") + h.launcher.handles_of("alpha/1")

    run(scenario)


def test_url_launcher_adopts_replicas_started_elsewhere():
    async def scenario(h: Harness) -> None:
        urls = ["http://fake-remote-0:80/", "http://fake-remote-1:80"]
        await h.pool.apply(registry({"name": "remote", "type": "chat", "launcher": "url", "urls": urls,
                                     "replicas": 2}))
        await h.pool.tick()
        replicas = h.group("remote").replicas
        assert all(isinstance(r.handle, RemoteHandle) for r in replicas)
        assert [r.base_url for r in replicas] == ["http://fake-remote-0:80", "http://fake-remote-1:80"]
        assert h.states("remote") == [READY, READY]
        assert h.launcher.handles == []

    run(scenario)


# ------------------------------------------------------------------------------------ supervision


def test_a_crashed_replica_is_restarted_after_an_exponential_backoff():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        replica = h.replica("alpha/0")
        h.launcher.latest("alpha/0").crash()
        await h.pool.tick()
        assert replica.state == UNHEALTHY and replica.restarts == 1
        assert h.pool.choose(h.group("alpha"), set()) is h.replica("alpha/1")  # the other one takes the traffic
        h.clock.advance(0.4)
        await h.pool.tick()
        assert len(h.launcher.handles_of("alpha/0")) == 1  # backoff (0.5 s) not over yet
        h.clock.advance(0.1)
        await h.pool.tick()
        assert len(h.launcher.handles_of("alpha/0")) == 2 and replica.state == STARTING
        await h.pool.tick()
        assert replica.state == READY and h.replica("alpha/0") is replica
        assert [s for _, s in replica.transitions] == ["ready", "unhealthy", "starting", "ready"]

        h.launcher.latest("alpha/0").crash()  # a second crash soon after: the backoff doubles
        await h.pool.tick()
        assert replica.restarts == 2
        h.clock.advance(0.5)
        await h.pool.tick()
        assert len(h.launcher.handles_of("alpha/0")) == 2
        h.clock.advance(0.5)
        await h.pool.tick()
        assert len(h.launcher.handles_of("alpha/0")) == 3
        assert h.replica("alpha/1").restarts == 0 and len(h.launcher.handles_of("alpha/1")) == 1

    run(scenario, settings=PoolSettings(restart_backoff_s=0.5, restart_backoff_max_s=30.0))


def test_a_crash_looping_replica_is_marked_failed_and_never_restarted():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        replica = h.replica("alpha/0")
        for _ in range(2):
            h.launcher.latest("alpha/0").crash()
            await h.pool.tick()  # noticed: restart scheduled
            h.clock.advance(5.0)
            await h.pool.tick()  # restarted
        h.launcher.latest("alpha/0").crash()
        await h.pool.tick()
        assert replica.state == ReplicaState.FAILED
        assert replica.restarts == 2 and len(h.launcher.handles_of("alpha/0")) == 3
        for _ in range(3):
            h.clock.advance(1000.0)
            await h.pool.tick()
        assert replica.state == ReplicaState.FAILED and len(h.launcher.handles_of("alpha/0")) == 3
        assert {h.pool.choose(h.group("alpha"), set()).replica_id for _ in range(4)} == {"alpha/1"}
        assert h.pool.health()["alpha"]["ready_replicas"] == 1

    run(scenario, settings=PoolSettings(max_crashes=3, crash_window_s=60.0, restart_backoff_s=1.0))


def test_a_launcher_that_cannot_start_a_replica_makes_it_a_crash_retried_with_backoff():
    """A launcher that raises (a Ray cluster that did not place the actor in time) neither stops `apply` nor the
    supervision: the replica counts as crashed, is started again after the backoff, and fails after a crash loop."""
    async def scenario(h: Harness) -> None:
        start, attempts = h.launcher.start, []

        async def unplaced(request):  # type: ignore[no-untyped-def]
            attempts.append(request.index)
            if len(attempts) <= 2:
                raise RuntimeError("the actor was not placed within 120 s")
            return await start(request)

        h.launcher.start = unplaced  # type: ignore[method-assign]
        await h.pool.apply(registry(model("alpha")))
        replica = h.replica("alpha/0")
        assert replica.state == UNHEALTHY and replica.restarts == 1 and replica.handle is None
        h.clock.advance(1.0)
        await h.pool.tick()  # the second attempt fails too
        assert replica.restarts == 2 and replica.state == UNHEALTHY
        h.clock.advance(5.0)
        await h.pool.tick()  # the third starts it
        await h.pool.tick()
        assert replica.state == READY and attempts == [0, 0, 0]

    run(scenario, settings=PoolSettings(restart_backoff_s=0.5, max_crashes=5))


def test_crashes_spread_wider_than_the_window_are_not_a_loop():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        for _ in range(4):
            h.launcher.latest("alpha/0").crash()
            await h.pool.tick()
            h.clock.advance(11.0)  # the previous crash leaves the 10 s window
            await h.pool.tick()
            await h.pool.tick()
            assert h.states("alpha") == [READY]
        assert h.replica("alpha/0").restarts == 4
        # the backoff counts recent crashes only, so it stays at its base
        assert len(h.launcher.handles_of("alpha/0")) == 5

    run(scenario, settings=PoolSettings(max_crashes=2, crash_window_s=10.0, restart_backoff_s=0.5))


def test_a_replica_not_ready_within_the_ready_timeout_is_stopped_and_restarted():
    async def scenario(h: Harness) -> None:
        h.replicas.set("alpha/0", "not_ready")
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        first = h.launcher.latest("alpha/0")
        h.clock.advance(10.0)
        await h.pool.tick()
        assert h.states("alpha") == [STARTING] and not first.stopped  # exactly the timeout: still waiting
        h.clock.advance(1.0)
        await h.pool.tick()
        assert first.stopped  # a hung start is killed before the restart
        assert h.states("alpha") == [UNHEALTHY]
        h.replicas.set("alpha/0", "ok")
        h.clock.advance(0.5)
        await h.ticks(2)
        assert len(h.launcher.handles_of("alpha/0")) == 2 and h.states("alpha") == [READY]

    run(scenario, settings=PoolSettings(ready_timeout_s=10.0, restart_backoff_s=0.5))


@pytest.mark.parametrize("behaviour", ["not_ready", "down", "hang"])
def test_failed_probes_mark_a_replica_unhealthy_and_a_good_probe_recovers_it(behaviour):
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        replica = h.replica("alpha/0")
        h.replicas.set("alpha/0", behaviour)
        await h.pool.tick()
        assert replica.state == READY and replica.consecutive_failures == 1 and replica.last_probe_ok is False
        await h.pool.tick()
        assert replica.state == UNHEALTHY and replica.consecutive_failures == 2
        assert not replica.routable()
        h.replicas.set("alpha/0", "ok")
        await h.pool.tick()
        assert replica.state == READY and replica.consecutive_failures == 0 and replica.routable()
        assert len(h.launcher.handles_of("alpha/0")) == 1  # the process was alive: no restart
        assert h.replica("alpha/1").state == READY

    run(scenario, settings=PoolSettings(unhealthy_after=2))


def test_a_replica_alive_but_unhealthy_too_long_is_restarted_as_a_crash():
    """A hung replica (its process alive, its probes failing) is taken out of routing, then restarted."""
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        first = h.launcher.latest("alpha/0")
        h.replicas.set("alpha/0", "hang")
        await h.ticks(2, every_s=2.0)
        replica = h.replica("alpha/0")
        assert replica.state == UNHEALTHY and not first.stopped
        h.clock.advance(27.0)
        await h.pool.tick()
        assert not first.stopped  # 29 s unhealthy: still given the benefit of the doubt
        h.clock.advance(1.0)
        await h.pool.tick()
        assert first.stopped and len(replica.crash_times) == 1 and replica.restarts == 1
        h.replicas.set("alpha/0", "ok")
        h.clock.advance(1.0)
        await h.ticks(2)
        assert len(h.launcher.handles_of("alpha/0")) == 2 and replica.state == READY
        assert replica.unhealthy_since is None

    run(scenario, settings=PoolSettings(unhealthy_after=2, restart_unhealthy_after_s=30.0, restart_backoff_s=0.5))


def test_a_hung_replica_the_operator_drains_is_left_drained():
    """Draining takes a replica out of the pool's hands: it is no longer unhealthy, so not restarted as hung."""
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        first = h.launcher.latest("alpha/0")
        h.replicas.set("alpha/0", "hang")
        await h.ticks(2, every_s=2.0)
        assert h.replica("alpha/0").state == UNHEALTHY
        h.pool.drain("alpha/0")
        h.clock.advance(31.0)
        await h.pool.tick()
        replica = h.replica("alpha/0")
        assert not first.stopped and replica.state == ReplicaState.DRAINING and replica.restarts == 0

    run(scenario, settings=PoolSettings(unhealthy_after=2, restart_unhealthy_after_s=30.0, restart_backoff_s=0.5))


def test_probes_carry_each_replicas_launch_token():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        tokens = {h.launcher.latest(f"alpha/{i}").token for i in (0, 1)}
        assert set(h.replicas.probe_auth) == {f"Bearer {token}" for token in tokens} and len(tokens) == 2

    run(scenario)


def test_drain_makes_a_replica_unroutable_until_undrained():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        group = h.group("alpha")
        drained = h.pool.drain("alpha/0").replica
        assert drained is h.replica("alpha/0") and drained.state == ReplicaState.DRAINING
        assert not drained.routable()
        assert {h.pool.choose(group, set()).replica_id for _ in range(4)} == {"alpha/1"}
        await h.pool.tick()  # a good probe does not undo a manual drain
        assert drained.state == ReplicaState.DRAINING
        assert not h.launcher.latest("alpha/0").stopped  # drained, not stopped
        assert h.pool.undrain("alpha/0") is drained and drained.state == READY
        assert {h.pool.choose(group, set()).replica_id for _ in range(4)} == {"alpha/0", "alpha/1"}
        assert h.pool.drain("alpha/9") is None and h.pool.undrain("nope/0") is None

    run(scenario)


def test_undrain_leaves_a_replica_that_was_not_drained_alone():
    async def scenario(h: Harness) -> None:
        h.replicas.set("alpha/0", "not_ready")
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        h.pool.undrain("alpha/0")
        assert h.states("alpha") == [STARTING]  # not made READY without a good probe

    run(scenario)


def test_choose_respects_exclude_and_routability():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 3, policy={"routing": "round_robin"})))
        await h.pool.tick()
        group = h.group("alpha")
        assert h.pool.choose(group, {"alpha/0", "alpha/1"}) is h.replica("alpha/2")
        assert h.pool.choose(group, {"alpha/0", "alpha/1", "alpha/2"}) is None
        h.replica("alpha/2").breaker.record_failure()  # threshold 1: the breaker opens
        assert h.pool.choose(group, {"alpha/0", "alpha/1"}) is None
        h.replica("alpha/1").outstanding = 5  # round robin ignores load, but not routability
        picks = [h.pool.choose(group, set()).replica_id for _ in range(4)]
        assert sorted(set(picks)) == ["alpha/0", "alpha/1"]

    run(scenario, settings=PoolSettings(breaker=BreakerConfig(failure_threshold=1, cooldown_s=5.0)))


def test_health_snapshot_reports_each_replica():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        h.replicas.set("alpha/1", "down")
        await h.pool.tick()
        h.replica("alpha/0").outstanding = 3
        health = h.pool.health()
        assert health["alpha"]["ready_replicas"] == 2
        first, second = health["alpha"]["replicas"]
        assert first["id"] == "alpha/0" and first["url"] == "http://fake-alpha-0:80"
        assert first["pid"] == h.launcher.latest("alpha/0").pid
        assert first["state"] == "ready" and first["last_probe_ok"] is True
        assert isinstance(first["last_probe_at"], float)
        assert first["consecutive_failures"] == 0 and first["breaker"] == "closed" and first["in_flight"] == 3
        assert second["last_probe_ok"] is False and second["consecutive_failures"] == 1
        assert second["breaker"] == "open"  # the failed probe counted against it (threshold 1)
        assert second["in_flight"] == 0 and second["restarts"] == 0
        assert [t["state"] for t in second["transitions"]] == ["ready"]
        assert all(isinstance(t["at"], float) for t in second["transitions"])

    run(scenario, settings=PoolSettings(breaker=BreakerConfig(failure_threshold=1)))


# ------------------------------------------------------------------------------------ stopping


def test_retiring_a_replica_lets_its_in_flight_requests_finish_first():
    outstanding_at_stop: list[int] = []

    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        busy = h.replica("alpha/1")
        busy.outstanding = 2
        h.sleep.on_sleep = lambda _: setattr(busy, "outstanding", busy.outstanding - 1)  # one finishes per wait
        handle = h.launcher.latest("alpha/1")
        real_stop = handle.stop

        async def stop(timeout_s: float) -> None:
            outstanding_at_stop.append(busy.outstanding)
            await real_stop(timeout_s)

        handle.stop = stop  # type: ignore[method-assign]
        await h.pool.apply(registry(model("alpha", 1)))
        assert outstanding_at_stop == [0]
        assert len(h.sleep.delays) == 2 and busy.state == ReplicaState.STOPPED

    run(scenario)


def test_scaling_down_moves_the_retired_replicas_streams_to_the_others():
    moved: list[str] = []

    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        for replica in h.group("alpha").replicas:
            replica.movable.add(lambda r=replica: moved.append(r.replica_id))
        await h.pool.apply(registry(model("alpha", 1)))
        assert moved == ["alpha/1"]

    run(scenario)


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_a_replica_found_unhealthy_has_its_streams_moved(num_replicas):
    """Even with nowhere to go yet: a hung replica will not finish them, and their continuations wait for one."""
    moved: list[str] = []

    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", num_replicas)))
        await h.pool.tick()
        h.replica("alpha/0").movable.add(lambda: moved.append("alpha/0"))
        h.replicas.set("alpha/0", "hang")
        await h.ticks(1)
        assert moved == [] and h.states("alpha")[0] == READY  # one failed probe is not enough
        await h.ticks(1)
        assert moved == ["alpha/0"] and h.states("alpha")[0] == UNHEALTHY

    run(scenario)


def test_draining_gives_up_waiting_at_the_drain_timeout():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        h.replica("alpha/1").outstanding = 1  # a request that never finishes
        await h.pool.apply(registry(model("alpha", 1)))
        assert h.launcher.latest("alpha/1").stopped
        assert 3.0 <= sum(h.sleep.delays) < 3.2

    run(scenario, settings=PoolSettings(drain_timeout_s=3.0))


def test_draining_the_last_ready_replica_with_migrate_lets_its_streams_finish_there():
    """Nowhere to move: moved, they would wait for a replica and then be cut, though this one can finish them."""
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        moved: list[str] = []
        streams = [stream_on(h, "alpha/0", moved) for _ in range(2)]
        drained = h.pool.drain("alpha/0", migrate=True)
        assert (drained.migrated_streams, drained.finishing_in_place) == (0, 2)
        assert drained.replica.snapshot()["migration_waiting"] is True
        await h.ticks(3, every_s=2.0)
        assert moved == [] and drained.replica.outstanding == 2
        streams[0].release()  # it finishes where it began
        assert h.pool.undrain("alpha/0") is drained.replica and drained.replica.state == READY
        await h.ticks(1)
        assert moved == [] and drained.replica.outstanding == 1 and not drained.replica.migration_waiting

    run(scenario)


def test_draining_with_another_ready_replica_moves_its_streams_at_once():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        moved: list[str] = []
        for _ in range(2):
            stream_on(h, "alpha/0", moved)
        h.pool.lease(h.replica("alpha/0"))  # a request that cannot move (say n > 1)
        drained = h.pool.drain("alpha/0", migrate=True)
        assert moved == ["alpha/0", "alpha/0"] and not drained.replica.migration_waiting
        assert (drained.migrated_streams, drained.finishing_in_place) == (2, 1)

    run(scenario)


@pytest.mark.parametrize("how", ["scale_up", "undrain", "restart"])
def test_streams_waiting_on_a_drained_replica_move_once_another_is_ready(how):
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 1 if how == "scale_up" else 2)))
        await h.pool.tick()
        if how == "undrain":
            h.pool.drain("alpha/1")
        if how == "restart":
            h.launcher.latest("alpha/1").crash()
            await h.pool.tick()
        moved: list[str] = []
        stream_on(h, "alpha/0", moved)
        assert h.pool.drain("alpha/0", migrate=True).migrated_streams == 0
        await h.pool.tick()
        assert moved == []
        if how == "scale_up":
            await h.pool.apply(registry(model("alpha", 2)))
            await h.ticks(1)
        elif how == "undrain":
            h.pool.undrain("alpha/1")
        else:
            h.clock.advance(1.0)
            await h.ticks(2)  # relaunched after its backoff, then probed ready
        assert h.replica("alpha/1").state == READY
        assert moved == ["alpha/0"] and h.replica("alpha/0").outstanding == 0

    run(scenario, settings=PoolSettings(restart_backoff_s=0.5))


def test_a_drained_replica_that_stops_answering_moves_the_streams_waiting_on_it():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        moved: list[str] = []
        stream_on(h, "alpha/0", moved)
        h.pool.drain("alpha/0", migrate=True)
        h.replicas.set("alpha/0", "hang")
        await h.ticks(1)
        assert moved == []  # one failed probe is not enough
        await h.ticks(1)
        assert moved == ["alpha/0"]

    run(scenario, settings=PoolSettings(unhealthy_after=2))


@pytest.mark.parametrize("meanwhile", ["stream_finishes", "other_gets_ready"])
def test_scaling_down_beside_a_replica_not_ready_yet_moves_streams_only_once_it_is(meanwhile):
    """2 -> 1 while the replica that stays is still starting: the retired one's stream finishes there, unless the
    other gets ready first (the drain supervises it every probe interval), then it moves."""
    async def scenario(h: Harness) -> None:
        h.replicas.set("alpha/0", "not_ready")
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        assert h.states("alpha") == [STARTING, READY]
        moved: list[str] = []
        stream = stream_on(h, "alpha/1", moved)
        began = h.clock()

        def later(_: float) -> None:
            if h.clock() - began >= 5.0:
                if meanwhile == "stream_finishes":
                    stream.release()
                else:
                    h.replicas.set("alpha/0", "ok")

        h.sleep.on_sleep = later
        await h.pool.apply(registry(model("alpha", 1)))
        assert moved == ([] if meanwhile == "stream_finishes" else ["alpha/1"])
        assert h.launcher.latest("alpha/1").stopped and 5.0 <= sum(h.sleep.delays) < 10.0  # not the 30 s timeout

    run(scenario, settings=PoolSettings(drain_timeout_s=30.0, probe_interval_s=2.0))


def test_retiring_the_last_replica_moves_what_is_left_at_the_drain_timeout():
    """Scaled to zero, nowhere to go: the stream runs on until the drain times out, then goes on as a move (its
    continuation waits for a replica, as it would for a crash)."""
    moved_at: list[float] = []

    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        h.pool.lease(h.replica("alpha/0")).movable(lambda: moved_at.append(h.clock()))
        began = h.clock()
        await h.pool.apply(registry(model("alpha", 0)))
        assert len(moved_at) == 1 and moved_at[0] - began >= 3.0 and h.launcher.latest("alpha/0").stopped

    run(scenario, settings=PoolSettings(drain_timeout_s=3.0))


def test_a_rollout_of_a_lone_replica_without_room_for_two_lets_its_streams_finish_first():
    order: list[str] = []

    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        moved: list[str] = []
        stream = stream_on(h, "alpha/0", moved)
        began = h.clock()

        def later(_: float) -> None:
            if h.clock() - began >= 1.0 and h.replica("alpha/0").outstanding:
                order.append("finished")
                stream.release()

        h.sleep.on_sleep = later
        real_start = h.launcher.start

        async def start(request):  # type: ignore[no-untyped-def]
            order.append(f"start {request.index}")
            return await real_start(request)

        h.launcher.start = start  # type: ignore[method-assign]
        await h.pool.apply(registry(model("alpha", engine={"block_size": 32})))
        assert moved == [] and order == ["finished", "start 0"] and h.states("alpha") == [READY]

    run(scenario, placement_for=lambda spec, index: ReplicaPlacement(memory_fraction=0.4))


def test_replicas_that_crash_while_another_drains_are_restarted_meanwhile():
    """A scale-down drains its replica under the pool's lock (up to the drain timeout), so `tick` waits; the others
    are supervised from the drain's own wait, every probe interval: a crash there is restarted before it ends."""
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 3)))
        await h.pool.tick()
        h.replica("alpha/2").outstanding = 1  # a request that never finishes: the drain waits its full 30 s
        h.launcher.latest("alpha/0").crash()
        await h.pool.apply(registry(model("alpha", 2)))
        assert h.launcher.latest("alpha/2").stopped
        crashed = h.replica("alpha/0")
        assert crashed.restarts == 1 and len(h.launcher.handles_of("alpha/0")) == 2  # restarted within the drain
        assert crashed.state == READY and h.states("alpha") == [READY, READY]

    run(scenario, settings=PoolSettings(drain_timeout_s=30.0, probe_interval_s=2.0, restart_backoff_s=0.5))


def test_replicas_that_crash_while_a_removed_model_drains_are_restarted_meanwhile():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 1), model("beta", 2)))
        await h.pool.tick()
        for replica in h.group("beta").replicas:
            replica.outstanding = 1  # requests that never finish: the drain waits its full 30 s
        h.launcher.latest("alpha/0").crash()
        await h.pool.apply(registry(model("alpha", 1)))  # beta removed
        assert h.pool.group("beta") is None and h.launcher.latest("beta/0").stopped
        crashed = h.replica("alpha/0")
        assert crashed.restarts == 1 and len(h.launcher.handles_of("alpha/0")) == 2 and crashed.state == READY

    run(scenario, settings=PoolSettings(drain_timeout_s=30.0, probe_interval_s=2.0, restart_backoff_s=0.5))


def test_shutdown_stops_every_replica():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2), model("beta")))
        await h.pool.shutdown()
        assert h.pool.groups == {} and h.launcher.running() == []
        assert len(h.launcher.handles) == 3

    run(scenario)


# ------------------------------------------------------------------------------------ regressions


def test_a_replaced_group_does_not_inherit_a_pending_restart():
    """A crash schedules a restart; replacing the group (say, to fix the engine config) must not let that stale
    schedule relaunch the fresh replica of the same id and orphan the process it just started."""

    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        h.launcher.latest("alpha/0").crash()
        await h.pool.tick()  # restart scheduled in 0.5 s
        await h.pool.apply(registry(model("alpha", engine={"block_size": 32})))
        fresh = h.launcher.latest("alpha/0")
        h.clock.advance(1.0)
        await h.ticks(2)
        assert h.launcher.latest("alpha/0") is fresh  # not relaunched on top of itself
        assert h.launcher.running() == [fresh]
        assert h.states("alpha") == [READY]

    run(scenario, settings=PoolSettings(restart_backoff_s=0.5))


def test_a_replica_scaled_away_and_back_does_not_inherit_a_pending_restart():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha", 2)))
        await h.pool.tick()
        h.launcher.latest("alpha/1").crash()
        await h.pool.tick()
        await h.pool.apply(registry(model("alpha", 1)))
        await h.pool.apply(registry(model("alpha", 2)))
        fresh = h.launcher.latest("alpha/1")
        h.clock.advance(1.0)
        await h.ticks(2)
        assert h.launcher.latest("alpha/1") is fresh
        assert len(h.launcher.running("alpha")) == 2
        assert h.states("alpha") == [READY, READY]

    run(scenario, settings=PoolSettings(restart_backoff_s=0.5))


def test_a_lease_alone_counts_a_request_in_flight_and_feeds_the_breaker():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(model("alpha")))
        await h.pool.tick()
        replica = h.replica("alpha/0")
        async with h.pool.lease(replica) as lease:
            assert replica.outstanding == 1
            for _ in range(3):
                lease.failed()
            assert not replica.routable()  # the default breaker opens after 3 failures
            lease.release()
            lease.release()  # idempotent: a stream's relay and its error path may both release
            assert replica.outstanding == 0
        assert replica.outstanding == 0
        h.clock.advance(60.0)
        async with h.pool.lease(replica) as trial:  # half-open: one trial, whose success closes it again
            trial.succeeded()
        assert replica.routable() and h.pool.replicas() == [replica]

    run(scenario)
