"""One streamed request against any OpenAI-compatible server, timed token by token.

It asks for `stream_options.include_usage` so the server's own token counts are used; a server that does not send a
usage chunk gets its output counted as the number of content chunks (`RequestResult.usage_reported` says which).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.stats import RequestResult

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class Target:
    """Where requests go and what every request body carries besides its prompt."""

    url: str  # the server's base URL, with or without a trailing /v1
    model: str
    endpoint: str = "chat"  # chat | completions
    api_key: str | None = None
    ignore_eos: bool = False  # vLLM's extra: always generate max_tokens (fixed output lengths)
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINT_PATHS)}, got {self.endpoint!r}")

    @property
    def request_url(self) -> str:
        base = self.url.rstrip("/").removesuffix("/v1")
        return base + ENDPOINT_PATHS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": self.temperature,
                                **self.extra_body}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


def _content_of(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        text += (delta.get("content") or "") if "delta" in choice else (choice.get("text") or "")
    return text


class _StreamTimer:
    """Folds SSE events into a RequestResult as they arrive."""

    def __init__(self, result: RequestResult, clock: Callable[[], float]) -> None:
        self.result, self.clock = result, clock
        self.last_s: float | None = None
        self.num_chunks = 0

    def on_event(self, data: str) -> None:
        now = self.clock()
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self.result.error = f"malformed SSE event: {data[:200]!r}"
            return
        if "error" in chunk:  # an error event mid-stream (the gateway sends one when a replica breaks)
            self.result.error = str(chunk["error"].get("message", chunk["error"]))
            return
        usage = chunk.get("usage")
        if usage:
            self.result.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.result.num_output_tokens = int(usage.get("completion_tokens") or 0)
            self.result.usage_reported = True
        if not _content_of(chunk):
            return
        if self.last_s is None:
            self.result.ttft_s = now - self.result.sent_s
        else:
            self.result.itl_s.append(now - self.last_s)
        self.last_s = now
        self.num_chunks += 1

    def finish(self) -> RequestResult:
        self.result.e2e_s = self.clock() - self.result.sent_s
        if not self.result.usage_reported:
            self.result.num_output_tokens = self.num_chunks
        if self.result.ttft_s is None and self.result.error is None:
            self.result.error = "the stream ended without content"
        return self.result


async def send_streaming(http: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int,
                         clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """Send one streamed request and time it. Failures are results (status, error), never exceptions."""
    result = RequestResult(sent_s=clock(), status=0)
    try:
        async with http.stream("POST", target.request_url, json=target.body(prompt, max_tokens),
                               headers=target.headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:500]
                result.e2e_s = clock() - result.sent_s
                return result
            timer = _StreamTimer(result, clock)
            async for line in response.aiter_lines():
                if line.startswith("data:") and (data := line[5:].strip()) and data != "[DONE]":
                    timer.on_event(data)
            return timer.finish()
    except httpx.HTTPError as err:  # connection refused, reset, timeout: counted by status 0 (or the one seen)
        result.error = f"{type(err).__name__}: {err}"
        result.e2e_s = clock() - result.sent_s
        return result


async def prompt_tokens_of(http: httpx.AsyncClient, target: Target, prompt: str) -> int | None:
    """The server's `usage.prompt_tokens` for `prompt` (a 1-token, non-streamed request); None if not reported.
    Raises httpx.HTTPStatusError when the server refuses the probe."""
    response = await http.post(target.request_url, json=target.body(prompt, 1, stream=False),
                               headers=target.headers)
    response.raise_for_status()
    usage = response.json().get("usage") or {}
    tokens = usage.get("prompt_tokens")
    return int(tokens) if tokens else None
