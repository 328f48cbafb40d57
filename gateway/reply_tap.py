"""Reading token usage out of a reply as it passes through the gateway (a stream line by line, a whole JSON reply
at its end): the rate limits settle a key's tokens from it, the traffic log records it. One tap per request
(`RequestContext.tap_reply`)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

MAX_JSON_REPLY_BYTES = 8 << 20  # a longer non-streamed reply is not scanned for usage (its counts are left out)
MAX_LINE_BYTES = 1 << 20  # a longer line of a stream is not read (an event carries a token or a usage chunk)
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class ReplyTap:
    """Reads token usage out of the reply bytes as they pass; keeps only a partial line of a stream."""

    def __init__(self) -> None:
        self.status, self.stream = 0, False
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None
        self.num_content_events = 0
        self.buffer = b""
        self._skipping = False  # within a stream line over MAX_LINE_BYTES, not kept

    def start(self, message: Message) -> None:
        self.status = int(message["status"])
        headers = dict(message.get("headers") or [])
        self.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")

    def wrap(self, send: Send) -> Send:
        """`send`, with every reply message shown to this tap on the way out."""

        async def tapped_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.start(message)
            elif message["type"] == "http.response.body":
                self.feed(message.get("body", b""))
            await send(message)

        return tapped_send

    def feed(self, body: bytes) -> None:
        if not self.stream:
            if len(self.buffer) + len(body) <= MAX_JSON_REPLY_BYTES:
                self.buffer += body
            return
        # Linear in the stream: only the new bytes are searched, and a partial line is kept up to MAX_LINE_BYTES
        # (a longer one is not an event this tap can read; it is skipped to its end, not held).
        start = 0
        if self.buffer or self._skipping:
            newline = body.find(b"\n")
            if newline < 0:
                self._hold(body)
                return
            if not self._skipping:
                self._line(self.buffer + body[:newline])
            self.buffer, self._skipping, start = b"", False, newline + 1
        end = body.rfind(b"\n", start)
        if end >= 0:
            for line in body[start:end].split(b"\n"):
                self._line(line)
            start = end + 1
        self._hold(body[start:])

    def _hold(self, part: bytes) -> None:
        if self._skipping or not part:
            return
        if len(self.buffer) + len(part) > MAX_LINE_BYTES:
            self.buffer, self._skipping = b"", True
        else:
            self.buffer += part

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
            return
        if b'"completion_tokens"' in line:
            self._usage(line)
        elif b'"role"' not in line and b'"error"' not in line:  # role openers and error events carry no token
            self.num_content_events += 1

    def _usage(self, text: bytes) -> None:
        prompt, completion = _PROMPT.findall(text), _COMPLETION.findall(text)
        if prompt:  # the last usage in the text is the request's total (an embedding's has no completion)
            self.prompt_tokens, self.output_tokens = int(prompt[-1]), int(completion[-1]) if completion else 0

    def counts(self, counted_prompt: int | None = None, generated: int = 0) -> tuple[int | None, int | None, str]:
        """(prompt, output, how they were had). A stream without usage gets `counted_prompt` (the replica's count)
        and its content events; a whole reply without usage (cut short: a timeout, a client gone, a broken reply)
        gets the `generated` tokens its replicas reported as they went (the proxy counts them), if any."""
        if not self.stream and self.buffer:
            self._usage(self.buffer)
            self.buffer = b""  # parsed: the rate limits and the traffic log both ask
        if self.output_tokens is not None:
            return self.prompt_tokens, self.output_tokens, "reported"
        if self.stream:
            return counted_prompt, self.num_content_events, "counted"
        if generated:
            return counted_prompt, generated, "generated"
        return None, None, "none"
