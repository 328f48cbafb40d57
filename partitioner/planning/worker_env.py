"""A worker's plan entry, as the pool passes it: environment variables, read here (standard library only).

The pool's `placer.ReplicaPlacer` writes them; `multiserve worker` reads them with `worker_settings` and hands
the engine a step gate (`arbiter_client.LeaseClient`) and the worker a memory fraction and KV budget.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

ARBITER_SOCKET_ENV = "MULTISERVE_ARBITER_SOCKET"
ARBITER_WEIGHT_ENV = "MULTISERVE_ARBITER_WEIGHT"
ARBITER_CLIENT_ENV = "MULTISERVE_ARBITER_CLIENT"
MEMORY_FRACTION_ENV = "MULTISERVE_MEMORY_FRACTION"
KV_CACHE_BYTES_ENV = "MULTISERVE_KV_CACHE_BYTES"
T = TypeVar("T")


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker takes from its plan entry (its environment)."""

    arbiter_socket: str | None = None
    arbiter_client: str | None = None
    arbiter_weight: float = 1.0
    memory_fraction: float | None = None
    kv_cache_bytes: int | None = None


def worker_settings(env: Mapping[str, str] = os.environ) -> WorkerSettings:
    """Read a worker's plan entry from its environment. Raises ValueError naming a malformed variable."""
    weight = _parse(env, ARBITER_WEIGHT_ENV, float)
    return WorkerSettings(arbiter_socket=env.get(ARBITER_SOCKET_ENV) or None,
                          arbiter_client=env.get(ARBITER_CLIENT_ENV) or None,
                          arbiter_weight=1.0 if weight is None else weight,
                          memory_fraction=_parse(env, MEMORY_FRACTION_ENV, float),
                          kv_cache_bytes=_parse(env, KV_CACHE_BYTES_ENV, int))


def _parse(env: Mapping[str, str], name: str, kind: Callable[[str], T]) -> T | None:
    text = env.get(name)
    if not text:
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a valid {getattr(kind, '__name__', 'value')}") from None
