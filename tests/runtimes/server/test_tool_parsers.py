"""The tool-call parsers: each format whole and split at every character boundary (and at random ones) gives the same
reply, calls stream their name once known and their arguments as the text arrives, and what is not a call comes out
as content unchanged."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtimes.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedDelta,
    ToolCallDelta,
    collect,
    new_call_id,
    tool_parser_for_template,
)

Calls = list[tuple[str, str]]  # (name, arguments' text) of each call
PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}


def counting_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


def stream(parser: str, pieces: Sequence[str]) -> tuple[list[ParsedDelta], bool]:
    p = PARSERS[parser](counting_ids())
    deltas = [p.feed(piece) for piece in pieces] + [p.finish()]
    return deltas, p.called


def reply(parser: str, pieces: Sequence[str]) -> tuple[str, Calls]:
    """The collected reply, checking the deltas' form on the way: one first delta a call, with its id and name."""
    deltas, called = stream(parser, pieces)
    seen: list[int] = []
    for d in (d for delta in deltas for d in delta.tool_calls):
        assert (d.id is not None) == (d.name is not None) == (d.index not in seen)
        if d.index not in seen:
            assert d.index == len(seen)
            seen.append(d.index)
    content, reasoning, calls = collect(deltas)
    assert reasoning == ""
    assert called == bool(calls)
    assert [c["id"] for c in calls] == [f"call_{i:024x}" for i in range(len(calls))]
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def check_splits(parser: str, text: str) -> tuple[str, Calls]:
    """The reply to `text` whole, after checking that every split in two and one character at a time give it too."""
    whole = reply(parser, [text])
    for k in range(len(text) + 1):
        assert reply(parser, [text[:k], text[k:]]) == whole, k
    assert reply(parser, list(text)) == whole
    return whole


WELL_FORMED: list[tuple[str, str, str, Calls]] = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [("get_weather", '{"city": "Paris"}')]),
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "a", "arguments": {"x": [1, -2.5e+3, true, null]}}\n'
     '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n', "Let me check.\n\n",
     [("a", '{"x": [1, -2.5e+3, true, null]}'), ("b", "{}")]),
    ("hermes", '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>\nDone.', "\nDone.",
     [("search", '{"q": "x"}')]),
    ("hermes", '<tool_call>{"name": "no_args"}</tool_call>', "", [("no_args", "{}")]),
    ("hermes", 'Wetter 🌦 <tool_call>{"name": "wetter", "arguments": {"ort": "Zürich", "e": "\\u00e9\\n"}}</tool_call>',
     "Wetter 🌦 ", [("wetter", '{"ort": "Zürich", "e": "\\u00e9\\n"}')]),
    ("hermes", 'a < b and <tool but not a call', "a < b and <tool but not a call", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "arguments": {"s": "ü"}}', "",
     [("a", '{"n": 1}'), ("b", '{"s": "ü"}')]),
    ("llama3_json", ' \n{"name": "f", "parameters": {}} trailing words', " trailing words", [("f", "{}")]),
    ("llama3_json", "The answer is {42}.", "The answer is {42}.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [("get_weather", '{"city": "Paris"}')]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "é"}}]',
     "Sure. ", [("a", '{"x": 1}'), ("b", '{"y": "é"}')]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f{"n": [1, 2]}', "",
     [("get_weather", '{"city": "Paris"}'), ("f", '{"n": [1, 2]}')]),
    ("mistral", "No calls [TOOL here.", "No calls [TOOL here.", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), WELL_FORMED)
def test_well_formed_whole_and_split_everywhere(parser: str, text: str, content: str, calls: Calls) -> None:
    assert check_splits(parser, text) == (content, calls)
    for _, arguments in calls:
        json.loads(arguments)


MALFORMED = [
    ("hermes", 'x <tool_call>{"name": 1, "arguments": {}}</tool_call> y'),  # the name is not a string
    ("hermes", "<tool_call>{'name': 'f', 'arguments': {}}</tool_call>"),  # Python, not JSON
    ("hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "", "arguments": {}}</tool_call>'),
    ("hermes", 'before <tool_call>{"arguments": {"a": 1'),  # ends before the name
    ("hermes", "<tool_call>not json</tool_call> after"),
    ("hermes", "<tool_c"),
    ("llama3_json", '{"answer": 42}'),  # JSON, but not a call
    ("llama3_json", "<|python_tag|>print('hi')"),
    ("llama3_json", 'Here: {"name": "f", "parameters": {}}'),  # does not start like a call
    ("mistral", "[TOOL_CALLS]f[ARGS]nope"),
    ("mistral", "[TOOL_CALLS] [nope]"),
    ("mistral", "text [TOOL_CALLS]"),
]


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_what_is_not_a_call_is_content_unchanged(parser: str, text: str) -> None:
    assert check_splits(parser, text) == (text, [])


def test_a_malformed_call_after_good_ones_is_content() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name" "b"}</tool_call>'
    assert check_splits("hermes", text) == ('\n<tool_call>{"name" "b"}</tool_call>', [("a", "{}")])
    text = '{"name": "a", "parameters": {}}; oops'
    assert check_splits("llama3_json", text) == ("; oops", [("a", "{}")])


def test_a_call_shown_then_cut_short_keeps_what_was_streamed() -> None:
    # once its name has gone out a call cannot be taken back: the rest of the text is content
    text = '<tool_call>{"name": "f", "arguments": {"a": True}}</tool_call>'
    assert check_splits("hermes", text) == ("True}}</tool_call>", [("f", '{"a": ')])
    assert check_splits("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1') == ("", [("f", '{"a": 1')])


def test_content_streams_at_once_and_only_a_possible_tag_is_held_back() -> None:
    p = TOOL_PARSERS["hermes"]()
    assert p.feed("Hello <to") == ParsedDelta(content="Hello ")
    assert p.feed("ol") == ParsedDelta()
    assert p.feed("s!") == ParsedDelta(content="<tools!")
    assert p.feed(" <") == ParsedDelta(content=" ")
    assert p.finish() == ParsedDelta(content="<")
    p = TOOL_PARSERS["mistral"]()
    assert p.feed("a [TOOL") == ParsedDelta(content="a ")
    assert p.feed("S]") == ParsedDelta(content="[TOOLS]")
    p = TOOL_PARSERS["llama3_json"]()
    assert p.feed("<|py") == ParsedDelta()
    assert p.feed("thon is nice") == ParsedDelta(content="<|python is nice")
    assert p.feed(" {") == ParsedDelta(content=" {")


def pieces_of(deltas: list[ParsedDelta]) -> list[ToolCallDelta]:
    return [d for delta in deltas for d in delta.tool_calls]


@pytest.mark.parametrize(
    ("parser", "prefix"),
    [("hermes", "<tool_call>\n"), ("llama3_json", "<|python_tag|>"), ("mistral", "[TOOL_CALLS][")],
)
def test_name_once_known_then_arguments_as_they_arrive(parser: str, prefix: str) -> None:
    p = TOOL_PARSERS[parser]()
    assert p.feed(prefix + '{"name": "get_wea') == ParsedDelta()
    first = p.feed('ther", "arguments": {"city": "Pa')
    [call] = first.tool_calls
    assert (call.index, call.name, call.arguments) == (0, "get_weather", '{"city": "Pa')
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id or "")
    assert p.called
    assert p.feed('ris"}}') == ParsedDelta(tool_calls=(ToolCallDelta(0, None, None, 'ris"}'),))


def test_mistral_bare_form_streams_the_name_when_its_arguments_start() -> None:
    p = TOOL_PARSERS["mistral"]()
    assert p.feed("[TOOL_CALLS]get_weather") == ParsedDelta()
    assert p.feed("[AR") == ParsedDelta()
    [call] = p.feed('GS]{"city"').tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city"')
    assert p.feed(': "Paris"}').tool_calls == (ToolCallDelta(0, None, None, ': "Paris"}'),)


def test_registry() -> None:
    assert dict(TOOL_PARSERS) == PARSERS


def test_ids_are_openai_style_and_random() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


# No subnormal floats: engine tests stepping on this thread turn on flush-to-zero (ModelRunner._flush_denormals), under
# which Hypothesis refuses to generate them.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,15}", fullmatch=True)


def splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def render(parser: str, calls: list[tuple[str, str]], lead: str) -> str:
    objects = [json.dumps({"name": n, "arguments": 0}).replace("0}", a + "}") for n, a in calls]
    if parser == "hermes":
        return lead + "".join(f"<tool_call>\n{o}\n</tool_call>\n" for o in objects)
    if parser == "llama3_json":
        return "<|python_tag|>" + "; ".join(objects)
    return lead + "[TOOL_CALLS][" + ", ".join(objects) + "]"


@settings(max_examples=150, deadline=None)
@given(
    parser=st.sampled_from(sorted(TOOL_PARSERS)),
    calls=st.lists(st.tuples(NAMES, st.dictionaries(st.text(max_size=6), JSON, max_size=3)), min_size=1, max_size=3),
    ascii_only=st.booleans(),
    indent=st.sampled_from([None, 1]),
    lead=st.text(max_size=8).filter(lambda s: "<" not in s and "[" not in s),
    cuts=st.lists(st.integers(min_value=0), max_size=12),
)
def test_generated_calls_survive_any_split(
    parser: str, calls: list[tuple[str, dict[str, Any]]], ascii_only: bool, indent: int | None, lead: str,
    cuts: list[int],
) -> None:
    raw = [(name, json.dumps(args, ensure_ascii=ascii_only, indent=indent)) for name, args in calls]
    text = render(parser, raw, lead)
    content, got = reply(parser, splits(text, cuts))
    assert got == raw  # the arguments' text exactly as the model wrote it
    assert [json.loads(a) for _, a in got] == [args for _, args in calls]
    assert content == ("" if parser == "llama3_json" else lead)


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]",
             '"name"', '"arguments"', '"parameters"', ":", ",", ";", '"f"', "1", "true", " ", "\n", "x", "é", '"', "\\"]


@settings(max_examples=300, deadline=None)
@given(
    parser=st.sampled_from(sorted(TOOL_PARSERS)),
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
    cuts=st.lists(st.integers(min_value=0), max_size=10),
)
def test_any_text_any_split_same_reply_and_no_text_lost(parser: str, parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    whole = reply(parser, [text])
    assert reply(parser, splits(text, cuts)) == whole
    if not whole[1]:
        assert whole[0] == text


def test_collect_joins_pieces_by_index() -> None:
    deltas = [
        ParsedDelta(content="a", reasoning="r"),
        ParsedDelta(tool_calls=(ToolCallDelta(0, "call_0", "f", '{"x"'), ToolCallDelta(1, "call_1", "g", ""))),
        ParsedDelta(content="b", tool_calls=(ToolCallDelta(0, None, None, ": 1}"), ToolCallDelta(1, None, None, "{}"))),
    ]
    assert collect(deltas) == ("ab", "r", [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "call_1", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ])


QWEN25 = """{%- if tools %}{{- "<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions..." }}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}{%- endif %}"""
MISTRAL = """{%- elif message.tool_calls is defined %}{{- "[TOOL_CALLS][" }}{%- for tool_call in message.tool_calls %}
{{- '{"name": "' + tool_call.function.name + '", "arguments": ' + tool_call.function.arguments|tojson }}"""
LLAMA31 = """{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" -}}{%- if builtin_tools is defined %}
{{- "<|python_tag|>" + tool_call.name + ".call(" }}{%- else %}{{- '{"name": "' + tool_call.name + '", ' }}
{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}{%- endif %}"""
LLAMA32 = """{{- "<|start_header_id|>user<|end_header_id|>\\n\\n" -}}{{- 'Respond in the format {"name": function \
name, "parameters": dictionary of argument name and its value}.' }}"""
PLAIN = """{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + \
'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""


@pytest.mark.parametrize(
    ("template", "parser"),
    [(QWEN25, "hermes"), (MISTRAL, "mistral"), (LLAMA31, "llama3_json"), (LLAMA32, "llama3_json"), (PLAIN, None)],
)
def test_parser_for_template(template: str, parser: str | None) -> None:
    assert tool_parser_for_template(template) == parser
