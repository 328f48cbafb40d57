"""Tool calling's request surface and reply readers, without an engine: tools and tool_choice checked with a 400 naming
the field inside, the schema that tool_choice "required" or a named function puts on the output, the template's view
of tools and of a history that called them, and the readers that turn a constrained output into OpenAI's deltas."""

from __future__ import annotations

import json
from typing import Any

import pytest

from foundation.request_errors import InvalidRequestError
from runtimes.server.protocol import ChatCompletionRequest
from runtimes.server.tool_calls import (
    DEFAULT_TOOL_PROMPT,
    MAX_TOOLS,
    NamedCallReader,
    RequiredCallsReader,
    merged,
    read_whole,
    reply_message,
    reply_readers,
    required_schema,
    template_inputs,
    tool_request,
)

VOCAB = 100
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get-time"}}]


def _chat(**extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}))


def _refused(**extra: Any) -> tuple[str | None, str]:
    with pytest.raises(InvalidRequestError) as info:
        _chat(**extra).to_sampling_params(VOCAB)
    return info.value.param, str(info.value)


def _tool(name: str, **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [_tool("a"), "b"]}, "tools[1]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools[0].type"),
    ({"tools": [_tool("a"), _tool("b"), _tool("bad name")]}, "tools[2].function.name"),
    ({"tools": [_tool("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [_tool("a"), _tool("a")]}, "tools[1].function.name"),
    ({"tools": [_tool("a", parameters=["not", "an", "object"])]}, "tools[0].function.parameters"),
    ({"tools": [_tool("a", description=3)]}, "tools[0].function.description"),
    ({"tools": [_tool("a", strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [_tool("a", examples=[])]}, "tools[0].function.examples"),
    ({"tools": [_tool(f"t{i}") for i in range(MAX_TOOLS + 1)]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "ghost"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": {"type": "code", "function": {"name": "get_weather"}}}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_bad_tools_are_refused_naming_the_field(extra, param):
    assert _refused(**extra)[0] == param


def test_the_deprecated_function_fields_point_to_tools():
    assert "use tools and tool_choice" in _refused(functions=[{"name": "f"}])[1]


@pytest.mark.parametrize("constraint", [{"response_format": {"type": "json_object"}}, {"guided_choice": ["a"]},
                                        {"structured_outputs": {"regex": "a"}}])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_choice_and_a_structured_output_are_not_both_taken(constraint, choice):
    param, message = _refused(tools=TOOLS, tool_choice=choice, **constraint)
    assert param == "tool_choice" and next(iter(constraint)) in message and "tool_choice" in message


def test_auto_and_none_leave_the_output_free_and_a_structured_output_may_go_with_them():
    assert _chat(tools=TOOLS).to_sampling_params(VOCAB).structured is None
    assert _chat(tools=TOOLS, tool_choice="none").tool_request().mode == "none"
    params = _chat(tools=TOOLS, tool_choice="none", guided_choice=["a"]).to_sampling_params(VOCAB)
    assert params.structured is not None and params.structured.choice == ("a",)


def test_a_named_function_constrains_the_output_to_its_arguments():
    params = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
                   ).to_sampling_params(VOCAB)
    assert params.structured is not None and params.structured.param == "tool_choice"
    assert json.loads(params.structured.json_schema or "") == WEATHER
    # a function without parameters takes an (empty) object
    params = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get-time"}}
                   ).to_sampling_params(VOCAB)
    assert json.loads(params.structured.json_schema or "") == {"type": "object", "properties": {}}


@pytest.mark.parametrize("parallel", [True, False, None])
def test_required_asks_for_an_array_of_calls_of_the_tools(parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    params = _chat(tools=TOOLS, tool_choice="required", **extra).to_sampling_params(VOCAB)
    schema = json.loads(params.structured.json_schema or "")
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema.get("maxItems") == (1 if parallel is False else None)
    calls = schema["items"]["anyOf"]
    assert [c["properties"]["name"] for c in calls] == [{"type": "string", "enum": ["get_weather"]},
                                                       {"type": "string", "enum": ["get-time"]}]
    assert calls[0]["properties"]["arguments"] == WEATHER and calls[0]["required"] == ["name", "arguments"]
    assert all(c["additionalProperties"] is False for c in calls)


def test_one_tool_needs_no_any_of():
    request = tool_request(TOOLS[:1], "required", None)
    assert request is not None
    assert required_schema(request.tools, True)["items"]["properties"]["name"]["enum"] == ["get_weather"]


# ------------------------------------------------------------------------------------------ templates

HISTORY = [
    {"role": "user", "content": "weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def test_a_template_without_tool_syntax_gets_them_in_its_system_message_and_the_history_as_text():
    request = tool_request(TOOLS, None, None)
    messages, tools = template_inputs(HISTORY, request, "{{ messages }}")
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("You may call functions.")
    assert json.dumps(TOOLS[0]) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content":
                           "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"}
    assert len(messages) == 4
    # a system message of the request's own keeps its text first
    own, _ = template_inputs([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], request, "")
    assert own[0]["content"].startswith("Be brief.\n\nYou may call") and len(own) == 2
    # tool_choice "none": no tools offered, the history still as text
    none, _ = template_inputs(HISTORY, tool_request(TOOLS, "none", None), "")
    assert none[0] == HISTORY[0] and len(none) == 3
    assert DEFAULT_TOOL_PROMPT.count("{tools}") == 1


def test_a_template_with_tool_syntax_gets_tools_and_arguments_as_objects_as_transformers_gives_them():
    template = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m }}{% endfor %}"
    messages, tools = template_inputs(HISTORY, tool_request(TOOLS, "auto", None), template)
    assert tools == [TOOLS[0], {"type": "function", "function": {"name": "get-time", "parameters": {
        "type": "object", "properties": {}}}}]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == HISTORY[2] and HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_a_bad_history_is_refused_naming_the_call():
    bad = [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]
    with pytest.raises(InvalidRequestError) as info:
        template_inputs(bad, None, "")
    assert info.value.param == "messages[0].tool_calls[0].function"


# ------------------------------------------------------------------------------------------ readers


def _fed(reader: Any, text: str, step: int) -> list[dict[str, Any]]:
    deltas = []
    for i in range(0, len(text), step):
        deltas += reader.feed(text[i:i + step])
    return deltas + reader.finish()


def test_a_named_call_is_its_arguments_whatever_the_pieces():
    for step in (1, 3, 100):
        deltas = _fed(NamedCallReader("get_weather"), '{"city": "Paris"}', step)
        assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert deltas[0]["tool_calls"][0]["id"].startswith("call_") and len(deltas[0]["tool_calls"][0]["id"]) == 29
        message = reply_message(merged(deltas))
        assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_required_calls_stream_their_names_then_their_arguments(step):
    calls = [{"name": "get_weather", "arguments": {"city": "Pa\"ris}"}}, {"name": "get-time", "arguments": {}},
             {"name": "get_weather", "arguments": {"city": "[Oslo]", "n": [1, {"a": 2}]}}]
    reader = RequiredCallsReader()
    deltas = _fed(reader, json.dumps(calls), step)
    assert reader.called
    firsts = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in firsts] == [
        (0, "get_weather", ""), (1, "get-time", ""), (2, "get_weather", "")]
    message = reply_message(merged(deltas))
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [c["arguments"] for c in calls]
    assert len({c["id"] for c in message["tool_calls"]}) == 3 and message["content"] is None


def test_required_calls_cut_short_before_a_name_are_content():
    reader = RequiredCallsReader()
    assert read_whole(reader, '[{"na') == {"content": '[{"na'} and not reader.called


@pytest.mark.parametrize(("template", "text"), [
    (None, 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'),  # the default prompt's syntax
    ("{% for t in tools %}{{ t }}{% endfor %}[TOOL_CALLS]", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]'),
])
def test_auto_reads_calls_in_the_templates_own_syntax_whole_or_in_pieces(template, text):
    readers = reply_readers(tool_request(TOOLS, "auto", None), template)
    assert readers is not None
    whole = read_whole(readers(), text)
    reader = readers()
    pieces = merged([d for ch in text for d in reader.feed(ch)] + reader.finish())
    for fields in (whole, pieces):
        assert fields["content"].strip() == "Sure."
        [call] = fields["tool_calls"]
        assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"]) == {"x": 1}
    assert whole["tool_calls"][0]["function"] == pieces["tool_calls"][0]["function"]


MISTRAL_TEMPLATE = "{% for t in tools %}{{ t }}{% endfor %}[TOOL_CALLS]"
THINKING_TEMPLATE = "{{ messages }}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"


def test_the_registrys_tool_parser_wins_over_the_templates():
    readers = reply_readers(tool_request(TOOLS, "auto", None), MISTRAL_TEMPLATE, tool_parser="hermes")
    assert readers is not None
    fields = read_whole(readers(), '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert fields["tool_calls"][0]["function"]["name"] == "f"
    mistral = reply_readers(tool_request(TOOLS, "auto", None), MISTRAL_TEMPLATE)
    assert mistral is not None
    assert "tool_calls" not in read_whole(mistral(), '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("tools", [None, "none", "auto"])
def test_a_thinking_templates_replies_carry_reasoning_content(tools):
    """The template opens `<think>` in its generation prompt: the reply starts inside it; what follows `</think>`
    is content, read for calls when tool_choice is "auto" (a call only thought about is not made)."""
    request = None if tools is None else tool_request(TOOLS, tools, None)
    readers = reply_readers(request, THINKING_TEMPLATE)
    assert readers is not None
    text = ('Maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>?</think>\n\nThe answer.'
            '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    whole = read_whole(readers(), text)
    reader = readers()
    pieces = merged([d for ch in text for d in reader.feed(ch)] + reader.finish())
    for fields in (whole, pieces):
        assert fields["reasoning_content"] == 'Maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>?'
        if tools == "auto":
            assert fields["content"].strip() == "The answer."
            [call] = fields["tool_calls"]
            assert json.loads(call["function"]["arguments"]) == {"x": 1}
        else:
            assert fields["content"].startswith("The answer.<tool_call>") and "tool_calls" not in fields


def test_reasoning_none_or_a_plain_template_leaves_the_text_as_content():
    assert reply_readers(None, THINKING_TEMPLATE, reasoning_parser="none") is None
    assert reply_readers(None, "{{ messages }}") is None
    assert reply_readers(tool_request(TOOLS, "none", None), None) is None
    readers = reply_readers(None, "{{ messages }}", reasoning_parser="think")  # asked for: a <think> block at the start
    assert readers is not None
    assert read_whole(readers(), "<think>hm</think>Yes.") == {"reasoning_content": "hm", "content": "Yes."}
    assert read_whole(readers(), "Yes.") == {"content": "Yes."}
