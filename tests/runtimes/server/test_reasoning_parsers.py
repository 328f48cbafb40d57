"""The `think` reasoning parser, whole and split at every character boundary, the template check that picks it, and
its chain with a tool parser: a call the model only thinks about stays reasoning."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtimes.server.reasoning_parsers import (
    REASONING_PARSERS,
    ParsedDelta,
    ReasoningParser,
    ThinkReasoningParser,
    chain,
    reasoning_parser_for_template,
)
from runtimes.server.tool_parsers import TOOL_PARSERS, ToolParser, collect


def reply(make: ReasoningParser | ToolParser, pieces: list[str]) -> tuple[str, str, list[dict]]:
    return collect([make.feed(piece) for piece in pieces] + [make.finish()])


def check_splits(text: str, starts_inside: bool) -> tuple[str, str]:
    """(reasoning, content) of `text` whole, after checking every split in two and one character at a time."""
    whole = reply(ThinkReasoningParser(starts_inside), [text])
    for k in range(len(text) + 1):
        assert reply(ThinkReasoningParser(starts_inside), [text[:k], text[k:]]) == whole, k
    assert reply(ThinkReasoningParser(starts_inside), list(text)) == whole
    content, reasoning, calls = whole
    assert calls == []
    return reasoning, content


@pytest.mark.parametrize(
    ("text", "starts_inside", "reasoning", "content"),
    [
        ("<think>\nThe user wants π.\n</think>\n\nIt is 3.14 🙂", False, "\nThe user wants π.\n", "It is 3.14 🙂"),
        ("\n<think>a</think>b", False, "a", "b"),
        ("Just an answer.", False, "", "Just an answer."),
        ("Answer with <think>tags</think> inside", False, "", "Answer with <think>tags</think> inside"),
        ("<thinking>", False, "", "<thinking>"),
        ("<think>cut off mid thought </thi", False, "cut off mid thought </thi", ""),
        ("<think>a</think>", False, "a", ""),
        ("Okay, so 2+2.\n</think>\n\n4", True, "Okay, so 2+2.\n", "4"),
        ("<think>\nOkay.</think>4", True, "\nOkay.", "4"),
        ("Thinking that never ends", True, "Thinking that never ends", ""),
        ("", True, "", ""),
        ("a</think>b</think>c", True, "a", "b</think>c"),
    ],
)
def test_think_whole_and_split_everywhere(text: str, starts_inside: bool, reasoning: str, content: str) -> None:
    assert check_splits(text, starts_inside) == (reasoning, content)


def test_reasoning_streams_and_only_a_possible_tag_is_held_back() -> None:
    p = REASONING_PARSERS["think"]()
    assert p.feed("<thi") == ParsedDelta()
    assert p.feed("nk>Hmm </") == ParsedDelta(reasoning="Hmm ")
    assert p.feed("b> ok</think>") == ParsedDelta(reasoning="</b> ok")
    assert p.feed("\n\n") == ParsedDelta()
    assert p.feed("Yes") == ParsedDelta(content="Yes")
    p = REASONING_PARSERS["think"](starts_inside=True)
    assert p.feed("Hmm") == ParsedDelta(reasoning="Hmm")


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(["<think>", "</think>", "<th", "</", ">", "a", "é", " ", "\n"]), max_size=20),
    starts_inside=st.booleans(),
    cuts=st.lists(st.integers(min_value=0), max_size=8),
)
def test_any_text_any_split_same_result_nothing_lost_but_tags(parts: list[str], starts_inside: bool,
                                                              cuts: list[int]) -> None:
    text = "".join(parts)
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    whole = reply(ThinkReasoningParser(starts_inside), [text])
    assert reply(ThinkReasoningParser(starts_inside), pieces) == whole
    content, reasoning, _ = whole
    assert len(content) + len(reasoning) <= len(text)
    if "<think>" not in text and "</think>" not in text:
        assert (reasoning, content) == ((text, "") if starts_inside else ("", text))


DEEPSEEK_R1 = """{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"""
QWEN3 = """{%- if message.role == "assistant" %}{%- set content = message.content.split('</think>')[-1] %}
{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
{%- endif %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and \
enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"""
QWQ = """{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"""
PLAIN = """{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""


@pytest.mark.parametrize(
    ("template", "expected"),
    [(DEEPSEEK_R1, ("think", True)), (QWEN3, ("think", False)), (QWQ, ("think", True)), (PLAIN, None)],
)
def test_parser_for_template(template: str, expected: tuple[str, bool] | None) -> None:
    assert reasoning_parser_for_template(template) == expected


THOUGHT_AND_CALL = (
    '<think>\nI could use <tool_call>{"name": "nope", "arguments": {}}</tool_call>, but better:\n</think>\n\n'
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def test_chain_reasoning_then_tool_calls_split_everywhere() -> None:
    def make() -> ToolParser:
        return chain(ThinkReasoningParser(), TOOL_PARSERS["hermes"]())

    whole = reply(make(), [THOUGHT_AND_CALL])
    content, reasoning, calls = whole
    assert reasoning == '\nI could use <tool_call>{"name": "nope", "arguments": {}}</tool_call>, but better:\n'
    assert content == "Checking.\n"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    for k in range(len(THOUGHT_AND_CALL) + 1):
        parts = reply(make(), [THOUGHT_AND_CALL[:k], THOUGHT_AND_CALL[k:]])
        assert (parts[0], parts[1], [c["function"] for c in parts[2]]) == (content, reasoning,
                                                                          [c["function"] for c in calls]), k
    parser = make()
    reply(parser, list(THOUGHT_AND_CALL))
    assert parser.called


def test_chain_finish_joins_a_calls_last_pieces() -> None:
    parser = chain(ThinkReasoningParser(starts_inside=True), TOOL_PARSERS["llama3_json"]())
    first = parser.feed('ok</think>{"name": "f", "parameters": {"a": 1')
    assert (first.reasoning, first.content) == ("ok", "")
    assert [d.arguments for d in first.tool_calls] == ['{"a": 1']
    assert parser.feed("2}").tool_calls[0].arguments == "2}"
    assert parser.finish() == ParsedDelta()
    assert parser.called


@pytest.mark.parametrize("with_reasoning", [False, True])
@pytest.mark.parametrize("with_tools", [False, True])
def test_chain_with_either_absent(with_reasoning: bool, with_tools: bool) -> None:
    parser = chain(ThinkReasoningParser() if with_reasoning else None, TOOL_PARSERS["hermes"]() if with_tools else None)
    content, reasoning, calls = reply(parser, ["<think>a</think>b <tool_call>", '{"name": "f"}</tool_call>'])
    assert reasoning == ("a" if with_reasoning else "")
    assert content == ("b " if with_reasoning else "<think>a</think>b ") + ("" if with_tools else
                                                                             '<tool_call>{"name": "f"}</tool_call>')
    assert [c["function"]["name"] for c in calls] == (["f"] if with_tools else [])
    assert parser.called == with_tools
