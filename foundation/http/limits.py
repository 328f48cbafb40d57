"""The slow-client guard's limits (foundation/http/guard.py): what it reads, and the defaults a server gets when given
none. Apart from the guard, so that the registry takes its defaults from here without importing uvicorn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class GuardLimits(Protocol):
    """What the guard reads of its limits (read-only, so that a frozen model or dataclass is one)."""

    @property
    def header_timeout_s(self) -> float: ...

    @property
    def body_timeout_s(self) -> float: ...

    @property
    def max_header_bytes(self) -> int: ...

    @property
    def keep_alive_s(self) -> float: ...

    @property
    def max_connections(self) -> int | None: ...  # None: no cap


@dataclass(frozen=True)
class DefaultLimits:
    """The limits a server gets when given none (the registry's `gateway.http` defaults are the same numbers)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    # uvicorn's default. On a replica it must stay above the 4 s for which the gateway reuses an idle connection.
    keep_alive_s: float = 5.0
    max_connections: int | None = 1000


DEFAULT_LIMITS = DefaultLimits()
