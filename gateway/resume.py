"""Resumable generations, the gateway's side: what a relayed stream has shown its client, what a non-streamed
reply's replica has generated so far, and reading a replica's reply in a way that can be stopped at any moment.

A generation stream is resumable when the gateway asked for token ids (foundation/http/wire.py RESUMABLE_HEADER)
and the replica answered with them. `StreamTracker` passes its events on whole, without their token-id comment
lines, and keeps what a continuation needs: the ids of every token the client has been sent, the stream's `id` and
`created`, and whether the choice has finished. When the replica fails, times out or is drained with migration
mid-stream, the forwarder (gateway/proxy.py) sends `continuation()` to another replica of the model, and that
stream goes on through the same tracker: the client sees one stream, with one id, every token once.
`ProgressTracker` does the same for a non-streamed generation, whose client only ever sees the final reply.

`Pump` reads a reply's chunks in a task of its own into a small queue, so that a relay waiting for the next chunk
can be told to stop (`stop()`: the replica is being drained with migration) without cancelling the relay itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from foundation.http.wire import REPLY_LINE, RESUME_FIELD, TOKENS_COMMENT
from gateway.framing import MAX_FRAME_BYTES, Framer, UpstreamMalformed, parse_token_ids
from gateway.upstream import MAX_REPLY_BYTES, UpstreamTimeout

_TOKENS = TOKENS_COMMENT.encode()
_REPLY = REPLY_LINE.encode()
_DATA = b"data: "


class StreamTracker:
    """Follows one relayed SSE stream of a single choice (n = 1); see the module's docstring. What it passes on is
    checked as it goes: a token line that is not a list of ids, an event that is not JSON (nor `[DONE]`), choices or
    deltas that are not objects, or an event over `max_event_bytes` raise UpstreamMalformed."""

    def __init__(self, include_usage: bool, max_event_bytes: int = MAX_FRAME_BYTES) -> None:
        self.include_usage = include_usage
        self.token_ids: list[int] = []
        self.id: str | None = None
        self.created: int | None = None
        self.object: str | None = None
        self.model: str | None = None
        self.finished = False  # the choice's last chunk (with its finish_reason) went out
        self.done = False  # `[DONE]` went out
        self.failed = False  # the replica reported an error in-band: that is an answer, not something to resume
        self.untracked = False  # text went out without token ids (a replica that does not take part): no resuming
        self.usage_sent = False
        self._events = Framer(b"\n\n", max_event_bytes, "stream event")

    @property
    def resumable(self) -> bool:
        return self.id is not None and not (self.finished or self.done or self.failed or self.untracked)

    def feed(self, data: bytes) -> bytes:
        """The complete events in what has arrived so far, without token-id lines; a partial event is kept back
        (if the replica dies before finishing it, the continuation makes its tokens again). On a malformed event,
        UpstreamMalformed carries the events before it."""
        out: list[bytes] = []
        try:
            for event in self._events.feed(data):
                out.append(self._event(event))
        except UpstreamMalformed as err:
            raise UpstreamMalformed(str(err), b"".join(out)) from None
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        ids: list[int] = []
        if event.startswith(_TOKENS):
            line, _, event = event.partition(b"\n")
            ids = parse_token_ids(line[len(_TOKENS):])
        if event.startswith(_DATA):
            self._observe(event[len(_DATA):], ids)
        elif ids:
            raise UpstreamMalformed(f"token ids before something other than a data line: {event[:80]!r}")
        self.token_ids.extend(ids)
        return event + b"\n\n"

    def _observe(self, data: bytes, ids: list[int]) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise UpstreamMalformed(f"a stream event that is not JSON: {data[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise UpstreamMalformed(f"a stream event that is not a JSON object: {data[:80]!r}")
        if "error" in chunk:
            self.failed = True
            return
        if chunk.get("usage"):
            self.usage_sent = True
        if self.id is None:
            self._identify(chunk)
        choices = chunk.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise UpstreamMalformed(f"a stream event whose choices are not objects: {data[:80]!r}")
        for choice in choices:
            if choice.get("finish_reason") is not None:
                self.finished = True
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise UpstreamMalformed(f"a stream event whose delta is not an object: {data[:80]!r}")
            if not ids and (choice.get("text") or delta.get("content")):
                self.untracked = True

    def _identify(self, chunk: dict[str, Any]) -> None:
        """The stream's id and creation time, which a continuation keeps; a stream without them can't go on."""
        stream_id, created = chunk.get("id"), chunk.get("created")
        if isinstance(stream_id, str) and isinstance(created, int) and not isinstance(created, bool):
            self.id, self.created = stream_id, created
            self.object, self.model = chunk.get("object"), chunk.get("model")
        else:
            self.untracked = True

    def continuation(self, payload: dict[str, Any]) -> bytes:
        """The body that asks another replica to go on after the tokens sent so far. What is left of an event the
        broken reply had begun is dropped: its tokens were never sent, and the continuation makes them again."""
        self._events.clear()
        resume = {"token_ids": self.token_ids, "id": self.id, "created": self.created}
        return json.dumps({**payload, RESUME_FIELD: resume}).encode()

    def ending(self, prompt_tokens: int | None) -> bytes:
        """What is left to send when a stream broke after its last token but before `[DONE]`: the usage chunk if it
        was asked for (and the prompt's size is known), then `[DONE]`."""
        tail = b""
        if self.include_usage and not self.usage_sent and prompt_tokens is not None:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(self.token_ids),
                     "total_tokens": prompt_tokens + len(self.token_ids)}
            chunk: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                     "choices": [], "usage": usage}
            tail = _DATA + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        return tail + b"data: [DONE]\n\n"


class ProgressTracker:
    """Follows a non-streamed generation's progress reply (foundation/http/wire.py PROGRESS_MEDIA_TYPE): the ids of
    the tokens generated so far, then the final status and reply. The client sees only that reply, so a continuation
    needs nothing but the token ids, and the replica that finishes answers with the whole text.

    Bounded: a line over `max_line_bytes` or a reply over `max_reply_bytes` is UpstreamMalformed, as is a line that
    is neither a token line nor a reply line with a status, or (`reply_json()`) a reply that is not a JSON object."""

    def __init__(self, max_reply_bytes: int = MAX_REPLY_BYTES, max_line_bytes: int = MAX_FRAME_BYTES) -> None:
        self.token_ids: list[int] = []
        self.status: int | None = None  # set once the reply line has come; the body follows it
        self.max_reply_bytes = max_reply_bytes
        self._body: list[bytes] = []
        self._body_bytes = 0
        self.max_line_bytes = max_line_bytes
        self._held = bytearray()  # a line begun

    @property
    def reply(self) -> tuple[int, bytes] | None:
        """The final status and body, once the reply line has come (the body is whole when the reply has ended)."""
        return None if self.status is None else (self.status, b"".join(self._body))

    def feed(self, data: bytes) -> None:
        """Take what has arrived; UpstreamMalformed for a line that is neither a token line nor the reply line.
        Linear: each byte is appended once and searched for a newline once."""
        if self.status is not None:
            self._take(data)
            return
        held = self._held
        start = len(held)
        held += data
        pos = 0
        while (end := held.find(b"\n", max(pos, start))) >= 0:
            if end - pos > self.max_line_bytes:
                break
            line, pos = bytes(held[pos:end]), end + 1
            if line.startswith(_REPLY):  # what follows is the body, not lines (a pretty reply has newlines)
                status = line[len(_REPLY):]
                if not (status.isdigit() and len(status) == 3 and 200 <= int(status) <= 599):
                    raise UpstreamMalformed(f"not a reply line: {line[:80]!r}")
                self.status = int(status)
                body = bytes(held[pos:])
                held.clear()
                self._take(body)
                return
            if not line.startswith(_TOKENS):
                raise UpstreamMalformed(f"not a progress line: {line[:80]!r}")
            self.token_ids.extend(parse_token_ids(line[len(_TOKENS):]))
        del held[:pos]
        if len(held) > self.max_line_bytes:
            held.clear()
            raise UpstreamMalformed(f"the replica sent a progress line over {self.max_line_bytes} bytes")

    def _take(self, data: bytes) -> None:
        self._body_bytes += len(data)
        if self._body_bytes > self.max_reply_bytes:
            self._body.clear()
            raise UpstreamMalformed(f"the replica's reply is over {self.max_reply_bytes} bytes")
        self._body.append(data)

    def reply_json(self) -> tuple[int, bytes]:
        """The final status and body once the reply has ended, checked to be a JSON object (it goes out as JSON)."""
        assert self.status is not None
        body = b"".join(self._body)
        try:
            valid = isinstance(json.loads(body), dict)
        except ValueError:
            valid = False
        if not valid:
            raise UpstreamMalformed(f"the replica's reply is not a JSON object: {body[:80]!r}")
        return self.status, body

    def continuation(self, payload: dict[str, Any]) -> bytes:
        """The body that asks another replica to go on after the tokens generated so far; what the broken reply had
        begun of a line (its tokens are made again) or of a reply it did not finish is dropped."""
        self._held.clear()
        self.status, self._body, self._body_bytes = None, [], 0
        return json.dumps({**payload, RESUME_FIELD: {"token_ids": self.token_ids}}).encode()


@dataclass
class ResumeBudget:
    """How much more one request may be resumed: `resumes_left` continuations (one after a leg that made no progress
    costs two: a replica that breaks at once, again and again, is not chased for long) and `wait_left_s` of waiting
    for a replica to go on on, over all its continuations."""

    resumes_left: int
    wait_left_s: float

    def spend(self, progressed: bool) -> bool:
        """Take the cost of one more continuation; whether the budget allows it."""
        self.resumes_left -= 1 if progressed else 2
        return self.resumes_left >= 0 and self.wait_left_s > 0

    def waited(self, seconds: float) -> None:
        self.wait_left_s -= seconds


class Moved(Exception):
    """The replica is being drained with migration: stop reading it and go on elsewhere."""


class Stalled(UpstreamTimeout):
    """The replica sent nothing for the pump's `stall_s`: go on elsewhere, without holding it against the replica (a
    preempted or queued request is silent too)."""


_END = object()


class Pump:
    """Reads `chunks` into a queue from a task of its own (the queue is small, so a slow client still slows the
    replica down); `get()` returns the next chunk, None at the end, or raises the reading's error, `Moved` once
    `stop()` was called, or `Stalled` once nothing came for `stall_s` (one timer per pump, re-armed from the time
    of the last chunk: nothing per chunk but reading the clock)."""

    def __init__(self, chunks: AsyncIterator[bytes], depth: int = 16, stall_s: float | None = None) -> None:
        self._queue: asyncio.Queue[object] = asyncio.Queue(depth)
        self._stopped: Exception | None = None
        self._loop = asyncio.get_running_loop()
        self._last_s = self._loop.time()
        self._stall_s = stall_s
        self._watch = None if stall_s is None else self._loop.call_later(stall_s, self._check_stall)
        self._task = asyncio.create_task(self._run(chunks))

    async def _run(self, chunks: AsyncIterator[bytes]) -> None:
        item: object = _END
        try:
            async for chunk in chunks:
                self._last_s = self._loop.time()
                await self._queue.put(chunk)
        except Exception as err:  # the upstream's error, for the reader to raise
            item = err
        await self._queue.put(item)

    async def get(self) -> bytes | None:
        if self._stopped is not None:
            raise self._stopped
        item = await self._queue.get()
        if self._stopped is not None:
            raise self._stopped
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, bytes)
        return item

    def stop(self, reason: Exception | None = None) -> None:
        """Wake the reader with `reason` (`Moved` by default; now if it waits, else at its next `get()`)."""
        if self._stopped is not None:
            return
        self._stopped = reason or Moved()
        self.cancel()
        with contextlib.suppress(asyncio.QueueFull):  # when full, the reader is not waiting: it sees the flag
            self._queue.put_nowait(_END)

    def cancel(self) -> None:
        """Stop reading (idempotent). Nothing is awaited: this runs in cleanup, possibly inside a cancelled scope."""
        self._task.cancel()
        if self._watch is not None:
            self._watch.cancel()

    def _check_stall(self) -> None:
        assert self._stall_s is not None
        quiet_s = self._loop.time() - self._last_s
        if self._task.done():  # the reply has ended: what is queued is all there is
            return
        if quiet_s >= self._stall_s:
            self.stop(Stalled(f"no bytes for {self._stall_s:g} s mid-stream"))
        else:
            self._watch = self._loop.call_later(self._stall_s - quiet_s, self._check_stall)
