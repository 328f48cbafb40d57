"""The traffic profile: one JSON line per chat/completion request through the gateway — model, endpoint, lane,
status, start and end (wall-clock seconds), prompt and output token counts — never the content. `multiserve profile`
and `multiserve plan-capacity` read it (bench/profile.py).

Token counts come from the reply itself, as it passes through: `usage` of a whole JSON reply, or of the last chunk
of a stream that asked for `stream_options.include_usage`; a stream without usage gets its output counted as its
content events (`usage: "counted"`) and its prompt count from the `x-multiserve-prompt-tokens` header our replicas
send (the proxy keeps it in the request's context); a whole reply cut short (a timeout, a client gone) gets the
tokens its replicas reported generating in its progress (`usage: "generated"`). The lane is the one the replica
would pick (policies/classify.py) from the request's priority, X-Priority header and lengths.

Off unless the registry's `gateway.traffic.path` is set. The file rotates by size (`path` → `path.1` → … →
`path.<backups>`, the oldest dropped), so it stays under (backups + 1) × max_bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from gateway.context import request_context
from policies.classify import LaneThresholds, classify
from policies.multilevel import LANES

log = structlog.get_logger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

TRACKED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


@dataclass(frozen=True)
class TrafficRecord:
    start_s: float  # wall clock (epoch seconds), when the request reached the gateway
    end_s: float  # when its last byte left
    model: str | None
    endpoint: str
    lane: str | None  # interactive | normal | background; None when it cannot be told (no prompt count)
    status: int
    stream: bool
    prompt_tokens: int | None
    output_tokens: int | None
    usage: str  # reported | counted | generated (a whole reply cut short: what its replicas reported) | none


class TrafficRecorder:
    """Appends records to a JSONL file with size rotation."""

    def __init__(self, path: str | Path, max_bytes: int = 64 << 20, backups: int = 3) -> None:
        self.path, self.max_bytes, self.backups = Path(path), max_bytes, backups
        self.num_dropped = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, record: TrafficRecord) -> None:
        line = json.dumps(asdict(record), separators=(",", ":")) + "\n"
        # Opened per record (tens of µs, against a request's milliseconds): no handle to close at shutdown, and an
        # operator may move or delete the file at any time.
        try:
            if self.path.exists() and self.path.stat().st_size + len(line) > self.max_bytes:
                self._rotate()
            with self.path.open("a") as out:
                out.write(line)
        except OSError as err:  # a full or read-only disk must not fail requests: count and log the loss
            self.num_dropped += 1
            log.error("traffic_record_dropped", path=str(self.path), error=repr(err), dropped=self.num_dropped)

    def _rotate(self) -> None:
        if self.backups == 0:
            self.path.unlink()
            return
        for index in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{index + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))


def request_lane(payload: dict[str, Any] | None, headers: dict[bytes, bytes], prompt_tokens: int | None,
                 key_priority: int | str | None = None, thresholds: LaneThresholds | None = None) -> str | None:
    """The lane policies/classify.py gives this request (with its API key's default lane and its model's length
    thresholds, as the replica does); None when it depends on an unknown prompt length, or its body was not a
    JSON object (`payload` None: it was refused before a replica saw it)."""
    if payload is None:
        return None
    priority, max_tokens = payload.get("priority"), payload.get("max_tokens")
    header = headers.get(b"x-priority", b"").decode(errors="replace") or None
    if priority is None and header is None and key_priority is None and prompt_tokens is None:
        return None
    try:
        return LANES[classify(priority if isinstance(priority, int) else None, header, key_priority,
                              prompt_tokens or 0, max_tokens if isinstance(max_tokens, int) else None, thresholds)]
    except ValueError:  # a bad priority: the replica refused it (400), and the record's status says so
        return None


class TrafficMiddleware:
    """Pure ASGI: taps the reply of tracked endpoints and records one line per request (its lane: the one its API
    key allowed it, gateway/lanes.py, else the one its body as the proxy parsed it gives)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], recorder: TrafficRecorder,
                 wall_clock: Callable[[], float] = time.time,
                 thresholds_for: Callable[[str], LaneThresholds | None] = lambda model: None) -> None:
        """`thresholds_for(model)`: that model's lane length thresholds (None: the defaults)."""
        self.app, self.recorder, self.wall_clock = app, recorder, wall_clock
        self.thresholds_for = thresholds_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = TRACKED_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        start_s = self.wall_clock()
        context = request_context(scope)
        tap, send = context.tap_reply(send)
        try:
            await self.app(scope, receive, send)
        finally:
            prompt, output, source = tap.counts(context.prompt_tokens, context.generated_tokens)
            model = context.model
            lane = LANES[context.lane] if context.lane is not None else request_lane(
                context.payload, dict(scope.get("headers") or []), prompt, context.key_priority,
                None if model is None else self.thresholds_for(model))
            self.recorder.record(TrafficRecord(start_s, self.wall_clock(), model, endpoint, lane,
                                               tap.status or 500, tap.stream, prompt, output, source))
