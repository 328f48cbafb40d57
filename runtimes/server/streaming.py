"""Talking to a client that may leave: SSE event streams and disconnect-aware non-streaming work.

Whatever way a client goes away, the request's engine iterator is closed, which aborts the request and
frees its KV blocks: a streaming response closes its event generator when the send fails or Starlette
cancels it on `http.disconnect`; a non-streaming one, and a stream before its first token, race their work
against `http.disconnect` (foundation/http/disconnect.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import Any

import structlog
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from foundation.http.errors import LOGGED_WHERE_RAISED, error_payload, to_api_error
from foundation.http.wire import PROGRESS_MEDIA_TYPE, PROMPT_TOKENS_HEADER, REPLY_LINE, RESUMABLE_HEADER, TOKENS_COMMENT
from runtimes.server.generation import Choice, Generation
from runtimes.server.responses import (
    LogprobFormatter,
    ResponseMeta,
    chat_chunk,
    chat_finish_reason,
    completion_chunk,
    usage_chunk,
)
from runtimes.server.tool_calls import ReplyReader, merged

log = structlog.get_logger(__name__)
DONE = "data: [DONE]\n\n"
Event = tuple[dict[str, Any], Sequence[int]]  # a chunk and the ids of the tokens it carries


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _ClosingResponse(StreamingResponse):
    """A streamed response that always closes its generator, however the response ends."""

    def __init__(self, parts: AsyncGenerator[str, None], headers: dict[str, str]) -> None:
        super().__init__(parts, headers={"Cache-Control": "no-cache", **headers})
        self._parts = parts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A failed send (client gone) leaves the generator suspended at a yield; close it now, not at GC.
            await self._parts.aclose()


class SSEResponse(_ClosingResponse):
    """A text/event-stream response of generation events."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], num_prompt_tokens: int | None = None,
                 with_token_ids: bool = False) -> None:
        headers = {"X-Accel-Buffering": "no"}
        if num_prompt_tokens is not None:  # so a gateway can count a stream's tokens without a usage chunk
            headers[PROMPT_TOKENS_HEADER] = str(num_prompt_tokens)
        if with_token_ids:  # says the events carry their token ids: the gateway can resume the stream elsewhere
            headers[RESUMABLE_HEADER] = "1"
        super().__init__(events, headers)


async def sse_stream(events: AsyncGenerator[Event, None], generation: Generation,
                     with_token_ids: bool = False) -> AsyncGenerator[str, None]:
    """Encode `events` as SSE, then `[DONE]`; a failure midway becomes a final error event (the status line
    has been sent already, so OpenAI and vLLM report it in-band). `with_token_ids`: each event that carries tokens
    is preceded by a comment line with their ids (foundation/http/wire.py TOKENS_COMMENT), for a gateway that
    may have to resume the stream elsewhere."""
    try:
        try:
            async for event, token_ids in events:
                if with_token_ids and token_ids:
                    yield f"{TOKENS_COMMENT}{','.join(map(str, token_ids))}\n{sse(event)}"
                else:
                    yield sse(event)
        except Exception as exc:
            if not isinstance(exc, LOGGED_WHERE_RAISED):
                log.exception("stream failed", request_id=generation.request_id)
            yield sse(error_payload(exc))
        yield DONE
    finally:
        await events.aclose()
        await generation.aclose()


class ProgressResponse(_ClosingResponse):
    """A non-streamed generation's progress, for a gateway that may continue it elsewhere (foundation/http/wire.py
    PROGRESS_MEDIA_TYPE): token-id lines as outputs come, then the status line and the whole reply."""

    media_type = PROGRESS_MEDIA_TYPE

    def __init__(self, lines: AsyncGenerator[str, None]) -> None:
        super().__init__(lines, {RESUMABLE_HEADER: "1"})


async def progress_lines(generation: Generation,
                         whole: Callable[[list[Choice]], dict[str, Any]]) -> AsyncGenerator[str, None]:
    """The lines of a `ProgressResponse`: the ids of each output's tokens, then the reply line with the status and
    `whole(choices)`, or the error's status and body when generation fails midway. The last output's ids are left
    out: a gateway that has them all but no reply line would ask to go on after a finished generation (past its
    EOS, or with nothing of max_tokens left); without them, a continuation makes that last token again."""
    status, reply = 200, None
    try:
        try:
            async for out in generation.outputs():
                if out.new_token_ids and not out.finished:
                    yield f"{TOKENS_COMMENT}{','.join(map(str, out.new_token_ids))}\n"
            reply = whole(generation.choices)
        except Exception as exc:
            if not isinstance(exc, LOGGED_WHERE_RAISED):
                log.exception("request failed", request_id=generation.request_id)
            error = to_api_error(exc)
            status, reply = error.status, error.payload()
        yield f"{REPLY_LINE}{status}\n{json.dumps(reply, ensure_ascii=False, separators=(',', ':'))}"
    finally:
        await generation.aclose()


async def completion_events(gen: Generation, meta: ResponseMeta, include_usage: bool,
                            logprobs: LogprobFormatter | None, text_offset: int = 0) -> AsyncGenerator[Event, None]:
    """`text_completion` chunks: one per engine output, then the usage chunk if asked. `text_offset`: where the
    first token's logprob offset starts (a resumed stream's goes on from the first one's)."""
    offsets = [text_offset] * len(gen.choices)
    async with aclosing(gen.outputs()) as outputs:
        async for out in outputs:
            lp = None
            if logprobs is not None:
                lp, offsets[out.index] = logprobs.completion(out.logprobs or (), offsets[out.index])
            yield completion_chunk(meta, out, lp, include_usage), out.new_token_ids
    if include_usage:
        yield usage_chunk(meta, "text_completion", gen.num_prompt_tokens, gen.num_completion_tokens), ()


async def chat_events(gen: Generation, meta: ResponseMeta, include_usage: bool, logprobs: LogprobFormatter | None,
                      num_top: int, resumed: bool = False, readers: Callable[[], ReplyReader] | None = None,
                      seen: str = "") -> AsyncGenerator[Event, None]:
    """`chat.completion.chunk`s: the role for each choice (unless `resumed`: the first stream sent it), content
    deltas (the last carries finish_reason), then the usage chunk if asked. `readers`: each choice's text goes through
    a new one, whose deltas (content, reasoning_content, tool_calls) each output's chunk carries, merged; `seen`: what
    a resumed stream's first part showed, read first (and not sent) so that the reader goes on where that one was."""
    # The role chunks go out with the first token, not before: a client's (and the gateway's) first byte then
    # marks the first token (TTFT), and a replica that fails during prefill can still be retried elsewhere.
    started = resumed
    reading = None if readers is None else [readers() for _ in gen.choices]
    if reading is not None and seen:
        reading[0].feed(seen)
    async with aclosing(gen.outputs()) as outputs:
        async for out in outputs:
            if not started:
                started = True
                for choice in gen.choices:
                    yield chat_chunk(meta, choice.index, {"role": "assistant", "content": ""},
                                     include_usage=include_usage), ()
            lp = None if logprobs is None else logprobs.chat(out.logprobs or (), num_top)
            if reading is None:
                yield chat_chunk(meta, out.index, {"content": out.text}, lp, out.finish_reason, out.stop_reason,
                                 include_usage), out.new_token_ids
                continue
            # one chunk an output still (its tokens travel with it), its delta what the reader made of the text
            # (an empty content delta when it holds it all back)
            reader = reading[out.index]
            deltas = reader.feed(out.text)
            if out.finished:
                deltas += reader.finish()
            yield chat_chunk(meta, out.index, merged(deltas) or {"content": ""}, lp,
                             chat_finish_reason(out.finish_reason, reader.called), out.stop_reason,
                             include_usage), out.new_token_ids
    if include_usage:
        yield usage_chunk(meta, "chat.completion.chunk", gen.num_prompt_tokens, gen.num_completion_tokens), ()
