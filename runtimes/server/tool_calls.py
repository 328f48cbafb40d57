"""OpenAI tool calling on /v1/chat/completions: the request's `tools`, `tool_choice` and `parallel_tool_calls`
checked (a 400 names the field, e.g. `tools[2].function.name`), the chat template's view of tools and of a
conversation that called them, the constraint that makes `tool_choice` "required" or a named function hold, and each
choice's reply read into content, reasoning and tool calls as OpenAI's deltas.

Templates: one that mentions `tools` renders them with its own syntax (it gets `tools=` as transformers passes them,
and assistant turns whose `function.arguments` are objects, as transformers' templates expect). One that does not
(SmolLM2-Instruct's) gets them from DEFAULT_TOOL_PROMPT (Hermes style) in its system message, and the history as
text: an assistant's calls as `<tool_call>` blocks, tool results as a user turn of `<tool_response>` blocks; its
replies are read by the "hermes" parser.

tool_choice: "required" constrains the output to a JSON array of 1..N calls `{"name", "arguments"}` (N = 1 without
parallel_tool_calls), a named function to that function's arguments object, as vLLM does; "auto" leaves the output
free and a tool parser finds the calls; "none" renders the tools (where the template has a syntax for them) and parses
nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from foundation.request_errors import InvalidRequestError
from runtimes.llm.sampling_params import StructuredOutput
from runtimes.server.reasoning_parsers import REASONING_PARSERS, chain, reasoning_parser_for_template
from runtimes.server.tool_parsers import TOOL_PARSERS, ParsedDelta, ToolParser, tool_parser_for_template

MAX_TOOLS = 128
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# The system prompt that tells a model whose template has no tool syntax which tools it has and how to call them
# (Hermes' format, which Qwen2.5's template also uses); `{tools}` is one JSON signature a line.
DEFAULT_TOOL_PROMPT = (
    "You may call functions. Their signatures are within <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call one, answer with <tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)
DEFAULT_TOOL_PARSER = "hermes"  # reads what DEFAULT_TOOL_PROMPT asks for
ToolChoiceMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # a JSON schema object
    spec: dict[str, Any]  # the tool as the request gave it ({"type": "function", "function": {...}}), nulls dropped


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools: its tools, the choice among them and whether calls may be parallel."""

    tools: tuple[Tool, ...]
    mode: ToolChoiceMode
    name: str | None = None  # the function a named tool_choice forces
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def constraint(self) -> StructuredOutput | None:
        """The JSON schema the output must follow (required, named), or None (auto, none)."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.name)
            return StructuredOutput(json_schema=_canonical(tool.parameters), param="tool_choice")
        if self.mode == "required":
            return StructuredOutput(json_schema=_canonical(required_schema(self.tools, self.parallel)),
                                    param="tool_choice")
        return None


def required_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": an array of 1..N calls (N = 1 without parallel calls), each `{"name": <a tool's name>,
    "arguments": <that tool's parameters>}`, as vLLM builds it."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                               "arguments": tool.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _canonical(schema: dict[str, Any]) -> str:
    """The schema as JSON text, its keys in their order: the output's properties come in that order ("name" before
    "arguments", which RequiredCallsReader streams once it knows whose they are)."""
    return json.dumps(schema, allow_nan=False)


def _invalid(param: str, reason: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {reason}", param=param)


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The request's tools, checked; None when it gives none (a `tool_choice` that needs them is then refused)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _invalid("parallel_tool_calls", "must be a boolean")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    checked = _tools(tools) if tools is not None else ()
    if not checked:
        if tool_choice is None or tool_choice == "none":  # what a request without tools gets anyway
            return None
        raise _invalid("tool_choice", "is only allowed when tools are given")
    mode, name = _tool_choice(tool_choice, checked)
    return ToolRequest(checked, mode, name, parallel)


def _tools(value: Any) -> tuple[Tool, ...]:
    if not isinstance(value, list):
        raise _invalid("tools", "must be a list of {\"type\": \"function\", \"function\": {...}}")
    if len(value) > MAX_TOOLS:
        raise _invalid("tools", f"at most {MAX_TOOLS} tools, got {len(value)}")
    tools, seen = [], set()
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise _invalid(where, "must be an object {\"type\": \"function\", \"function\": {...}}")
        if item.get("type") != "function":
            raise _invalid(f"{where}.type", "must be \"function\"")
        extra = sorted(set(item) - {"type", "function"})
        if extra:
            raise _invalid(f"{where}.{extra[0][:64]}", "unknown field")
        function = item.get("function")
        if not isinstance(function, dict):
            raise _invalid(f"{where}.function", "must be an object with a name")
        extra = sorted(k for k in set(function) - set(_FUNCTION_KEYS) if function[k] is not None)
        if extra:
            raise _invalid(f"{where}.function.{extra[0][:64]}", "unknown field")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise _invalid(f"{where}.function.name", "must be 1-64 letters, digits, underscores or dashes")
        if name in seen:
            raise _invalid(f"{where}.function.name", f"{name!r} names two tools")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid(f"{where}.function.description", "must be a string")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _invalid(f"{where}.function.strict", "must be a boolean")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        elif not isinstance(parameters, dict):
            raise _invalid(f"{where}.function.parameters", "must be a JSON schema object")
        else:
            try:
                _canonical(parameters)
            except (ValueError, RecursionError):
                raise _invalid(f"{where}.function.parameters", "must be JSON (no NaN, not nested too deeply)") from None
        spec = {"type": "function",
                "function": {k: v for k, v in {**function, "parameters": parameters}.items() if v is not None}}
        tools.append(Tool(name, parameters, spec))
    return tuple(tools)


def _tool_choice(value: Any, tools: Sequence[Tool]) -> tuple[ToolChoiceMode, str | None]:
    if value is None or value == "auto":
        return "auto", None
    if value in ("none", "required"):
        return value, None
    if not isinstance(value, dict):
        raise _invalid("tool_choice", "must be \"none\", \"auto\", \"required\" or "
                                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if value.get("type") != "function":
        raise _invalid("tool_choice.type", "must be \"function\"")
    function = value.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _invalid("tool_choice.function", "must be an object {\"name\": <one of the tools>}")
    name = function["name"]
    if all(tool.name != name for tool in tools):
        raise _invalid("tool_choice.function.name", f"{name[:64]!r} is none of the tools' names")
    return "named", name


# ------------------------------------------------------------------------------------------ templates


def template_has_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads a `tools` variable)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template or "") is not None


def template_inputs(messages: Sequence[dict[str, Any]], request: ToolRequest | None,
                    chat_template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` to render: as transformers passes them to a template with a tool syntax (arguments
    as objects), else the history as text and the tools in the system message (none for tool_choice "none")."""
    _check_history(messages)
    if template_has_tools(chat_template):
        tools = [tool.spec for tool in request.tools] if request is not None else None
        return [_arguments_as_objects(m) for m in messages], tools
    rendered = _history_as_text(messages)
    if request is not None and request.mode != "none":
        prompt = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t.spec, ensure_ascii=False)
                                                            for t in request.tools))
        first = rendered[0] if rendered else None
        if first is not None and first["role"] in ("system", "developer") and isinstance(first.get("content"), str):
            rendered[0] = {**first, "content": f"{first['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _check_history(messages: Sequence[dict[str, Any]]) -> None:
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if message.get("role") != "assistant":
            raise _invalid(f"messages[{i}].tool_calls", "only an assistant message calls tools")
        if not isinstance(calls, list):
            raise _invalid(f"messages[{i}].tool_calls", "must be a list of tool calls")
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise _invalid(f"{where}.function", "must be an object with a name and arguments")
            if not isinstance(function.get("arguments", "{}"), (str, dict)):
                raise _invalid(f"{where}.function.arguments", "must be a string of JSON")


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [
        {**call, "function": {**call["function"], "arguments": _arguments_object(call["function"].get("arguments",
                                                                                                       "{}"))}}
        for call in calls]}


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def _history_as_text(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant calls as `<tool_call>` blocks after its text; each run of tool results as one user turn of
    `<tool_response>` blocks (a template that wants roles to alternate still gets them alternating)."""
    out: list[dict[str, Any]] = []
    tool_run = False
    for message in messages:
        if message.get("role") == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if tool_run:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
            tool_run = True
            continue
        tool_run = False
        calls = message.get("tool_calls")
        if calls:
            blocks = [json.dumps({"name": c["function"]["name"],
                                  "arguments": _arguments_object(c["function"].get("arguments", "{}"))},
                                 ensure_ascii=False) for c in calls]
            text = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            content = _text(message.get("content"))
            rest = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**rest, "content": f"{content}\n{text}" if content else text})
        else:
            out.append({k: v for k, v in message.items() if k != "tool_call_id"})
    return out


# ------------------------------------------------------------------------------------------ replies


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ReplyReader(Protocol):
    """Reads one choice's text as it comes: each `feed` and the `finish` return OpenAI delta objects (content,
    reasoning_content, tool_calls); `called` once a tool call has begun."""

    @property
    def called(self) -> bool: ...

    def feed(self, text: str) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...


def call_delta(index: int, call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    """One tool call's delta: the first carries its id, type and name (arguments "" or more), the rest arguments."""
    if name is not None:
        return {"tool_calls": [{"index": index, "id": call_id or new_call_id(), "type": "function",
                                "function": {"name": name, "arguments": arguments}}]}
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


class NamedCallReader:
    """tool_choice naming a function: the output is that call's arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.called = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.called:
            return [call_delta(0, None, None, text)] if text else []
        self.called = True
        return [call_delta(0, None, self._name, text)]

    def finish(self) -> list[dict[str, Any]]:
        return self.feed("")


class RequiredCallsReader:
    """tool_choice "required": the output is a JSON array of `{"name": ..., "arguments": ...}` (the constraint holds
    it to that, "name" first); each call is announced once its name is read, then its arguments' text streams as it
    comes. One pass over the characters, whatever the pieces."""

    def __init__(self) -> None:
        self.called = False
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._index = -1
        self._object = ""  # the current call's text so far
        self._string_start = 0  # where the string being read began in _object
        self._last_string: str | None = None  # the last string read at the call's level (a key or a value)
        self._key: str | None = None  # the key whose value is being read
        self._name: str | None = None
        self._args_start: int | None = None  # where its arguments begin in _object (None: not in them)
        self._sent = 0  # how much of the arguments went out
        self._text: list[str] = []  # all of it: the content of an output cut short before any call

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text.append(text)
        deltas: list[dict[str, Any]] = []
        for char in text:
            self._step(char, deltas)
        if self._args_start is not None:
            self._flush(len(self._object), deltas)
        return deltas

    def finish(self) -> list[dict[str, Any]]:
        text = "".join(self._text)
        return [] if self.called or not text else [{"content": text}]

    def _step(self, char: str, deltas: list[dict[str, Any]]) -> None:
        if self._depth >= 2:
            self._object += char
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._depth == 2:
                    self._string_read(deltas)
            return
        if char == '"':
            self._in_string = True
            self._string_start = len(self._object) - 1
        elif char in "[{":
            self._depth += 1
            if self._depth == 2:  # a call begins
                self._index += 1
                self._object, self._name, self._key, self._last_string = char, None, None, None
                self._args_start, self._sent = None, 0
        elif char in "]}":
            self._depth -= 1
            if self._depth == 1 and self._args_start is not None:  # the call ends: its arguments, less its "}"
                self._flush(len(self._object) - 1, deltas)
                self._args_start = None
        elif self._depth == 2 and char == ":":
            self._key, self._last_string = self._last_string, None
            if self._key == "arguments" and self._name is not None:
                self._args_start = len(self._object)
        elif self._depth == 2 and char == ",":
            if self._args_start is not None:  # arguments done (a value that is not an object or array)
                self._flush(len(self._object) - 1, deltas)
                self._args_start = None
            self._key = None

    def _string_read(self, deltas: list[dict[str, Any]]) -> None:
        text = json.loads(self._object[self._string_start:])
        if self._key == "name" and self._name is None and self._args_start is None:
            self._name = text
            self.called = True
            deltas.append(call_delta(self._index, None, text, ""))
        elif self._key is None:
            self._last_string = text

    def _flush(self, end: int, deltas: list[dict[str, Any]]) -> None:
        assert self._args_start is not None
        start = self._args_start + self._sent
        if end <= start:
            return
        piece = self._object[start:end]
        if self._sent == 0:
            piece = piece.lstrip()
            self._sent += end - start - len(piece)
            if not piece:
                return
        self._sent += len(piece)
        deltas.append(call_delta(self._index, None, None, piece))


class ParsedReader:
    """tool_choice "auto": the model answers in text or calls tools in its own syntax, which a tool parser
    (runtimes/server/tool_parsers.py) reads as the text comes."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser

    @property
    def called(self) -> bool:
        return self._parser.called

    def feed(self, text: str) -> list[dict[str, Any]]:
        return _deltas(self._parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return _deltas(self._parser.finish())


def reply_readers(request: ToolRequest | None, chat_template: str | None, tool_parser: str | None = None,
                  reasoning_parser: str | None = None) -> Callable[[], ReplyReader] | None:
    """What reads each choice's text into content, reasoning_content and tool calls (a new reader per choice); None:
    the text is the content.

    tool_choice "required" or named: the constrained output is the call(s). "auto": `tool_parser` (the registry's
    `chat.tool_parser`), else the parser the template's own tool syntax implies, else the one that reads what
    DEFAULT_TOOL_PROMPT asks for. With or without tools, `reasoning_parser` (`chat.reasoning_parser`; "none": never;
    None: the one the template implies) first splits off the model's thinking, so that a call it only thinks about
    is not taken for one it makes."""
    if request is not None and request.mode == "named":
        name = request.name
        assert name is not None
        return lambda: NamedCallReader(name)
    if request is not None and request.mode == "required":
        return RequiredCallsReader
    template = chat_template or ""
    reasoning: tuple[str, bool] | None = None
    if reasoning_parser is None:
        reasoning = reasoning_parser_for_template(template)
    elif reasoning_parser != "none":
        implied = reasoning_parser_for_template(template)
        reasoning = reasoning_parser, implied is not None and implied[0] == reasoning_parser and implied[1]
    tools: str | None = None
    if request is not None and request.mode == "auto":
        implied_tools = tool_parser_for_template(template) if template_has_tools(chat_template) else None
        tools = tool_parser or implied_tools or DEFAULT_TOOL_PARSER
    if reasoning is None and tools is None:
        return None
    return lambda: ParsedReader(chain(
        REASONING_PARSERS[reasoning[0]](starts_inside=reasoning[1]) if reasoning is not None else None,
        TOOL_PARSERS[tools]() if tools is not None else None))


def _deltas(parsed: ParsedDelta) -> list[dict[str, Any]]:
    deltas: list[dict[str, Any]] = []
    if parsed.reasoning:
        deltas.append({"reasoning_content": parsed.reasoning})
    if parsed.content:
        deltas.append({"content": parsed.content})
    deltas += [call_delta(call.index, call.id, call.name, call.arguments) for call in parsed.tool_calls]
    return deltas


class PlainReader:
    """No tools to read and no reasoning to split: the text is the content."""

    called = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict[str, Any]]:
        return []


def merged(deltas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Deltas as one: content and reasoning joined, each call's pieces joined under its index (a stream's chunk for one
    output, or with every delta of a choice, its whole message's fields)."""
    out: dict[str, Any] = {}
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for key in ("reasoning_content", "content"):
            if delta.get(key):
                out[key] = out.get(key, "") + delta[key]
        for call in delta.get("tool_calls", ()):
            known = calls.get(call["index"])
            if known is None:
                calls[call["index"]] = {**call, "function": dict(call["function"])}
            else:
                known["function"]["arguments"] += call["function"].get("arguments", "")
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def read_whole(reader: ReplyReader, text: str) -> dict[str, Any]:
    """A whole choice's text read at once: its message's content, reasoning_content and tool_calls."""
    return merged([*reader.feed(text), *reader.finish()])


def reply_message(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message of a whole reply from its read fields: content is null when the reply only calls tools,
    reasoning_content only when there was reasoning, tool_calls only when there were calls."""
    calls = fields.get("tool_calls")
    content = fields.get("content", "")
    message: dict[str, Any] = {"role": "assistant", "content": (content or None) if calls else content}
    if "reasoning_content" in fields:
        message["reasoning_content"] = fields["reasoning_content"]
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]} for c in calls]
    return message
