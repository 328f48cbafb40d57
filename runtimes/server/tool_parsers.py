"""Incremental tool-call parsers: a model's output text, fed in pieces of any size, split into message content and
OpenAI tool-call deltas, in the formats vLLM's parsers of the same names accept (`hermes`, `llama3_json`,
`mistral`), so that a streamed reply shows its calls as they are written and a whole reply is the same deltas joined
(`collect`): one parse, whatever the split.

A call's JSON is checked strictly, character by character, so a call is shown only once its name is complete and
all before it is valid; its arguments then stream as their raw JSON text, exactly as the model wrote it (never
re-serialised), each character once it is known to be valid, so the pieces add up to valid JSON. What is not a call
(malformed JSON, an object without a name, text where a call should start) comes out as content, unchanged: no text
is lost. A call already shown cannot be taken back: if its JSON breaks off (the output ended) or turns invalid after
its name, it keeps the arguments streamed so far and the rest is content. Whitespace-only text between calls or
after the last one is dropped. Only what might still become call syntax is held back (`<tool_c` at the end of a
piece, a call's JSON until its name is complete).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from runtimes.server.streamed_call import StreamedCall


@dataclass(frozen=True)
class ToolCallDelta:
    """The next piece of one tool call, as OpenAI streams it: id and whole name first, then arguments' text."""

    index: int  # which call of this reply: 0, 1, ...
    id: str | None  # on the call's first delta only
    name: str | None  # on the call's first delta only, whole
    arguments: str  # the next piece of the arguments' JSON text (may be "")


@dataclass(frozen=True)
class ParsedDelta:
    """What one piece of output adds to the reply."""

    content: str = ""  # for the message's `content`
    reasoning: str = ""  # for `reasoning_content` (reasoning parsers only)
    tool_calls: tuple[ToolCallDelta, ...] = ()


class ToolParser(Protocol):
    """One reply's parser: `feed` each piece of output text, then `finish` once (it flushes what was held back)."""

    def feed(self, text: str) -> ParsedDelta: ...
    def finish(self) -> ParsedDelta: ...
    @property
    def called(self) -> bool: ...  # a call was shown: the reply's finish_reason is "tool_calls"


def new_call_id() -> str:
    """OpenAI's form of a tool call id: "call_" and 24 random lowercase hex digits."""
    return "call_" + secrets.token_hex(12)


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what to hold back: the tag may follow)."""
    start = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while start >= 0 and not tag.startswith(text[start:]):
        start = text.find(tag[0], start + 1)
    return 0 if start < 0 else len(text) - start


class _Parser:
    """What the formats share. Modes: "text" (content; the format looks for a call's start), "item" (a call's object
    must start), "after" (a call ended: SEP, CLOSE or content follows). `_head` is the call syntax consumed since the
    last call, given back as content if no call follows it after all. `new_id` makes the calls' ids (random; tests
    give their own)."""

    OPEN = ""
    SEP: str | None = None
    CLOSE: str | None = None

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id, self._count, self._buf, self._head, self._mode = new_id, 0, "", "", "text"
        self._call: StreamedCall | None = None
        self._ws: str | None = None  # whitespace held right after a call (None: not right after one), then dropped
        self._content: list[str] = []
        self._out: list[ToolCallDelta] = []

    @property
    def called(self) -> bool:
        return self._count > 0

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._run(False)

    def finish(self) -> ParsedDelta:
        return self._run(True)

    def _run(self, final: bool) -> ParsedDelta:
        while self._step(final):
            pass
        out = ParsedDelta("".join(self._content), "", tuple(self._out))
        self._content, self._out = [], []
        return out

    def _step(self, final: bool) -> bool:
        """One step of the current mode; False when it needs more text."""
        if self._call is not None:
            return self._feed_call(self._call, final)
        if self._mode == "text":
            i = self._buf.find(self.OPEN)
            if i < 0:  # content, but what may be the start of OPEN
                cut = len(self._buf) - (0 if final else _partial(self._buf, self.OPEN))
                self._text(self._buf[:cut])
                self._buf = self._buf[cut:]
                return False
            self._text(self._buf[:i])
            self._head, self._buf, self._mode = self.OPEN, self._buf[i + len(self.OPEN) :], "opened"
            return True
        rest = self._buf.lstrip()
        skipped = self._buf[: len(self._buf) - len(rest)]
        if self._mode == "item":
            if not rest and not final:
                return False
            if rest.startswith("{"):
                self._head, self._buf, self._call = self._head + skipped, rest, StreamedCall()
            else:
                self._fail()
        elif self._mode == "after":
            tokens = [t for t in (self.SEP, self.CLOSE) if t]
            tok = next((t for t in tokens if rest.startswith(t)), None)
            if tok is None and not final and any(t.startswith(rest) for t in tokens):
                return False
            if tok is not None:
                self._head, self._buf = (skipped + tok if tok == self.SEP else ""), rest[len(tok) :]
            self._mode = "item" if tok and tok == self.SEP else "text"
        else:
            return self._opened(final)
        return True

    def _opened(self, final: bool) -> bool:
        """OPEN was found: by default a call's object follows."""
        self._mode = "item"
        return True

    def _feed_call(self, call: StreamedCall, final: bool) -> bool:
        taken, state = call.push(self._buf)
        if call.name:
            args = call.args()
            if call.index is None:  # shown from now on: the whitespace and syntax before it are not content
                call.index, self._count, self._ws, self._head = self._count, self._count + 1, None, ""
                self._out.append(ToolCallDelta(call.index, self._new_id(), call.name, args))
            elif len(args) > call.sent:
                self._out.append(ToolCallDelta(call.index, None, None, args[call.sent :]))
            call.sent = len(args)
        if state == "more" and not final:
            self._buf = ""
            return False
        self._call = None
        if call.index is None:  # never shown: not a call after all, its text is content
            self._fail()
            self._buf = call.raw
        else:
            self._buf, self._ws = self._buf[taken:], "" if state == "done" else None
            self._mode = "after" if state == "done" and call.bare is None else "text"
        return True

    def _fail(self) -> None:
        self._text(self._head)
        self._head, self._mode = "", "text"

    def _text(self, text: str) -> None:
        if self._ws is not None:
            text, self._ws = self._ws + text, None
            if text.isspace() or not text:
                self._ws = text
                return
        if text:
            self._content.append(text)


class HermesToolParser(_Parser):
    """Hermes 2 Pro, Qwen2.5, Qwen3: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, any number,
    anywhere in the text; text outside the tags is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Llama3JsonToolParser(_Parser):
    """Llama 3.1/3.2: the whole output is `{"name": "f", "parameters": {...}}` (or "arguments"), optionally after
    `<|python_tag|>`, several separated by `;`. An output that does not start like that is content."""

    OPEN, SEP = "<|python_tag|>", ";"

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._mode = "start"

    def _step(self, final: bool) -> bool:
        if self._call is None and self._mode == "text":  # past the start, what is not a call is content
            self._text(self._buf)
            self._buf = ""
            return False
        if self._call is None and self._mode == "start":
            rest = self._buf.lstrip()
            if not final and self.OPEN.startswith(rest) and rest != self.OPEN:
                return False  # the tag may still come, or a call after the whitespace
            self._mode = "item" if rest.startswith((self.OPEN, "{")) else "text"
            if self._mode == "item":  # the whitespace and tag before the call are its syntax
                n = len(self._buf) - len(rest) + (len(self.OPEN) if rest.startswith(self.OPEN) else 0)
                self._head, self._buf = self._buf[:n], self._buf[n:]
        return super()._step(final)


class MistralToolParser(_Parser):
    """Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]f[ARGS]{...}`
    (or `[TOOL_CALLS]f{...}`), repeated; text before `[TOOL_CALLS]` is content."""

    OPEN, SEP, CLOSE = "[TOOL_CALLS]", ",", "]"

    def _opened(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        self._head += self._buf[: len(self._buf) - len(rest)]
        if rest.startswith("["):  # the JSON array of calls
            self._head, self._buf, self._mode = self._head + "[", rest[1:], "item"
            return True
        name: str = re.findall(r"^[\w.\-]*", rest)[0]
        after = rest[len(name) :]
        opener = "[ARGS]" if after.startswith("[ARGS]") else "" if after.startswith("{") else None
        if name and opener is not None:  # the name, then its arguments' object alone
            self._head += name + opener
            self._buf, self._call = after[len(opener) :], StreamedCall(bare=name)
            return True
        self._buf = rest
        if not final and "[ARGS]".startswith(after):
            return False
        self._fail()
        return True


TOOL_PARSERS: Mapping[str, Callable[[], ToolParser]] = MappingProxyType(
    {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}
)


def tool_parser_for_template(chat_template: str) -> str | None:
    """The parser for the tool-call syntax a chat template itself writes (in the tool calls of earlier turns, or in
    the instructions it gives the model), or None when it shows none."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    llama_json = '"parameters"' in chat_template and "<|start_header_id|>" in chat_template  # 3.2 has no python_tag
    if "<|python_tag|>" in chat_template or llama_json:
        return "llama3_json"
    return None


def collect(deltas: Iterable[ParsedDelta]) -> tuple[str, str, list[dict[str, Any]]]:
    """A whole reply from its deltas: (content, reasoning, OpenAI `tool_calls`), for a reply that is not streamed."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        for d in delta.tool_calls:
            call = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                              "function": {"name": d.name, "arguments": ""}})
            call["function"]["arguments"] += d.arguments
    return "".join(content), "".join(reasoning), [calls[i] for i in sorted(calls)]
