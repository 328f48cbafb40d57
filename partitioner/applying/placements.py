"""The pool's `placement_for`: a replica's placement as `planning.placer.ReplicaPlacer` decided it, with the arbiter
it names running before the replica launches. Decide there, execute here.

The arbiter services (`timeslice.service.ArbiterService`, a Unix socket and a thread each) run in the pool's
process, one per time-shared device, started when the first placement naming it is handed out and closed together
when the pool is done (`close`). Their clients' shares are what the gateway's metrics export (`shares`).
"""

from __future__ import annotations

import threading

from partitioner.planning.placer import ArbiterStart, ReplicaPlacer
from partitioner.timeslice.arbiter import ClientShare
from partitioner.timeslice.service import ArbiterService
from registry.errors import Problem
from registry.launch import Footprint, ReplicaPlacement
from registry.schema import ModelSpec, Registry


class PlacementApplier:
    """Hands out `placer`'s placements (`__call__`, the pool's hook), starting the arbiters they name; `problems` is
    the placer's (the registry store's check)."""

    def __init__(self, placer: ReplicaPlacer) -> None:
        self.placer = placer
        self._services: dict[str, ArbiterService] = {}
        self._lock = threading.Lock()  # scrapes read the services from other threads

    def __call__(self, spec: ModelSpec, index: int) -> ReplicaPlacement:
        placed = self.placer.place(spec, index)
        if placed.arbiter is not None:
            self.start(placed.arbiter)
        return placed.placement

    def problems(self, registry: Registry) -> list[Problem]:
        return self.placer.problems(registry)

    def footprint(self, spec: ModelSpec, index: int) -> Footprint:
        return self.placer.footprint(spec, index)

    def budget(self, device: str) -> int | None:
        return self.placer.budget(device)

    def start(self, arbiter: ArbiterStart) -> ArbiterService:
        """The service of `arbiter`'s device, started now unless it already runs."""
        with self._lock:
            service = self._services.get(arbiter.device_key)
            if service is None:
                service = ArbiterService(arbiter.socket_path, arbiter.device_key).start()
                self._services[arbiter.device_key] = service
            return service

    def shares(self) -> dict[str, list[ClientShare]]:
        """Each arbitrated device's clients and what they got."""
        with self._lock:
            services = dict(self._services)
        return {key: service.shares() for key, service in sorted(services.items())}

    def close(self) -> None:
        """Stop every arbiter (the replicas that shared them are gone)."""
        with self._lock:
            services, self._services = list(self._services.values()), {}
        for service in services:
            service.close()
