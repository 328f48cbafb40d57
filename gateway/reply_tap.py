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
        *lines, self.buffer = (self.buffer + body).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            if b'"completion_tokens"' in line:
                self._usage(line)
            elif b'"role"' not in line and b'"error"' not in line:  # role openers and error events carry no token
                self.num_content_events += 1

    def _usage(self, text: bytes) -> None:
        prompt, completion = _PROMPT.findall(text), _COMPLETION.findall(text)
        if prompt:  # the last usage in the text is the request's total (an embedding's has no completion)
            self.prompt_tokens, self.output_tokens = int(prompt[-1]), int(completion[-1]) if completion else 0

    def counts(self, counted_prompt: int | None = None) -> tuple[int | None, int | None, str]:
        """(prompt, output, how they were had); a stream without usage gets `counted_prompt`: the replica's count."""
        if not self.stream and self.buffer:
            self._usage(self.buffer)
            self.buffer = b""  # parsed: the rate limits and the traffic log both ask
        if self.output_tokens is not None:
            return self.prompt_tokens, self.output_tokens, "reported"
        if self.stream:
            return counted_prompt, self.num_content_events, "counted"
        return None, None, "none"
