"""The slow-client guard's own defaults (a replica's limits) and the registry's `gateway.http` defaults are the same
numbers: foundation/ cannot import the registry's schema, so this keeps the two from drifting apart."""

from __future__ import annotations

from dataclasses import asdict

from foundation.http.guard import DEFAULT_LIMITS
from registry.schema import HttpLimits


def test_the_guard_defaults_are_the_registrys():
    assert asdict(DEFAULT_LIMITS) == HttpLimits().model_dump()
