"""OpenAI response bodies and streaming chunks, built as plain dicts from the server's per-choice state.

Shapes follow OpenAI's API (`text_completion`, `chat.completion`, `chat.completion.chunk`), plus vLLM's
`stop_reason` on each choice (the stop string or token id that ended it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from runtimes.llm.outputs import RequestOutput, TokenLogprob
from runtimes.llm.tokenizer import Tokenizer
from runtimes.server.generation import Choice
from runtimes.server.tool_calls import ReplyReader, read_whole, reply_message


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    id: str
    created: int  # unix seconds
    model: str


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


class LogprobFormatter:
    """Token logprobs in OpenAI's two shapes (legacy completions, chat).

    Token strings are the token's own decoded text (special tokens spelled out). A byte-level token
    holding part of a multi-byte character decodes to U+FFFD, and so do its `bytes` in the chat shape.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.token = functools.lru_cache(maxsize=65536)(self._token)

    def _token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, entries: Sequence[TokenLogprob], text_offset: int) -> tuple[dict[str, Any], int]:
        """Legacy shape for these tokens, their offsets starting at `text_offset`; also the next offset."""
        tokens = [self.token(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        body = {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }
        return body, text_offset

    def chat(self, entries: Sequence[TokenLogprob], num_top: int) -> dict[str, Any]:
        """Chat shape: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}`."""
        return {"content": [self._chat_entry(e, num_top) for e in entries], "refusal": None}

    def _chat_entry(self, entry: TokenLogprob, num_top: int) -> dict[str, Any]:
        # The sampler appends the sampled token to the top list when it is not among the best `num_top`;
        # OpenAI's chat shape lists exactly `num_top` alternatives.
        top = [self._item(t, lp) for t, lp in entry.top[:num_top]]
        return {**self._item(entry.token_id, entry.logprob), "top_logprobs": top}

    def _item(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


# ---------------------------------------------------------------------------------------------- completions


def completion_body(meta: ResponseMeta, choices: Sequence[Choice], num_prompt_tokens: int,
                    logprobs: LogprobFormatter | None) -> dict[str, Any]:
    """A whole `text_completion` response."""
    return {
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "choices": [
            {"index": c.index, "text": c.text,
             "logprobs": None if logprobs is None else logprobs.completion(c.logprobs, 0)[0],
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for c in choices
        ],
        "usage": usage(num_prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def completion_chunk(meta: ResponseMeta, out: RequestOutput, logprobs: dict[str, Any] | None,
                     include_usage: bool) -> dict[str, Any]:
    """One streamed `text_completion` chunk for one engine output."""
    chunk = {
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "choices": [{"index": out.index, "text": out.text, "logprobs": logprobs,
                     "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}],
    }
    return {**chunk, "usage": None} if include_usage else chunk


def usage_chunk(meta: ResponseMeta, object_name: str, num_prompt_tokens: int,
                num_completion_tokens: int) -> dict[str, Any]:
    """The last chunk before `[DONE]` when `stream_options.include_usage`: no choices, only usage."""
    return {"id": meta.id, "object": object_name, "created": meta.created, "model": meta.model, "choices": [],
            "usage": usage(num_prompt_tokens, num_completion_tokens)}


# ---------------------------------------------------------------------------------------------- chat


def chat_body(meta: ResponseMeta, choices: Sequence[Choice], num_prompt_tokens: int,
              logprobs: LogprobFormatter | None, num_top: int,
              readers: Callable[[], ReplyReader] | None = None) -> dict[str, Any]:
    """A whole `chat.completion` response. `readers`: each choice's text is read by a new one into its message's
    content, reasoning_content and tool_calls (None: the text is the content)."""
    return {
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
        "choices": [
            {"index": c.index, **_chat_message(c, readers),
             "logprobs": None if logprobs is None else logprobs.chat(c.logprobs, num_top),
             "stop_reason": c.stop_reason}
            for c in choices
        ],
        "usage": usage(num_prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def _chat_message(choice: Choice, readers: Callable[[], ReplyReader] | None) -> dict[str, Any]:
    if readers is None:
        return {"message": {"role": "assistant", "content": choice.text}, "finish_reason": choice.finish_reason}
    reader = readers()
    message = reply_message(read_whole(reader, choice.text))
    return {"message": message, "finish_reason": chat_finish_reason(choice.finish_reason, reader.called)}


def chat_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by itself after calling tools (one cut short stays "length")."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def chat_chunk(meta: ResponseMeta, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
               finish_reason: str | None = None, stop_reason: int | str | None = None,
               include_usage: bool = False) -> dict[str, Any]:
    """One `chat.completion.chunk` for one choice: the role opener, a content delta, or the last delta."""
    chunk = {
        "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                     "stop_reason": stop_reason}],
    }
    return {**chunk, "usage": None} if include_usage else chunk
