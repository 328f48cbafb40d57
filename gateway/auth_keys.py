"""API keys: what each may do (its models, default lane, tenant class, rate limits), read from the JSON in the
environment variable the registry names, and the Bearer token of a request."""

from __future__ import annotations

import hmac
import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from policies.classify import parse_lane
from policies.ratelimit import KeyLimits
from registry.errors import format_loc


def bearer_token(authorization: str) -> str:
    """The token of an `Authorization: Bearer <token>` header value ("" for any other value)."""
    return authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""


def token_matches(given: str, expected: str | None) -> bool:
    """Whether `given` is the configured token `expected` (never when none is configured), in constant time."""
    return expected is not None and expected != "" and hmac.compare_digest(given.encode(), expected.encode())


class ApiKey(BaseModel):
    """What one API key may do: its models (None: all), default lane, tenant class and rate limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    models: frozenset[str] | None = None
    priority: int | str | None = None  # the lane of its requests unless they say otherwise (policies/classify.py)
    tenant: str | None = None  # picks a model's `variants` entry
    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)

    @field_validator("priority")
    @classmethod
    def _lane(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            parse_lane(value)  # ValueError naming the lanes
        return value

    @property
    def limits(self) -> KeyLimits:
        return KeyLimits(self.requests_per_minute, self.tokens_per_minute)


def parse_api_keys(raw: str | None) -> dict[str, ApiKey]:
    """API keys as JSON (from the environment variable the registry names): key -> `"*"` (every model),
    a list of models, or an object with `models`, `priority`, `tenant`, `requests_per_minute`,
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
