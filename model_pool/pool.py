"""Instance groups and replica lifecycle: launch, probe, supervise (restart with backoff, give up on a
crash loop), drain and stop. The registry says what should run; `apply()` makes it so.

A change to what a model's replicas run (source, engine settings, placement) is rolled out one replica at a time
with nothing in flight lost: where the placement allows a second copy (no device memory fraction, no time-slice
share) the new replica starts first, and the old one is drained with migration only once the new one is ready;
otherwise the old one is drained with migration first (its streams go on on the other replicas) and then replaced.
A new replica that does not become ready stops the rollout: the old replicas it would have replaced keep serving.
Scaling down drains with migration too.

A deliberate drain with migration (the admin's, a scale-down's, a rollout's) moves streams only where they can go
on: with no other routable replica in the group they finish where they are, and move once one is routable (or
when the drain times out, or the draining replica stops answering its probes). A replica found unhealthy has its
streams moved regardless: it will not finish them.

A replica whose process is alive but whose probes keep failing (hung, or its engine stuck: it reports itself
unready) is taken out of routing after `unhealthy_after` probes and restarted once it has been unhealthy for
`restart_unhealthy_after_s`; that counts as a crash, so a replica that keeps hanging ends up failed.

A model with `replicas: {min, max}` runs on demand: `min` replicas are kept, the first request to it while none is
ready starts one (`cold_start`, shared by every request that waits for it, outside the pool's lock), and a replica
idle for `scaling.idle_unload_s` is stopped, down to `min`. Every start (on demand or not) is admitted under its
device's memory budget (`model_pool/residency.py`): idle replicas of models on demand are evicted to make room,
least recently used first (by their second most recent request: `residency.eviction_key`); a cold start that
still does not fit waits for replicas in use to go idle, for `gateway.eviction_wait_s`, and is then refused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from model_pool.health import BreakerConfig, CircuitBreaker
from model_pool.launcher import Launcher
from model_pool.replica import Lease, Replica, ReplicaState
from model_pool.residency import (
    BudgetFor,
    FootprintFor,
    ResidencyStats,
    Room,
    budget_key_name,
    eviction_key,
    find_room,
    held_bytes,
    holders_text,
    holds,
)
from policies.retry import Backoff
from policies.routing import Candidate, RoutingPolicy, make_policy
from registry.fields import GIB, gib
from registry.launch import Footprint, ReplicaPlacement, replica_launch
from registry.schema import ModelSpec, Registry
from registry.store import diff_registries

log = structlog.get_logger(__name__)
PlacementFor = Callable[[ModelSpec, int], ReplicaPlacement]


@dataclass(frozen=True)
class PoolSettings:
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 2.0
    ready_timeout_s: float = 180.0  # a replica not ready this long after launch counts as a failed start
    unhealthy_after: int = 2  # consecutive failed probes before a ready replica is taken out
    restart_unhealthy_after_s: float = 30.0  # alive but unhealthy this long: stopped and restarted
    max_crashes: int = 5  # within crash_window_s: then the replica is marked failed, not restarted
    crash_window_s: float = 300.0
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    drain_timeout_s: float = 30.0
    rollout_poll_s: float = 0.25  # how often a rollout probes the replica it waits for
    breaker: BreakerConfig = field(default_factory=BreakerConfig)


@dataclass
class InstanceGroup:
    spec: ModelSpec
    routing: RoutingPolicy
    replicas: list[Replica] = field(default_factory=list)
    revision: int = 0  # rollouts so far: a rolled-out replica's id says which (`<model>/<index>-r<revision>`)
    rollout: dict[str, Any] = field(default_factory=dict)  # the last rollout's progress, for /health/models
    waiters: int = 0  # requests waiting for a cold start: the group is never evicted meanwhile
    starting: asyncio.Task[Replica] | None = None  # the cold start every waiting request shares
    last_unload: dict[str, Any] | None = None  # the last replica stopped for idleness or evicted, and why

    def replica_id(self, index: int) -> str:
        return f"{self.spec.name}/{index}" if self.revision == 0 else f"{self.spec.name}/{index}-r{self.revision}"


class ColdStartFailed(Exception):
    """A model on demand could not be started for a request: its replica exited or was not ready in time, or its
    device's memory budget had no room (`budget`). `retry_after_s`: when to try again."""

    def __init__(self, message: str, retry_after_s: float, budget: bool = False) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.budget = budget


@dataclass(frozen=True)
class Drained:
    """What `ModelPool.drain` did: streams asked to move now, and requests left in flight on the replica (they
    finish there; with migration and nowhere to go yet, its streams among them move once a replica can take them)."""

    replica: Replica
    migrated_streams: int
    finishing_in_place: int


@dataclass
class _Schedule:
    launched_at: dict[str, float] = field(default_factory=dict)
    restart_at: dict[str, float] = field(default_factory=dict)


class ModelPool:
    def __init__(
        self,
        launchers: Mapping[str, Launcher],
        http: httpx.AsyncClient,
        settings: PoolSettings | None = None,
        placement_for: PlacementFor | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        footprint_for: FootprintFor | None = None,
        default_budget: BudgetFor | None = None,
    ) -> None:
        self.launchers = launchers
        self.http = http
        self.settings = settings or PoolSettings()
        self.placement_for = placement_for or (lambda spec, index: ReplicaPlacement())
        self.clock = clock
        self.sleep = sleep
        self.groups: dict[str, InstanceGroup] = {}
        self._applied = Registry(models=[])  # what `apply` last made the pool match
        self._schedule = _Schedule()
        self._lock = asyncio.Lock()
        # what a replica holds of which device's budget (None: nothing known, nothing counted), and the budget of a
        # device the registry does not name (None: unlimited)
        self.footprint_for = footprint_for or (lambda spec, index: Footprint())
        self.default_budget = default_budget or (lambda device: None)
        self.stats = ResidencyStats()
        self._unloading: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------------------------ desired state

    async def apply(self, registry: Registry) -> None:
        """Start, stop, replace or resize groups so the pool matches the registry; unchanged ones are untouched.

        What to do is the store's diff (`registry.store.diff_registries`, which also decides what restarts) between
        the registry this pool last applied and `registry`: the pool never misses an edit, however the edits were
        batched or ordered on their way here."""
        async with self._lock:
            diff = diff_registries(self._applied, registry)
            self._applied = registry
            specs = {m.name: m for m in registry.models}
            for name in diff.removed:
                if name in self.groups:
                    await self._stop_group(self.groups.pop(name), supervise_others=True)
            touched = dict.fromkeys([*diff.added, *diff.changed, *(name for name, _, _ in diff.resized)])
            for name in touched:
                spec, group = specs[name], self.groups.get(name)
                if group is not None and not spec.enabled:
                    await self._stop_group(self.groups.pop(name), supervise_others=True)
                    group = None
                if not spec.enabled:
                    continue
                if group is None:
                    group = self.groups[name] = InstanceGroup(spec, _routing_policy(spec))
                elif (group.spec.policy.routing, group.spec.policy.load_bound) != (spec.policy.routing,
                                                                                   spec.policy.load_bound):
                    group.routing = _routing_policy(spec)
                group.spec = spec
                target = _target_count(group)
                if name in diff.relaunched:  # what its replicas run changed: fewer first, then roll, then more
                    await self._resize(group, min(target, len(_kept(group))))
                    await self._roll(group)
                await self._resize(group, target)

    async def _resize(self, group: InstanceGroup, count: int) -> None:
        live = _kept(group)
        for _ in range(len(live), count):
            replica = self._new_replica(group, _free_index(group))
            await self._make_room(group, replica)
            group.replicas.append(replica)
            await self._launch(group, replica)
        for replica in sorted(live, key=lambda r: r.index)[count:]:
            await self._retire(group, replica)

    async def _make_room(self, group: InstanceGroup, replica: Replica) -> None:
        """Room under the budget for a replica the registry wants resident (the caller holds the lock): idle
        replicas of models on demand are evicted first, least recently used first, then those in use (their streams
        move or finish, as in a scale-down): a resident model's place comes before a model called on demand. The
        registry check has refused resident replicas that do not fit together; a replica whose footprint is larger
        than the estimate made room for starts anyway, logged."""
        replica.footprint = footprint = self.footprint_for(group.spec, replica.index)

        def room(idle_only: bool) -> Room:
            return find_room(footprint, self._budget(footprint.device), self.replicas(),
                             self._evictable(group, idle_only=idle_only))

        # replicas the pool is stopping (unloaded in the background) free their share first; they stop within their
        # drain timeout
        deadline = self.clock() + self.settings.drain_timeout_s + 15.0
        await self._wait_supervising(lambda: room(idle_only=False).wait and self.clock() < deadline, supervise=True)
        for idle_only in (True, False):
            found = room(idle_only)
            if found.fits:
                await asyncio.gather(*(self._unload(v, "evicted", wait=True) for v in found.victims))
                return
        log.warning("replica_over_budget", replica=replica.replica_id, device=footprint.device,
                    needs=gib(footprint.bytes or 0), budget=gib(self._budget(footprint.device) or 0))

    def _budget(self, device: str) -> int | None:
        """A device's budget: the registry's `gateway.memory_budget_gib` entry, else `default_budget`'s."""
        given = self._applied.gateway.memory_budget_gib.get(device)
        return int(given * GIB) if given is not None else self.default_budget(device)

    def _evictable(self, group: InstanceGroup, idle_only: bool) -> list[Replica]:
        """Replicas that may be stopped to make room for one of `group`: ready replicas of the other models on
        demand that are not pinned and have no request waiting for a cold start, above their model's resident
        floor (the first in `eviction_key` order), idle if `idle_only`."""
        victims = []
        for other in self.groups.values():
            if other is group or not other.spec.on_demand or other.spec.scaling.pinned or other.waiters:
                continue
            running = _running(other)
            candidates = [r for r in running if r.outstanding == 0 or not idle_only]
            victims += sorted(candidates, key=eviction_key)[:_spare(other, running)]
        return victims

    def _unload(self, replica: Replica, reason: str, wait: bool = False) -> Awaitable[None]:
        """Stop a replica of a model on demand (`idle` or `evicted`): out of routing now, its streams moved or
        finished as in a scale-down, then its process stopped and the replica dropped from its group. It holds its
        budget until its process is gone. Runs in the background (tracked for shutdown) unless the caller awaits
        what this returns (`wait`: the caller holds the lock, so the others are supervised meanwhile)."""
        group = self.groups.get(replica.model)
        replica.stopping = True
        replica.set_state(ReplicaState.DRAINING, self.clock())
        self.stats.unloads[(replica.model, reason)] += 1
        if group is not None:
            group.last_unload = {"replica": replica.replica_id, "reason": reason, "at": time.time()}
        log.info("replica_unloading", replica=replica.replica_id, reason=reason,
                 idle_s=round(self.clock() - replica.last_used, 1), memory=gib(replica.footprint.bytes or 0))

        async def unload() -> None:
            await self.stop_replica(replica, migrate=True, supervise_others=wait)
            if group is not None and replica in group.replicas:
                group.replicas.remove(replica)

        if wait:
            return unload()
        task = asyncio.create_task(unload())
        self._unloading.add(task)
        task.add_done_callback(self._unloading.discard)
        return task

    def _unload_idle(self) -> None:
        """Stop the replicas of models on demand that have had no request for `scaling.idle_unload_s`, least
        recently used first, down to each model's resident floor (the caller holds the lock)."""
        now = self.clock()
        for group in self.groups.values():
            scaling = group.spec.scaling
            if not group.spec.on_demand or scaling.idle_unload_s is None or scaling.pinned or group.waiters:
                continue
            running = _running(group)
            idle = sorted((r for r in running if r.outstanding == 0 and now - r.last_used >= scaling.idle_unload_s),
                          key=lambda r: r.last_used)
            for replica in idle[:_spare(group, running)]:
                self._unload(replica, "idle")

    def _residency_view(self, group: InstanceGroup) -> dict[str, Any]:
        """For /health/models: whether the model runs on demand and is resident, starting, cold or evicted."""
        spec = group.spec
        if any(r.state == ReplicaState.READY for r in group.replicas):
            residency = "resident"
        elif any(holds(r) for r in group.replicas) or (group.starting is not None and not group.starting.done()):
            residency = "starting"
        else:
            evicted = group.last_unload is not None and group.last_unload["reason"] == "evicted"
            residency = "evicted" if evicted else "cold"
        view: dict[str, Any] = {"on_demand": spec.on_demand, "residency": residency}
        if spec.on_demand:
            view |= {"replicas_min": spec.resident_replicas, "replicas_max": spec.max_replicas,
                     "pinned": spec.scaling.pinned, "idle_unload_s": spec.scaling.idle_unload_s,
                     "waiting_for_cold_start": group.waiters, "last_unload": group.last_unload}
        return view

    # ------------------------------------------------------------------------------------ cold starts

    async def cold_start(self, group: InstanceGroup) -> Replica:
        """A ready replica for a model on demand with none routable: started now, or the start already under way
        for another request (one start for them all). Waits up to `scaling.cold_start_timeout_s`, without holding
        the pool's lock; raises `ColdStartFailed` (with when to retry) if it is not ready by then, its process
        exits, or its device's budget has no room. A timed-out wait leaves the start going for later requests."""
        spec = group.spec
        if group.starting is None or group.starting.done():
            group.starting = asyncio.create_task(self._start_on_demand(group))
            group.starting.add_done_callback(_retrieve)
        group.waiters += 1
        try:
            return await asyncio.wait_for(asyncio.shield(group.starting), spec.scaling.cold_start_timeout_s)
        except asyncio.TimeoutError:
            raise ColdStartFailed(
                f"model {spec.name!r} was not ready within scaling.cold_start_timeout_s = "
                f"{spec.scaling.cold_start_timeout_s:g} s (its start goes on)",
                retry_after_s=5.0) from None
        finally:
            group.waiters -= 1

    async def _start_on_demand(self, group: InstanceGroup) -> Replica:
        """The one cold start of `group`: admit a replica under its device's budget (evicting idle replicas, least
        recently used first; waiting up to `gateway.eviction_wait_s` for those in use to go idle), launch it, and
        probe it until it is ready."""
        name = group.spec.name
        deadline = self.clock() + self._applied.gateway.eviction_wait_s
        try:
            replica, launched = await self._admit(group, deadline)
            if replica.state != ReplicaState.READY:  # probed often: the requests waiting for it are served at once
                failure = await self._await_ready(replica, supervise=False, poll_s=0.05)
                if failure is not None:  # (the supervisor restarts an exited one, as any crash)
                    raise ColdStartFailed(f"replica {replica.replica_id} {failure}", 5.0)
        except ColdStartFailed as err:
            self.stats.cold_starts[(name, "refused" if err.budget else "failed")] += 1
            log.warning("cold_start_failed", model=name, reason=str(err))
            raise
        if launched:
            self.stats.cold_starts[(name, "ok")] += 1
        return replica

    async def _admit(self, group: InstanceGroup, deadline: float) -> tuple[Replica, bool]:
        """A replica of `group` that is ready or starting: one already there (False), or a new one launched once
        its footprint fits its device's budget (True). A ready one that is not routable (its breaker is open) is
        returned as it is: the request fails over at once rather than waiting for a start that cannot happen."""
        while True:
            async with self._lock:
                spec = group.spec
                if self.groups.get(spec.name) is not group:
                    raise ColdStartFailed(f"model {spec.name!r} was removed or disabled while it started", 1.0)
                pending = [r for r in group.replicas if not r.manually_drained and r.state in (
                    ReplicaState.READY, ReplicaState.STARTING, ReplicaState.UNHEALTHY)]
                if pending:
                    return next((r for r in pending if r.routable()), pending[0]), False
                failed = next((r for r in group.replicas if r.state == ReplicaState.FAILED), None)
                if failed is not None:
                    raise ColdStartFailed(f"replica {failed.replica_id} failed (it crashed repeatedly); fix the "
                                          f"model and edit the registry to start it again", 30.0)
                if len(_live(group)) >= spec.max_replicas:  # its replicas are all draining: wait for them to stop
                    if self.clock() >= deadline:
                        draining = ", ".join(r.replica_id for r in _live(group))
                        raise ColdStartFailed(f"every replica it may run ({spec.max_replicas}) is draining "
                                              f"({draining}); undrain one, or raise replicas.max", 5.0)
                else:
                    replica = self._new_replica(group, _free_index(group))
                    replica.footprint = footprint = self.footprint_for(spec, replica.index)
                    budget = self._budget(footprint.device)
                    room = find_room(footprint, budget, self.replicas(), self._evictable(group, idle_only=True))
                    if room.fits and not room.victims:
                        group.replicas.append(replica)
                        await self._launch(group, replica)
                        if replica.handle is None:
                            raise ColdStartFailed(f"replica {replica.replica_id} could not be launched", 5.0)
                        log.info("cold_start", replica=replica.replica_id, device=footprint.device,
                                 memory=gib(footprint.bytes or 0))
                        return replica, True
                    for victim in room.victims:  # they hold the budget until stopped: admitted on a later pass
                        self._unload(victim, "evicted")
                    if not room.fits and self.clock() >= deadline:
                        raise ColdStartFailed(
                            f"no room for model {spec.name!r} ({gib(footprint.bytes or 0)}) under "
                            f"{budget_key_name(footprint.device)} = {gib(budget or 0)}: held by "
                            f"{holders_text(self.replicas(), footprint.device, self._pinned)}; waited "
                            f"{self._applied.gateway.eviction_wait_s:g} s (gateway.eviction_wait_s) for one to go "
                            f"idle", 5.0, budget=True)
            await self.sleep(0.05)

    def _pinned(self, replica: Replica) -> bool:
        group = self.groups.get(replica.model)
        return group is not None and (not group.spec.on_demand or group.spec.scaling.pinned)

    def _new_replica(self, group: InstanceGroup, index: int) -> Replica:
        return Replica(group.replica_id(index), group.spec.name, index,
                       CircuitBreaker(self.settings.breaker, self.clock))

    async def _roll(self, group: InstanceGroup) -> None:
        """Replace every live replica of `group` by one running `group.spec`, one at a time (see the module)."""
        old_replicas = sorted(_kept(group), key=lambda r: r.index)
        if not old_replicas:
            return
        group.revision += 1
        group.rollout = {"revision": group.revision, "state": "rolling", "replaced": 0, "of": len(old_replicas)}
        log.info("rollout_started", model=group.spec.name, revision=group.revision, replicas=len(old_replicas))
        for old in old_replicas:
            placement = self.placement_for(group.spec, old.index)
            # Two copies side by side only on the CPU and outside a time-slice: on a GPU the new replica would size
            # its KV cache from what the old one leaves free (or overrun the plan's share of the device).
            surge = group.spec.device == "cpu" and placement.arbiter_socket is None
            new = self._new_replica(group, old.index)
            if not surge:  # no room for both: the old one's streams move to the others first
                await self._retire(group, old)
            await self._make_room(group, new)  # counted under its device's budget, as any start
            group.replicas.append(new)
            await self._launch(group, new, placement)
            if await self._await_ready(new) is not None:
                kept = "the replicas after it keep"
                if surge:  # the old one never left: it stays, the new one goes
                    await self._retire(group, new)
                    kept = f"{old.replica_id} and {kept}"
                group.rollout["state"] = "failed"
                group.rollout["reason"] = (f"replica {new.replica_id} exited or was not ready within "
                                           f"{new.ready_timeout_s:g} s; {kept} their old settings")
                log.error("rollout_failed", model=group.spec.name, replica=new.replica_id, surge=surge,
                          output=_output_tail(new))
                return
            if surge:
                await self._retire(group, old)
            group.rollout["replaced"] += 1
        group.rollout["state"] = "done"
        log.info("rollout_done", model=group.spec.name, revision=group.revision)

    async def _await_ready(self, replica: Replica, supervise: bool = True, poll_s: float | None = None
                           ) -> str | None:
        """Probe `replica` every `poll_s` (default `rollout_poll_s`) until it is ready (None), or it exits or its
        ready timeout passes (why it is not ready, for messages). With `supervise` (the caller holds the lock, as a
        rollout does) the pool's other replicas are supervised meanwhile, as `tick` would (it waits for that lock)."""
        deadline = self.clock() + replica.ready_timeout_s
        next_tick = self.clock() + self.settings.probe_interval_s
        while True:
            if replica.handle is None or replica.handle.exit_code() is not None:
                tail = _output_tail(replica).strip().splitlines()[-1:] or [""]
                return f"exited while starting: {tail[0]}".rstrip(": ")
            await self._probe(replica)
            if replica.state == ReplicaState.READY:
                return None
            if self.clock() >= deadline:
                return f"was not ready within {replica.ready_timeout_s:g} s of its launch"
            if supervise and self.clock() >= next_tick:
                await self._supervise_all(skip=replica)
                next_tick = self.clock() + self.settings.probe_interval_s
            await self.sleep(self.settings.rollout_poll_s if poll_s is None else poll_s)

    async def _launch(self, group: InstanceGroup, replica: Replica, placement: ReplicaPlacement | None = None) -> None:
        """Start the replica's process. A launcher that cannot (a Ray cluster that does not place the actor in time)
        makes it a crashed replica: restarted with backoff, failed after a crash loop."""
        spec = group.spec
        if placement is None:
            placement = self.placement_for(spec, replica.index)
        replica.handle = None
        try:
            replica.handle = await self.launchers[spec.launcher].start(
                replica_launch(spec, replica.index, placement, self._applied))
        except Exception as err:
            log.error("replica_launch_failed", replica=replica.replica_id, error=str(err))
            await self._on_crash(replica, None)
            return
        replica.probe_path = spec.command.probe_path if spec.command is not None else "/ready"
        replica.ready_timeout_s = (spec.command.ready_timeout_s if spec.command is not None
                                   else self.settings.ready_timeout_s)
        replica.set_state(ReplicaState.STARTING, self.clock())
        replica.last_used = self.clock()
        self._schedule.launched_at[replica.replica_id] = self.clock()
        log.info("replica_launched", replica=replica.replica_id, url=replica.display_url)

    async def _retire(self, group: InstanceGroup, replica: Replica) -> None:
        """Stop a replica the group no longer wants, its streams moved to the others first. The caller holds the
        lock, so the others are supervised while it drains (as `tick` would: it waits for that lock)."""
        await self.stop_replica(replica, migrate=True, supervise_others=True)
        if replica in group.replicas:  # (an unload that ran alongside may have dropped it already)
            group.replicas.remove(replica)

    async def _stop_group(self, group: InstanceGroup, supervise_others: bool = False) -> None:
        """Stop every replica of a group, draining them together. `supervise_others` (the group is out of the pool
        and the caller holds the lock): the pool's remaining replicas are supervised every probe interval while they
        drain, as in `stop_replica`. Never at shutdown, where everything is stopping."""
        stops = asyncio.gather(*(self.stop_replica(r) for r in group.replicas))
        if supervise_others:
            await self._wait_supervising(lambda: not stops.done(), supervise=True)
        await stops
        group.replicas.clear()

    async def stop_replica(self, replica: Replica, migrate: bool = False, supervise_others: bool = False) -> None:
        """Drain (no new requests; in-flight ones finish up to the deadline, or with `migrate` the streams that
        can go on elsewhere move: at once if another replica can take them, see `_migrate`; those still waiting at
        the deadline move then), then stop the process. `supervise_others` (the caller holds the lock and stops one
        replica at a time): a supervision pass over the rest every probe interval while it drains, so a replica
        that crashes meanwhile is not left down for up to the drain timeout (and one that gets ready can take the
        streams waiting to move)."""
        # Forget its schedule: a pending restart must not fire on a later replica that reuses the id.
        self._schedule.restart_at.pop(replica.replica_id, None)
        self._schedule.launched_at.pop(replica.replica_id, None)
        replica.stopping = True
        replica.set_state(ReplicaState.DRAINING, self.clock())
        if migrate:
            moved = self._migrate(replica)
            log.info("replica_draining", replica=replica.replica_id, migrated_streams=moved,
                     migration_waiting=replica.migration_waiting)
        deadline = self.clock() + self.settings.drain_timeout_s
        await self._wait_supervising(lambda: replica.outstanding > 0 and self.clock() < deadline,
                                     supervise=supervise_others, skip=replica)
        if replica.migration_waiting:  # timed out waiting: moved, not broken by the stop (they wait for a replica)
            self._move_streams(replica, "drain_timeout")
        if replica.handle is not None:
            await replica.handle.stop(timeout_s=10.0)
        replica.set_state(ReplicaState.STOPPED, self.clock())
        log.info("replica_stopped", replica=replica.replica_id)

    async def _wait_supervising(self, waiting: Callable[[], bool], supervise: bool,
                                skip: Replica | None = None) -> None:
        """Poll until `waiting()` is false; with `supervise` (the caller holds the lock, so `tick` cannot run), a
        supervision pass over the replicas but `skip` every probe interval meanwhile."""
        next_tick = self.clock() + self.settings.probe_interval_s
        while waiting():
            await self.sleep(0.05)
            if supervise and waiting() and self.clock() >= next_tick:
                await self._supervise_all(skip=skip)
                next_tick = self.clock() + self.settings.probe_interval_s

    async def shutdown(self) -> None:
        starting = [g.starting for g in self.groups.values() if g.starting is not None and not g.starting.done()]
        for task in starting:  # no cold start launches anything from here on
            task.cancel()
        await asyncio.gather(*starting, *self._unloading, return_exceptions=True)
        async with self._lock:
            await asyncio.gather(*(self._stop_group(g) for g in self.groups.values()))
            self.groups.clear()
            self._applied = Registry(models=[])

    # ------------------------------------------------------------------------------------ supervision

    async def run(self) -> None:
        """Supervise forever: one `tick()` every probe interval; between two, every `rollout_poll_s`, a quick pass
        (`_quick_pass`) over the replicas still starting and the restarts that are due, as a rollout polls the
        replica it waits for: a replica serves as soon as it is ready, and a crashed one starts again when its
        backoff ends, not up to a probe interval later. Ready replicas are probed once per interval only (their
        `unhealthy_after` counts those probes)."""
        while True:
            await self.tick()
            next_tick = self.clock() + self.settings.probe_interval_s
            while (left := next_tick - self.clock()) > 0:
                await self.sleep(min(left, self.settings.rollout_poll_s))
                if self.clock() < next_tick:
                    await self._quick_pass()

    async def _quick_pass(self) -> None:
        """Supervise only the replicas that are starting, or whose restart is due (the caller sleeps between)."""
        async with self._lock:
            now = self.clock()
            due = [(g, r) for g in self.groups.values() for r in g.replicas
                   if r.state == ReplicaState.STARTING or self._schedule.restart_at.get(r.replica_id, now + 1) <= now]
            if due:
                await asyncio.gather(*(self._supervise(g, r) for g, r in due))
                self._move_waiting()

    async def tick(self) -> None:
        """One pass: restart what crashed (with backoff), probe everything else, unload what has been idle."""
        async with self._lock:
            await self._supervise_all()
            self._unload_idle()

    async def _supervise_all(self, skip: Replica | None = None) -> None:
        """One supervision pass over every replica but `skip` (the caller holds the lock)."""
        replicas = [(g, r) for g in self.groups.values() for r in g.replicas if r is not skip]
        await asyncio.gather(*(self._supervise(g, r) for g, r in replicas))
        self._move_waiting()

    async def _supervise(self, group: InstanceGroup, replica: Replica) -> None:
        if replica.state in (ReplicaState.STOPPED, ReplicaState.FAILED):
            return
        now = self.clock()
        restart_at = self._schedule.restart_at.get(replica.replica_id)
        if restart_at is not None:
            if now >= restart_at:
                del self._schedule.restart_at[replica.replica_id]
                await self._launch(group, replica)
            return
        handle = replica.handle
        exited = None if handle is None else handle.exit_code()
        started = self._schedule.launched_at.get(replica.replica_id, now)
        if exited is not None or (replica.state == ReplicaState.STARTING
                                  and now - started > replica.ready_timeout_s):
            await self._on_crash(replica, exited)
            return
        await self._probe(replica)
        unhealthy_since = replica.unhealthy_since
        if unhealthy_since is not None and now - unhealthy_since >= self.settings.restart_unhealthy_after_s:
            log.warning("replica_hung", replica=replica.replica_id, unhealthy_s=round(now - unhealthy_since, 1))
            await self._on_crash(replica, None)  # alive but useless: stop it and start afresh

    async def _on_crash(self, replica: Replica, exit_code: int | None) -> None:
        now = self.clock()
        if replica.handle is not None and exit_code is None:
            await replica.handle.stop(timeout_s=5.0)  # hung start: make sure it is gone
        replica.crash_times.append(now)
        recent = [t for t in replica.crash_times if now - t <= self.settings.crash_window_s]
        replica.consecutive_failures += 1
        if len(recent) >= self.settings.max_crashes:
            replica.set_state(ReplicaState.FAILED, now)
            log.error("replica_failed", replica=replica.replica_id, crashes=len(recent), exit_code=exit_code,
                      output=_output_tail(replica))
            return
        delay = Backoff(self.settings.restart_backoff_s, self.settings.restart_backoff_max_s).delay_s(len(recent))
        replica.restarts += 1
        replica.set_state(ReplicaState.UNHEALTHY, now)
        self._schedule.restart_at[replica.replica_id] = now + delay
        log.warning("replica_crashed", replica=replica.replica_id, exit_code=exit_code, restart_in_s=delay,
                    output=_output_tail(replica))

    async def _probe(self, replica: Replica) -> None:
        now = self.clock()
        try:
            response = await self.http.get(f"{replica.base_url}{replica.probe_path}", headers=replica.auth_headers(),
                                           timeout=self.settings.probe_timeout_s)
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        replica.last_probe_at, replica.last_probe_ok = time.time(), ok
        if ok:
            replica.consecutive_failures = 0
            replica.breaker.record_success()
            if replica.state in (ReplicaState.STARTING, ReplicaState.UNHEALTHY) and not replica.manually_drained:
                replica.set_state(ReplicaState.READY, now)
                replica.last_used = now  # idle from now on, however long its start took
            return
        replica.consecutive_failures += 1
        if replica.state == ReplicaState.READY:
            replica.breaker.record_failure()
            if replica.consecutive_failures >= self.settings.unhealthy_after:
                replica.set_state(ReplicaState.UNHEALTHY, now)
                moved = replica.migrate_streams()  # a hung replica's streams go on elsewhere, not wait for it
                log.warning("replica_unhealthy", replica=replica.replica_id, migrated_streams=moved)
        elif replica.migration_waiting and replica.consecutive_failures >= self.settings.unhealthy_after:
            self._move_streams(replica, "unresponsive")  # drained and hung: it will not finish them either

    # ------------------------------------------------------------------------------------ migration

    def _migrate(self, replica: Replica) -> int:
        """A deliberate drain's migration: the replica's streams move now if another replica of its group can take
        them (`has_migration_target`); else they stay to finish here, waiting to move once one can
        (`_move_waiting`). Returns how many were asked to move."""
        group = self.groups.get(replica.model)
        if group is not None and has_migration_target(group.replicas, replica):
            return replica.migrate_streams()
        replica.migration_waiting = True
        return 0

    def _move_waiting(self) -> None:
        """The streams waiting on a replica drained with migration move once another of its group can take them:
        a scale-up, a restart or an undrain made one routable."""
        for group in self.groups.values():
            for replica in group.replicas:
                if replica.migration_waiting and has_migration_target(group.replicas, replica):
                    self._move_streams(replica, "replica_ready")

    def _move_streams(self, replica: Replica, reason: str) -> None:
        moved = replica.migrate_streams()
        if moved:
            log.info("drained_streams_moved", replica=replica.replica_id, migrated_streams=moved, reason=reason)

    # ------------------------------------------------------------------------------------ routing support

    def group(self, name: str) -> InstanceGroup | None:
        return self.groups.get(name)

    def choose(self, group: InstanceGroup, exclude: set[str], key: str | None = None) -> Replica | None:
        """A routable replica not yet tried for this request, by the group's routing policy."""
        live = [r for r in group.replicas if r.replica_id not in exclude and r.routable()]
        if not live:
            return None
        by_id = {r.replica_id: r for r in live}
        pick = group.routing.choose([Candidate(r.replica_id, r.outstanding) for r in live], key)
        return by_id[pick.replica_id]

    def lease(self, replica: Replica) -> Lease:
        """A request's hold on `replica` (in flight until released; its outcome feeds the breaker). It marks the
        replica used, at its start and its end (idle unload and eviction go by that)."""
        return Lease(replica, self.clock)

    def replicas(self) -> list[Replica]:
        """Every replica of every group, in group order (for metrics and health views)."""
        return [r for g in self.groups.values() for r in g.replicas]

    def find_replica(self, replica_id: str) -> Replica | None:
        return next((r for g in self.groups.values() for r in g.replicas if r.replica_id == replica_id), None)

    def drain(self, replica_id: str, migrate: bool = False) -> Drained | None:
        """No new requests for the replica; with `migrate`, its movable streams go on on other replicas: now if
        another replica of its group can take them, else once one can (meanwhile they go on here)."""
        replica = self.find_replica(replica_id)
        if replica is None:
            return None
        replica.manually_drained = True
        replica.set_state(ReplicaState.DRAINING, self.clock())
        in_flight = replica.outstanding  # (before the moves: a moved stream counts until its relay lets go)
        moved = self._migrate(replica) if migrate else 0
        drained = Drained(replica, moved, max(in_flight - moved, 0))
        log.info("replica_drained", replica=replica_id, migrate=migrate, migrated_streams=moved,
                 finishing_in_place=drained.finishing_in_place, migration_waiting=replica.migration_waiting)
        return drained

    def undrain(self, replica_id: str) -> Replica | None:
        """Takes requests again: its own streams waiting to move stay, and those waiting on another replica drained
        with migration may now move to it."""
        replica = self.find_replica(replica_id)
        if replica is not None and replica.manually_drained:
            replica.manually_drained = False
            replica.migration_waiting = False
            replica.set_state(ReplicaState.READY if replica.last_probe_ok else ReplicaState.STARTING, self.clock())
            self._move_waiting()
        return replica

    def health(self) -> dict[str, Any]:
        return {name: {"replicas": [r.snapshot() for r in g.replicas],
                       "ready_replicas": sum(r.state == ReplicaState.READY for r in g.replicas),
                       "engine": g.spec.engine.model_dump(mode="json"), "rollout": g.rollout or None,
                       **self._residency_view(g)}
                for name, g in self.groups.items()}

    def memory(self) -> dict[str, dict[str, Any]]:
        """Per device with a budget or a replica counted on it: the budget and what is held (bytes)."""
        replicas = self.replicas()
        devices = {r.footprint.device for r in replicas if r.footprint.bytes is not None}
        devices |= set(self._applied.gateway.memory_budget_gib)
        return {device: {"budget_bytes": self._budget(device), "held_bytes": held_bytes(replicas, device)}
                for device in sorted(devices)}


def _output_tail(replica: Replica) -> str:
    """The last lines its process wrote, for the log line that says it failed ("" when there is none to read)."""
    return "" if replica.handle is None else replica.handle.output_tail()


def has_migration_target(group_replicas: Iterable[Replica], replica: Replica) -> bool:
    """Whether a deliberate drain moves `replica`'s streams now: only if another replica of its group can take them.
    With nowhere to go they would wait `resume_wait_s` for one and then be cut, though `replica` could have finished
    them."""
    return any(other is not replica and other.routable() for other in group_replicas)


def _live(group: InstanceGroup) -> list[Replica]:
    return [r for r in group.replicas if r.state != ReplicaState.STOPPED]


def _kept(group: InstanceGroup) -> list[Replica]:
    """The live replicas the pool is not stopping (a replica unloaded in the background is on its way out)."""
    return [r for r in _live(group) if not r.stopping]


def _running(group: InstanceGroup) -> list[Replica]:
    """Its ready replicas in service (not drained): those idle unload and eviction may stop."""
    return [r for r in group.replicas if r.state == ReplicaState.READY and not r.manually_drained]


def _spare(group: InstanceGroup, running: list[Replica]) -> int:
    """How many of its `running` replicas may stop: those above its resident floor."""
    return max(len(running) - group.spec.resident_replicas, 0)


def _free_index(group: InstanceGroup) -> int:
    """The smallest replica index no live replica of `group` has (replicas on demand come and go)."""
    taken = {r.index for r in _live(group)}
    return next(i for i in range(len(taken) + 1) if i not in taken)


def _target_count(group: InstanceGroup) -> int:
    """How many replicas `apply` keeps: the count; on demand, those running now (not draining), kept within
    `[min, max]` (at least one when pinned)."""
    spec = group.spec
    if not spec.on_demand:
        return spec.max_replicas
    running = len(_kept(group))
    return min(max(running, spec.resident_replicas), spec.max_replicas)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """A cold start nobody waits for any more may fail: its exception is read here, not reported as lost."""
    if not task.cancelled():
        task.exception()


def _routing_policy(spec: ModelSpec) -> RoutingPolicy:
    return make_policy(spec.policy.routing, spec.policy.load_bound)
