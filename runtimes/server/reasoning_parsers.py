"""Incremental reasoning parsers: a model's output text, fed in pieces of any size, split into `reasoning_content`
(the model's thinking) and content, and `chain`, which sends that content on through a tool parser, so that a call
the model only thinks about is never taken for one it makes.

`think` reads a `<think>…</think>` block at the start of the output (Qwen3, QwQ, DeepSeek-R1). When the chat
template's generation prompt opens the block itself (DeepSeek-R1, QwQ), the output starts inside it: the parser is
made with `starts_inside=True`, and then everything up to `</think>` is reasoning (a repeated `<think>` at the very
start is dropped). Otherwise an output that does not begin with `<think>` is all content. Text after `</think>` is
content, without the whitespace that separates it from the block; an output that ends inside the block is all
reasoning. The only text held back is what might still become a tag.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

from runtimes.server.tool_parsers import ParsedDelta, ToolCallDelta, ToolParser, _partial


class ReasoningParser(Protocol):
    def feed(self, text: str) -> ParsedDelta: ...  # the next piece of output: its reasoning and content
    def finish(self) -> ParsedDelta: ...  # the output ended: what was held back


class ReasoningParserFactory(Protocol):
    def __call__(self, starts_inside: bool = False) -> ReasoningParser: ...


class ThinkReasoningParser:
    """`<think>reasoning</think>content`; see the module's docstring."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, starts_inside: bool = False) -> None:
        self._starts_inside = starts_inside
        self._state = "start"  # start (is there a <think>?), inside, gap (whitespace after </think>), content
        self._buf = ""

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._run(False)

    def finish(self) -> ParsedDelta:
        return self._run(True)

    def _run(self, final: bool) -> ParsedDelta:
        reasoning = content = ""
        if self._state == "start":
            rest = self._buf.lstrip()
            if rest.startswith(self.OPEN):
                self._buf, self._state = rest[len(self.OPEN) :], "inside"
            elif not final and self.OPEN.startswith(rest):
                return ParsedDelta()
            else:
                self._state = "inside" if self._starts_inside else "content"
        if self._state == "inside":
            end = self._buf.find(self.CLOSE)
            if end < 0:
                end = len(self._buf) - (0 if final else _partial(self._buf, self.CLOSE))
                reasoning, self._buf = self._buf[:end], self._buf[end:]
            else:
                reasoning, self._buf = self._buf[:end], self._buf[end + len(self.CLOSE) :]
                self._state = "gap"
        if self._state == "gap":
            self._buf = self._buf.lstrip()
            self._state = "content" if self._buf else "gap"
        if self._state == "content":
            content, self._buf = self._buf, ""
        return ParsedDelta(content=content, reasoning=reasoning)


REASONING_PARSERS: Mapping[str, ReasoningParserFactory] = MappingProxyType({"think": ThinkReasoningParser})


def reasoning_parser_for_template(chat_template: str) -> tuple[str, bool] | None:
    """The reasoning parser a chat template implies, and whether the output starts inside the block: ("think",
    True) when the template's generation prompt (its part from the last `add_generation_prompt` on) opens a
    `<think>` block it does not close, ("think", False) when the template only mentions the tags, else None."""
    if "<think>" not in chat_template and "</think>" not in chat_template:
        return None
    start = chat_template.rfind("add_generation_prompt")
    prompt = chat_template[start:] if start >= 0 else ""
    return "think", prompt.count("<think>") > prompt.count("</think>")


def _merge(a: ParsedDelta, b: ParsedDelta) -> ParsedDelta:
    """Two deltas as one, a call's consecutive pieces joined."""
    calls: list[ToolCallDelta] = []
    for d in a.tool_calls + b.tool_calls:
        if calls and calls[-1].index == d.index and d.id is None:
            last = calls.pop()
            d = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
        calls.append(d)
    return ParsedDelta(a.content + b.content, a.reasoning + b.reasoning, tuple(calls))


class _Chain:
    """A reasoning parser's content sent on through a tool parser; either may be absent."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning, self._tools = reasoning, tools

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.called

    def feed(self, text: str) -> ParsedDelta:
        first = self._reasoning.feed(text) if self._reasoning else ParsedDelta(content=text)
        return self._on(first, False)

    def finish(self) -> ParsedDelta:
        return self._on(self._reasoning.finish() if self._reasoning else ParsedDelta(), True)

    def _on(self, first: ParsedDelta, final: bool) -> ParsedDelta:
        if self._tools is None:
            return first
        out = _merge(ParsedDelta(reasoning=first.reasoning), self._tools.feed(first.content))
        return _merge(out, self._tools.finish()) if final else out


def chain(reasoning: ReasoningParser | None, tools: ToolParser | None) -> ToolParser:
    """One parser for a reply: reasoning first, then its content through the tool parser (feed, finish, called)."""
    return _Chain(reasoning, tools)
