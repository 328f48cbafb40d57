"""API keys: what each may do (its models, lanes, tenant class, rate limits), read from the JSON in the environment
variable the registry names, and the Bearer token of a request."""

from __future__ import annotations

import hmac
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from foundation.field_paths import format_loc
from policies.classify import key_lane, lane_names, parse_lane
from policies.multilevel import BACKGROUND, INTERACTIVE, LANES
from policies.ratelimit import KeyLimits


def bearer_token(authorization: str) -> str:
    """The token of an `Authorization: Bearer <token>` header value ("" for any other value)."""
    return authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""


def token_matches(given: str, expected: str | None) -> bool:
    """Whether `given` is the configured token `expected` (never when none is configured), in constant time."""
    return expected is not None and expected != "" and hmac.compare_digest(given.encode(), expected.encode())


class ApiKey(BaseModel):
    """What one API key may do: its models (None: all), lanes, tenant class and rate limits.

    Lanes (`policies.classify.key_lane`): `priority` alone is a ceiling and the default: a request may ask for that
    lane or a less urgent one, and one that asks for a more urgent lane gets this one. `lanes` lists the lanes its
    requests may ask for, exactly (any other is refused); with it, `priority` is only the default, one of `lanes`
    (without it: the least urgent of them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    models: frozenset[str] | None = None
    priority: int | str | None = None  # its requests' most urgent lane, and the lane of those that name none
    lanes: frozenset[int] | None = None  # the lanes its requests may ask for (names or numbers in the JSON)
    tenant: str | None = None  # picks a model's `variants` entry
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)

    @field_validator("priority")
    @classmethod
    def _lane(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            parse_lane(value)  # ValueError naming the lanes
        return value

    @field_validator("lanes", mode="before")
    @classmethod
    def _lanes(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return None
        if not isinstance(value, (list, tuple, set, frozenset)) or not value:
            raise ValueError(f"must be a non-empty list of lanes: {_LANE_VALUES}")
        lanes = frozenset(_lane_number(lane) for lane in value)
        priority = info.data.get("priority")  # absent when it was refused itself
        if priority is not None and parse_lane(priority) not in lanes:
            raise ValueError(f"the key's priority ({LANES[parse_lane(priority)]}) must be one of its lanes "
                             f"({lane_names(lanes)})")
        return lanes

    @property
    def default_lane(self) -> int | None:
        """The lane of its requests that name none; None: their length decides (policies/classify.py)."""
        return key_lane(None, None if self.priority is None else parse_lane(self.priority), self.lanes)

    @property
    def limits(self) -> KeyLimits:
        return KeyLimits(self.requests_per_minute, self.tokens_per_minute)


_LANE_VALUES = f"{', '.join(LANES)} or {INTERACTIVE}-{BACKGROUND}"


def _lane_number(value: Any) -> int:
    """A lane named in a key's `lanes`: a name or its number, exactly (no clamping: a list is written on purpose)."""
    if isinstance(value, str) and value.strip().lower() in LANES:
        return LANES.index(value.strip().lower())
    if type(value) is int and INTERACTIVE <= value <= BACKGROUND:
        return value
    raise ValueError(f"{value!r} is not a lane: use {_LANE_VALUES}")


def parse_api_keys(raw: str | None) -> dict[str, ApiKey]:
    """API keys as JSON (from the environment variable the registry names): key -> `"*"` (every model),
    a list of models, or an object with `models`, `priority`, `lanes`, `tenant`, `requests_per_minute`,
    `tokens_per_minute`. Errors name the key and the field."""
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"API keys must be a JSON object of key -> \"*\", [models] or {{...}}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError("API keys must be a JSON object of key -> \"*\", [models] or {...}")
    keys = {}
    for index, (key, value) in enumerate(data.items()):
        spec = {"models": None if value == "*" else value} if isinstance(value, (str, list)) else value
        if isinstance(spec, dict) and spec.get("models") == "*":
            spec = {**spec, "models": None}
        try:
            keys[str(key)] = ApiKey.model_validate(spec)
        except ValidationError as err:
            first = err.errors()[0]
            field = format_loc(first["loc"]) or "(value)"
            raise ValueError(f"API key #{index + 1}: {field}: {first['msg']}") from None
    return keys
