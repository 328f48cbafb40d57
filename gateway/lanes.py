"""The lane a request runs in, as its API key allows, decided at the gateway: a replica trusts the lane its gateway
sends (policies/classify.py `key_lane`).

A request names a lane by its body's `priority` (vLLM's convention: lower is more urgent, clamped to the lanes) or,
without one, its `X-Priority` header (a lane name or number), in the order the replica reads them. A key's `priority`
is a ceiling: a more urgent lane is clamped down to it, silently, as vLLM clamps a priority out of range; a key's
`lanes` refuse any lane they do not list (403 `lane_not_allowed`). Anonymous clients, and keys that set neither,
keep the replica's classification of the request as it was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from foundation.http.errors import APIError
from foundation.http.wire import PRIORITY_MAX, PRIORITY_MIN
from gateway.auth_keys import ApiKey
from policies.classify import LaneNotAllowed, key_lane, parse_lane


@dataclass(frozen=True)
class LaneChoice:
    """The lane to send the replica (None: none decided; the request goes as the client sent it), and whether the
    body's `priority`, which the replica reads first, must be rewritten to it (it asked for a more urgent lane)."""

    lane: int | None = None
    rewrite_priority: bool = False


AS_SENT = LaneChoice()


def choose_lane(priority: object, header: str | None, key: ApiKey | None) -> LaneChoice:
    """The lane of a request whose body's `priority` is `priority` (absent: None) and whose `X-Priority` header is
    `header`, on API key `key` (None: anonymous). APIError 403 for a lane the key does not list, 400 for a header
    that names no lane. A body `priority` the replica would refuse (not a 32-bit integer) is left to it: its 400."""
    if key is None or (key.priority is None and key.lanes is None):
        return AS_SENT
    ceiling = None if key.priority is None else parse_lane(key.priority)
    asked: int | None = None
    if priority is None and header:
        try:
            asked = parse_lane(header)
        except ValueError as err:
            raise APIError(400, f"X-Priority: {err}", param="priority") from None
    elif type(priority) is int and PRIORITY_MIN <= priority <= PRIORITY_MAX:  # bool is no priority
        asked = parse_lane(priority)
    try:
        lane = key_lane(asked, ceiling, key.lanes)
    except LaneNotAllowed as err:
        source = "X-Priority" if priority is None else "priority"
        raise APIError(403, f"{source}: {err}", param="priority", code="lane_not_allowed") from None
    return LaneChoice(lane, rewrite_priority=priority is not None and asked is not None and lane != asked)
