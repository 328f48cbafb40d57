"""`multiserve serve`: the gateway process. It loads the registry, starts the pool's replicas, keeps
them supervised, watches the registry file, and shuts everything down cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import FrameType

import httpx
import structlog
import uvicorn
from starlette.applications import Starlette

from foundation.http.guard import guarded_config
from foundation.logs import configure_logging
from gateway.app import GatewayState, build_gateway, gateway_config_problems, secret_env_names
from gateway.httpclient import KeepAliveClient
from gateway.metrics import GatewayMetrics
from gateway.proxy import Forwarder, ProxySettings
from gateway.traffic import TrafficRecorder
from gateway.upstream import ByScheme, HttpxUpstream
from model_pool.command_launcher import CommandLauncher
from model_pool.launcher import Launcher, LocalLauncher, UrlLauncher
from model_pool.pool import ModelPool, PoolSettings
from model_pool.ray_launcher import RayCluster, RayLauncher, ray_problems
from model_pool.ray_plan import RayPlacer
from partitioner.applying.placements import PlacementApplier
from partitioner.planning.placer import ReplicaPlacer, arbiter_dir
from registry.errors import Problem
from registry.schema import GatewayConfig, ModelSpec, Registry, TrafficLogConfig
from registry.store import RegistryDiff, RegistryError, RegistryStore
from registry.watch import RegistryWatcher

log = structlog.get_logger(__name__)


def make_state(store: RegistryStore, pool_settings: PoolSettings | None = None,
               proxy_settings: ProxySettings | None = None, log_dir: Path | None = None,
               env: dict[str, str] | None = None, placer: PlacementApplier | None = None,
               ray_cluster: RayCluster | None = None, ray_placer: RayPlacer | None = None) -> GatewayState:
    """Everything the gateway needs, wired together (no I/O yet: `lifespan` starts it).

    `placer` gives each replica its plan entry (the pool's `placement_for`); by default it plans the registry onto
    this host's inventory (NVML, or the CPU), read when the first replica launches. `ray_cluster`: where `launcher:
    ray` models run (by default `gateway.ray` of the registry; connected when the first one starts).
    """
    env = dict(os.environ) if env is None else env
    gateway_cfg = store.registry.gateway
    # Connections to replicas are kept alive and pooled; no timeout here: each request sets its own.
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256), timeout=None)
    placer = placer or default_placer(lambda: store.registry, env)

    def secrets() -> set[str]:  # asked at each launch: the names can change with the registry
        return secret_env_names(store.registry.gateway)

    launcher = LocalLauncher(log_dir=log_dir, env_drop=secrets,
                             warm_workers=lambda: store.registry.gateway.warm_workers)
    ray_cluster = ray_cluster or RayCluster(gateway_cfg.ray)
    ray_placer = ray_placer or RayPlacer(lambda: store.registry, ray_cluster)
    launchers: dict[str, Launcher] = {
        "local": launcher, "url": UrlLauncher(), "ray": RayLauncher(ray_cluster, ray_placer),
        "command": CommandLauncher(log_dir=log_dir, env_drop=secrets)}
    pool = ModelPool(launchers, http, pool_settings, placement_for=placer, footprint_for=placer.footprint,
                     default_budget=placer.budget)
    metrics = GatewayMetrics(pool)
    metrics.add_time_shares(placer.shares)

    def resolve(model: str) -> ModelSpec | None:
        spec = store.registry.resolve(model)
        return spec if spec is not None and spec.enabled else None

    def known() -> list[str]:
        return sorted(k for k, name in store.registry.names_and_aliases().items()
                      if resolve(name) is not None)

    # the request hop: plain http:// replicas over the lean keep-alive client, others (https) through httpx
    upstream = ByScheme(KeepAliveClient(), HttpxUpstream(http))
    forwarder = Forwarder(pool, resolve, known, upstream, metrics, proxy_settings)
    state = GatewayState(store=store, pool=pool, forwarder=forwarder, metrics=metrics,
                         started_at=time.time(), traffic=_traffic_recorder(gateway_cfg.traffic), env=env)
    state.apply_gateway_config(gateway_cfg)
    return state


def _traffic_recorder(cfg: TrafficLogConfig) -> TrafficRecorder | None:
    return None if cfg.path is None else TrafficRecorder(cfg.path, cfg.max_bytes, cfg.backups)


def default_placer(registry: Callable[[], Registry], env: dict[str, str]) -> PlacementApplier:
    """Plans `registry()` onto this host's inventory (NVML, or the CPU), read on first use. A registry whose plan
    needs MIG devices or MPS daemons that do not exist is refused: `multiserve serve --apply-partition` (or
    `partition apply`) makes them first."""
    from partitioner.devices.read import load_host_inventory

    return PlacementApplier(ReplicaPlacer(registry, lambda: load_host_inventory(None, env), arbiter_dir(env),
                                          require_applied=True))


def lifespan_for(state: GatewayState, watch_interval_s: float = 1.0):
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.pool.apply(state.store.registry)
        local = state.pool.launchers.get("local")
        if isinstance(local, LocalLauncher):
            local.fill()  # the warm pool starts once the resident replicas have
        # What start-up made (the modules, torch's among them: ~200k objects) lives as long as the process: kept out
        # of the collector, a full collection no longer walks it, which paused the event loop ~120 ms each time.
        gc.collect()
        gc.freeze()
        applying: set[asyncio.Task[None]] = set()

        def on_change(diff: RegistryDiff) -> None:
            task = asyncio.create_task(state.apply_change(diff))
            applying.add(task)
            task.add_done_callback(applying.discard)

        def on_reject(err: RegistryError) -> None:
            log.error("registry_rejected", error=str(err))

        watcher = RegistryWatcher(state.store, interval_s=watch_interval_s, on_change=on_change, on_reject=on_reject)
        tasks = [asyncio.create_task(state.pool.run(), name="pool-supervisor"),
                 asyncio.create_task(watcher.run(), name="registry-watcher")]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, *applying, return_exceptions=True)
            await state.pool.shutdown()
            if isinstance(local, LocalLauncher):
                local.close()
            if isinstance(state.pool.placement_for, PlacementApplier):
                state.pool.placement_for.close()  # the replicas are gone: so are the arbiters they shared
            await state.forwarder.upstream.aclose()  # and with it the pool's httpx client
            log.info("gateway_stopped")

    return lifespan


def run_serve(config: str | Path, host: str | None = None, port: int | None = None,
              ray_address: str | None = None) -> int:
    configure_logging()  # structlog JSON lines, the same shape as the workers'
    env = dict(os.environ)
    # The placer reads the registry from the store, and the store asks the placer whether each registry (the
    # first, and every edit) can be placed on this host: an infeasible one is refused like an invalid one.
    placer = default_placer(lambda: store.registry, env)
    running: list[GatewayConfig] = []  # the gateway section it started with, once the first registry is read
    clusters: list[RayCluster] = []  # made from the first registry's gateway.ray (it cannot change while running)
    ray_placers: list[RayPlacer] = []  # the plan per node of the Ray models, on that cluster

    def check(registry: Registry) -> list[Problem]:
        problems = list(placer.problems(registry))
        if not clusters:
            clusters.append(RayCluster(registry.gateway.ray, ray_address))
            ray_placers.append(RayPlacer(lambda: store.registry, clusters[0]))
        # a cluster that cannot be reached, or resources no node has, first; then whether the nodes can be planned
        problems += ray_problems(registry, clusters[0]) or ray_placers[0].problems(registry)
        if running:  # an edit: some gateway fields cannot change while it runs
            problems += gateway_config_problems(running[0], registry.gateway, env)
        return problems

    try:
        store = RegistryStore(config, check=check)
    except RegistryError as err:
        print(f"error: {err}")
        return 2
    cfg = store.registry.gateway
    running.append(cfg)
    try:
        state = make_state(store, log_dir=Path(env.get("MULTISERVE_LOG_DIR", ".multiserve/logs")), env=env,
                           placer=placer, ray_cluster=clusters[0], ray_placer=ray_placers[0])
    except ValueError as err:  # API keys that do not parse
        print(f"error: gateway.api_keys_env: {err}")
        return 2
    app = build_gateway(state, lifespan=lifespan_for(state))
    server = uvicorn.Server(guarded_config(app, host=host or cfg.host, port=cfg.port if port is None else port,
                                           limits=cfg.http, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=30))
    # uvicorn handles SIGTERM/SIGINT (stop accepting, finish in-flight requests, then our lifespan stops the
    # pool), then re-raises the signal to the handler it found: make that a clean exit with status 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit_cleanly)
    try:
        server.run()
    except SystemExit as done:
        return int(done.code or 0)
    return 0


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)
