"""The registry's `gateway.http` takes its defaults from the slow-client guard (`DEFAULT_LIMITS`, what every replica
serves with), and pydantic does not check a field's default against its bounds: these tests do."""

from __future__ import annotations

from dataclasses import asdict

from foundation.http.limits import DEFAULT_LIMITS, GuardLimits
from registry.schema import HttpLimits


def test_the_guard_defaults_are_within_the_registrys_bounds():
    assert HttpLimits.model_validate(asdict(DEFAULT_LIMITS)) == HttpLimits()


def test_every_limit_the_guard_reads_can_be_set_in_the_registry():
    read = {name for name in vars(GuardLimits) if not name.startswith("_")}
    assert read == set(asdict(DEFAULT_LIMITS)) == set(HttpLimits.model_fields)
