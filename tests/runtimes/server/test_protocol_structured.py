"""Structured outputs on the request surface (OpenAI's response_format, vLLM's structured_outputs and guided_*), and
the rule for fields the server does not know: each accepted shape maps onto its StructuredOutput on both endpoints;
every bad shape, conflict, oversized spec and unknown field is a 400 naming the field (and the limit)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from foundation.http.errors import error_response
from foundation.request_errors import InvalidRequestError
from runtimes.llm.sampling_params import SamplingParams, StructuredOutput
from runtimes.server.protocol import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest
from tests.runtimes.server.conftest import SERVED_NAME

VOCAB = 100
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA)


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "x", **extra}


ENDPOINTS = [pytest.param(ChatCompletionRequest, _chat, id="chat"),
             pytest.param(CompletionRequest, _completion, id="completions")]


def _params(model: type[ChatCompletionRequest | CompletionRequest], body: dict[str, Any]) -> SamplingParams:
    # through JSON, as a replica reads it
    return model.model_validate_json(json.dumps(body)).to_sampling_params(VOCAB)


def _refusal(model: type[ChatCompletionRequest | CompletionRequest], body: dict[str, Any]) -> tuple[str, str]:
    """The 400's param and message."""
    with pytest.raises(InvalidRequestError) as info:
        _params(model, body)
    response = error_response(info.value)
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error"
    return error["param"], error["message"]


# ------------------------------------------------------------------------------------------ accepted shapes


@pytest.mark.parametrize(("model", "body"), ENDPOINTS)
@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True, param="response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}},
     StructuredOutput(json_schema=SCHEMA_TEXT, param="response_format.json_schema.schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "Reply_v-2", "schema": SCHEMA, "strict": True, "description": "what the reply holds"}}},
     StructuredOutput(json_schema=SCHEMA_TEXT, param="response_format.json_schema.schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": False,
                                                                  "description": None}}},
     StructuredOutput(json_schema=SCHEMA_TEXT, param="response_format.json_schema.schema")),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(json_schema=SCHEMA_TEXT,
                                                                param="structured_outputs.json")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}},  # as JSON text: the same canonical form
     StructuredOutput(json_schema=SCHEMA_TEXT, param="structured_outputs.json")),
    ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, StructuredOutput(regex=r"\d{3}-\d{4}",
                                                                         param="structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(choice=("yes", "no"),
                                                                         param="structured_outputs.choice")),
    ({"structured_outputs": {"grammar": 'root ::= "a"+'}}, StructuredOutput(grammar='root ::= "a"+',
                                                                            param="structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True,
                                                                     param="structured_outputs.json_object")),
    # vLLM's whole object with its options at the values that change nothing (a client serialising all of it)
    ({"structured_outputs": {"json": None, "regex": "a+", "choice": None, "grammar": None, "json_object": False,
                             "disable_fallback": True, "disable_any_whitespace": False,
                             "disable_additional_properties": False, "whitespace_pattern": None,
                             "structural_tag": None}},
     StructuredOutput(regex="a+", param="structured_outputs.regex")),
    ({"guided_json": SCHEMA}, StructuredOutput(json_schema=SCHEMA_TEXT, param="guided_json")),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput(json_schema=SCHEMA_TEXT, param="guided_json")),
    ({"guided_regex": "[a-z]+"}, StructuredOutput(regex="[a-z]+", param="guided_regex")),
    ({"guided_choice": ["positive", "negative"]}, StructuredOutput(choice=("positive", "negative"),
                                                                   param="guided_choice")),
    ({"guided_grammar": "start: /[0-9]+/"}, StructuredOutput(grammar="start: /[0-9]+/", param="guided_grammar")),
    # a backend's name (and its no-fallback option) only picks an implementation
    ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, StructuredOutput(choice=("a",),
                                                                                       param="guided_choice")),
    ({"guided_choice": ["a"], "guided_decoding_backend": "outlines:no-fallback"},
     StructuredOutput(choice=("a",), param="guided_choice")),
    # text asks for nothing, so it does not conflict with a constraint given another way
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, StructuredOutput(regex="a", param="guided_regex")),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": None, "structured_outputs": None, "guided_json": None, "guided_whitespace_pattern": None},
     None),
    ({}, None),
])
def test_each_accepted_shape_maps_onto_its_structured_output(model, body, fields, expected):
    assert _params(model, body(**fields)).structured == expected


def test_a_schemas_key_order_is_kept():
    """A JSON reply's properties come in the schema's order (as OpenAI writes them): "reasoning" before "answer"
    lets a model think first. The schema reaches the engine with its keys as given, as an object or as text."""
    ordered = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "string"}},
               "required": ["reasoning", "answer"]}
    texts = [_params(ChatCompletionRequest, _chat(guided_json=schema)).structured.json_schema  # type: ignore[union-attr]
             for schema in (ordered, json.dumps(ordered))]
    assert all(list(json.loads(text)["properties"]) == ["reasoning", "answer"] for text in texts)


def test_structured_passes_through_with_n_seed_logprobs_and_the_other_knobs():
    params = _params(ChatCompletionRequest, _chat(
        guided_choice=["a", "b"], n=3, seed=7, logprobs=True, top_logprobs=2, temperature=0.5, max_tokens=4))
    assert params.structured == StructuredOutput(choice=("a", "b"), param="guided_choice")
    assert (params.n, params.seed, params.logprobs, params.temperature, params.max_tokens) == (3, 7, 2, 0.5, 4)
    params = _params(CompletionRequest, _completion(response_format={"type": "json_object"}, n=2, logprobs=1))
    assert params.structured is not None and params.structured.json_object and (params.n, params.logprobs) == (2, 1)


def test_limits_are_inclusive():
    choices = ["c" * 1024] + [str(i) for i in range(255)]
    assert _params(ChatCompletionRequest, _chat(guided_choice=choices)).structured.choice == tuple(choices)  # type: ignore[union-attr]
    regex = "a" * (64 << 10)
    assert _params(CompletionRequest, _completion(guided_regex=regex)).structured.regex == regex  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------ refused shapes


@pytest.mark.parametrize(("model", "body"), ENDPOINTS)
@pytest.mark.parametrize(("fields", "param", "fragment"), [
    # response_format, as OpenAI shapes it
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {}}, "response_format.type", "required: one of 'text', 'json_object', 'json_schema'"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml' is not supported"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", "not supported"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema",
     "not a field of response_format with type 'json_object'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema",
     "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": SCHEMA}}},
     "response_format.json_schema.name", "must match ^[a-zA-Z0-9_-]{1,64}$"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n" * 65, "schema": SCHEMA}}},
     "response_format.json_schema.name", "must match"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}}},
     "response_format.json_schema.name", "must match"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": "{}"}}},
     "response_format.json_schema.schema", "must be a JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": [SCHEMA]}}},
     "response_format.json_schema.schema", "must be a JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "must be a boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "format": "x"}}},
     "response_format.json_schema.format", "not a field of response_format.json_schema"),
    # vLLM's structured_outputs
    ({"structured_outputs": ["a"]}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {}}, "structured_outputs", "give exactly one of 'json', 'regex', 'choice', 'grammar', "
                                                       "'json_object'; got none"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got 'regex', 'choice'"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "must be a boolean"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "must be a JSON schema object"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "JSON schema as JSON text"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json", "must be a JSON schema object"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "must be a regular expression"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar", "non-empty string"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list of strings"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice", "non-empty list of strings"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice[1]", "non-empty string"),
    ({"structured_outputs": {"choice": ["a", 2]}}, "structured_outputs.choice[1]", "non-empty string"),
    ({"structured_outputs": {"regex": "a", "schema": SCHEMA}}, "structured_outputs.schema",
     "not a field of structured_outputs"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "changes the output"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}}, "structured_outputs.whitespace_pattern",
     "changes the output"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "changes the output"),
    # the older top-level names
    ({"guided_json": 5}, "guided_json", "must be a JSON schema object"),
    ({"guided_json": "[" * 20_000 + "]" * 20_000}, "guided_json", "nests too deeply"),
    ({"guided_json": {"type": "number", "minimum": float("inf")}}, "guided_json", "no NaN or Infinity"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_regex": ["a"]}, "guided_regex", "must be a regular expression"),
    ({"guided_grammar": {"root": "x"}}, "guided_grammar", "must be a grammar"),
    ({"guided_choice": "yes"}, "guided_choice", "non-empty list of strings"),
    ({"guided_choice": ["yes", None]}, "guided_choice[1]", "non-empty string"),
    ({"guided_decoding_backend": "xgrammar:disable-any-whitespace"}, "guided_decoding_backend",
     "'disable-any-whitespace'"),
    ({"guided_decoding_backend": "guidance:no-fallback,no-additional-properties"}, "guided_decoding_backend",
     "not supported: 'no-additional-properties'"),
    ({"guided_decoding_backend": 1}, "guided_decoding_backend", "must be a string"),
    ({"guided_whitespace_pattern": r"[\n ]?"}, "guided_whitespace_pattern", "not supported"),
])
def test_each_bad_shape_is_a_400_naming_the_field(model, body, fields, param, fragment):
    got_param, message = _refusal(model, body(**fields))
    assert got_param == param and fragment in message, message
    assert message.startswith(param)


@pytest.mark.parametrize(("model", "body"), ENDPOINTS)
@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"guided_regex": "a" * ((64 << 10) + 1)}, "guided_regex", "the regex is 65,537 bytes; at most 65,536 (64 KiB)"),
    ({"guided_regex": "é" * (32 << 10) + "a"}, "guided_regex", "65,537 bytes"),  # bytes, not characters
    ({"structured_outputs": {"grammar": "g" * (65 << 10)}}, "structured_outputs.grammar",
     "the grammar is 66,560 bytes; at most 65,536 (64 KiB)"),
    ({"guided_json": {"type": "string", "enum": ["x" * (64 << 10)]}}, "guided_json",
     "the schema is 65,568 bytes; at most 65,536 (64 KiB)"),
    ({"guided_json": " " * (64 << 10) + "{}"}, "guided_json", "the schema is 65,538 bytes"),  # as sent
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"enum": ["x" * 70_000]}}}},
     "response_format.json_schema.schema", "at most 65,536 (64 KiB)"),
    ({"guided_choice": [str(i) for i in range(257)]}, "guided_choice", "at most 256 choices, got 257"),
    ({"structured_outputs": {"choice": ["a", "b" * 1025]}}, "structured_outputs.choice[1]",
     "a choice may have at most 1024 characters, got 1025"),
])
def test_oversized_specs_are_refused_saying_the_limit(model, body, fields, param, fragment):
    got_param, message = _refusal(model, body(**fields))
    assert got_param == param and fragment in message, message


@pytest.mark.parametrize(("fields", "names"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}, "guided_regex": "a"},
     ("response_format", "guided_regex")),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     ("response_format", "structured_outputs")),
    ({"structured_outputs": {"choice": ["a"]}, "guided_choice": ["a"]}, ("structured_outputs", "guided_choice")),
    ({"guided_json": SCHEMA, "guided_grammar": "root ::= x"}, ("guided_json", "guided_grammar")),
    ({"guided_regex": "a", "guided_choice": ["a"], "guided_grammar": "g"},
     ("guided_regex", "guided_choice", "guided_grammar")),
])
@pytest.mark.parametrize(("model", "body"), ENDPOINTS)
def test_two_ways_at_once_are_refused_naming_each(model, body, fields, names):
    param, message = _refusal(model, body(**fields))
    assert param == names[1] and all(name in message for name in names), message
    assert "each constrain the output; give one of them" in message


# ------------------------------------------------------------------------------------------ unknown fields


@pytest.mark.parametrize(("model", "body"), ENDPOINTS)
@pytest.mark.parametrize("field", [
    "guided_choices",  # a typo would otherwise give free text with no error
    "json_schema", "structural_tag", "reasoning_effort", "verbosity", "chat_template", "chat_template_kwargs",
    "continue_final_message", "add_special_tokens", "include_stop_str_in_output", "prompt_logprobs",
    "allowed_token_ids", "bad_words", "use_beam_search", "truncate_prompt_tokens", "request_id", "cache_salt",
    "extra_body",  # sent literally, its contents were meant as fields
])
def test_unknown_fields_are_refused_by_name(model, body, field):
    param, message = _refusal(model, body(**{field: "x"}))
    assert param == field and f"unrecognized request argument supplied: {field}" in message


def test_endpoint_specific_fields_are_unknown_on_the_other_endpoint():
    assert _refusal(ChatCompletionRequest, _chat(echo=True))[0] == "echo"
    assert _refusal(ChatCompletionRequest, _chat(suffix="s"))[0] == "suffix"
    assert _refusal(CompletionRequest, _completion(top_logprobs=2))[0] == "top_logprobs"
    assert _refusal(CompletionRequest, _completion(max_completion_tokens=2))[0] == "max_completion_tokens"
    assert _refusal(CompletionRequest, _completion(tools=[{"type": "function"}]))[0] == "tools"


def test_several_unknown_fields_are_all_named_and_a_long_list_is_cut_short():
    param, message = _refusal(ChatCompletionRequest, _chat(foo=1, metadata={"k": "v"}, bar=[2]))
    assert param == "foo" and "unrecognized request arguments supplied: foo, bar (" in message
    param, message = _refusal(CompletionRequest, _completion(**{f"f{i}": i for i in range(20)}))
    assert param == "f0" and "f7 and 12 more" in message and "f8" not in message
    param, message = _refusal(CompletionRequest, _completion(**{"x" * 5000: 1}))
    assert param == "x" * 64 and len(message) < 300


@pytest.mark.parametrize(("model", "body"), ENDPOINTS)
def test_harmless_known_fields_and_nulls_are_accepted(model, body):
    harmless = {"metadata": {"team": "search"}, "store": False, "service_tier": "auto", "safety_identifier": "h-1",
                "prompt_cache_key": "conv-9", "user": "u-1"}
    nulls = {"reasoning_effort": None, "verbosity": None, "chat_template_kwargs": None}  # null asks for nothing
    params = _params(model, body(**harmless, **nulls))
    assert params.structured is None and params == _params(model, body())
    assert set(harmless) - {"user"} == set(IGNORED_FIELDS)


def test_tool_fields_are_refused_with_their_own_messages():
    assert _refusal(ChatCompletionRequest, _chat(tools=[{"type": "function"}], guided_choice=["a"])) == (
        "tools[0].function", "tools[0].function: must be an object with a name")
    param, message = _refusal(ChatCompletionRequest, _chat(tool_choice="required",
                                                           response_format={"type": "json_object"}))
    assert param == "tool_choice" and "only allowed when tools are given" in message


# ------------------------------------------------------------------------------------------ through the app


class _Captured(Exception):
    pass


@pytest.fixture
def captured(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """The SamplingParams of each request the app would generate for, which it is then refused (400) instead: the
    protocol mapping alone, whatever the engine does with a constraint."""
    seen: list[SamplingParams] = []

    def generation(engine: object, request_id: str, prompt: object, params: SamplingParams, *args: object) -> None:
        seen.append(params)
        raise InvalidRequestError("captured by the test", param="captured")

    monkeypatch.setattr("runtimes.server.app.Generation", generation)
    return seen


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "yes or no?"}], "guided_choice": ["yes", "no"]},
     StructuredOutput(choice=("yes", "no"), param="guided_choice")),
    ("/v1/completions", {"prompt": "yes or no?", "structured_outputs": {"regex": "(yes|no)"}},
     StructuredOutput(regex="(yes|no)", param="structured_outputs.regex")),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a json"}], "stream": True, "response_format":
                              {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
     StructuredOutput(json_schema=SCHEMA_TEXT, param="response_format.json_schema.schema")),
])
def test_a_constraint_reaches_the_request_the_app_submits(client, captured, path, body, expected):
    response = client.post(path, json={"model": SERVED_NAME, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == "captured", response.text
    assert [params.structured for params in captured] == [expected]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_choices": ["a"]},
     "guided_choices"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a" * 1025]}, "guided_choice[0]"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}},
     "guided_regex"),
])
def test_the_app_refuses_what_it_would_otherwise_drop(client, captured, path, body, param):
    response = client.post(path, json={"model": SERVED_NAME, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert captured == []
