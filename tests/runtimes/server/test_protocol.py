"""Request models and the error mapping, without a model: what is accepted, refused, and how it reads."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from foundation.field_paths import format_loc
from foundation.http.errors import APIError, error_response, to_api_error
from foundation.request_errors import InvalidRequestError
from runtimes.server.protocol import ChatCompletionRequest, CompletionRequest

VOCAB = 100  # the vocabulary size token ids are checked against


def _error(exc: Exception) -> tuple[int, dict]:
    response = error_response(exc)
    return response.status_code, json.loads(response.body)["error"]


def test_completion_request_maps_onto_sampling_params():
    body = CompletionRequest.model_validate_json(json.dumps({
        "model": "m", "prompt": ["hi"], "max_tokens": 7, "temperature": 0, "top_p": 0.5, "n": 2, "stop": "x",
        "seed": 3, "logprobs": 2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True,
        "min_tokens": 1, "stop_token_ids": [2], "skip_special_tokens": False, "user": "u", "metadata": {"k": "v"},
    }))
    params = body.to_sampling_params(VOCAB)
    assert body.prompt == "hi"  # a one-element batch is unwrapped
    assert (params.n, params.max_tokens, params.temperature, params.top_p, params.seed) == (2, 7, 0.0, 0.5, 3)
    assert (params.stop, params.stop_token_ids, params.logprobs, params.top_k) == (("x",), (2,), 2, 5)
    assert params.ignore_eos and not params.skip_special_tokens


def test_prompt_shapes():
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompt == [1, 2]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]
    with pytest.raises(ValidationError, match="one prompt per request; got a batch of 2"):
        CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]})
    with pytest.raises(ValidationError, match="must be a string, a list of token ids"):
        CompletionRequest.model_validate({"model": "m", "prompt": [1, "a"]})


def test_chat_request_defaults_and_logprobs():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 3})
    params = body.to_sampling_params(VOCAB)
    assert (params.max_tokens, params.logprobs) == (9, 3)
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert plain.to_sampling_params(VOCAB).max_tokens is None  # the rest of the context
    assert plain.to_sampling_params(VOCAB).logprobs is None


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"temperature": -1}, "temperature", "temperature: Input should be greater than or equal to 0"),
    ({"top_p": 0}, "top_p", "top_p: Input should be greater than 0"),
    ({"n": 1000}, "n", "n: Input should be less than or equal to 16"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens: Input should be greater than or equal to 1"),
    ({"temperature": "0.5"}, "temperature", "temperature: Input should be a valid number"),
    ({"stream": "yes"}, "stream", "stream: Input should be a valid boolean"),
    ({"logprobs": 21}, "logprobs", "logprobs: Input should be less than or equal to 20"),
    ({"stop": [1]}, "stop", "stop: must be a string or a list of strings"),
    ({"model": ""}, "model", "model: String should have at least 1 character"),
])
def test_validation_errors_name_the_field(body, param, fragment):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": "x", **body}))
    status, error = _error(info.value)
    assert status == 400 and error["param"] == param and fragment in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ([{"content": "a"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
])
def test_bad_messages_name_the_message(messages, param):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    status, error = _error(info.value)
    assert status == 400 and error["param"] == param and error["message"].startswith(param)


@pytest.mark.parametrize(("body", "param"), [
    ({"echo": True}, "echo"),
    ({"best_of": 2}, "best_of"),
    ({"suffix": "s"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_unsupported_completion_fields_are_refused(body, param):
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})
    with pytest.raises(InvalidRequestError) as info:
        request.to_sampling_params(VOCAB)
    status, error = _error(info.value)
    assert (status, error["param"]) == (400, param)


def test_unsupported_chat_fields_are_refused():
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for extra, param in [({"top_logprobs": 2}, "top_logprobs"),
                         ({"tools": [{"type": "function"}]}, "tools[0].function"),
                         ({"response_format": {"type": "xml"}}, "response_format.type")]:
        with pytest.raises(InvalidRequestError) as info:
            ChatCompletionRequest.model_validate({**base, **extra}).to_sampling_params(VOCAB)
        assert info.value.param == param


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"stop_token_ids": [999999999]}, "stop_token_ids", "token id 999999999 is outside the vocabulary [0, 100)"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "token id -1 is outside"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids", "token id 100 is outside"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids", "at most 256 stop_token_ids"),
    ({"logit_bias": {"100": 1}}, "logit_bias", "token id 100 is outside"),
    ({"logit_bias": {"-5": 1}}, "logit_bias", "token id -5 is outside"),
    ({"logit_bias": {"3": 101}}, "logit_bias", "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300 logit_bias entries"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "min_tokens (9) must not exceed max_tokens (8)"),
    ({"prompt": [1, 2, 100]}, "prompt", "token id 100 is outside the vocabulary"),
    ({"stop": ["x" * 1025]}, "stop", "at most 1024 characters"),
])
def test_token_ids_and_cross_field_limits_are_checked_before_the_engine(body, param, fragment):
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})
    with pytest.raises(InvalidRequestError) as info:
        request.to_sampling_params(VOCAB)
    status, error = _error(info.value)
    assert (status, error["param"]) == (400, param) and fragment in error["message"]


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"seed": 2**64}, "seed", "less than or equal to 9223372036854775807"),
    ({"seed": 2**63}, "seed", "less than or equal to"),
    ({"seed": -(2**63) - 1}, "seed", "greater than or equal to -9223372036854775808"),
    ({"top_k": 2**40}, "top_k", "less than or equal to"),
    ({"priority": 10**30}, "priority", "less than or equal to"),
    ({"logit_bias": {"ab": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"1": "x"}}, "logit_bias.1", "valid number"),
    ({"temperature": float("nan")}, "temperature", "less than or equal to 2"),
    ({"user": "u" * 513}, "user", "at most 512 characters"),
])
def test_out_of_range_numbers_are_refused_by_field(body, param, fragment):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})
    status, error = _error(info.value)
    assert status == 400 and error["param"] == param and fragment in error["message"]


def test_extreme_but_valid_values_pass():
    params = CompletionRequest.model_validate({
        "model": "m", "prompt": [0, VOCAB - 1], "seed": 2**63 - 1, "stop_token_ids": [0, VOCAB - 1],
        "logit_bias": {"0": -100, str(VOCAB - 1): 100}, "min_tokens": 4, "max_tokens": 4,
    }).to_sampling_params(VOCAB)
    assert params.seed == 2**63 - 1 and params.logit_bias == ((0, -100.0), (VOCAB - 1, 100.0))
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "seed": -(2**63)}
                                            ).to_sampling_params(VOCAB).seed == -(2**63)


@pytest.mark.parametrize(("extra", "param"), [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"web_search_options": {}}, "web_search_options"),
])
def test_chat_features_we_cannot_honour_are_refused_by_name(extra, param):
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                    **extra})
    with pytest.raises(InvalidRequestError) as info:
        request.to_sampling_params(VOCAB)
    status, error = _error(info.value)
    assert (status, error["param"]) == (400, param)


def test_tool_choice_none_and_text_modality_are_what_we_do_anyway():
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                    "tool_choice": "none", "modalities": ["text"]})
    assert request.to_sampling_params(VOCAB).n == 1


def test_error_mapping():
    assert format_loc(("messages", 0, "content", 1, "text")) == "messages[0].content[1].text"
    status, error = _error(APIError(404, "no such model", param="model", code="model_not_found"))
    assert (status, error) == (404, {"message": "no such model", "type": "invalid_request_error", "param": "model",
                                     "code": "model_not_found"})
    response = error_response(APIError(429, "slow down", retry_after_s=2.4))
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert json.loads(response.body)["error"]["type"] == "rate_limit_error"
    for status in (413, 503, 504):
        assert error_response(APIError(status, "x")).status_code == status
    with pytest.raises(json.JSONDecodeError) as info:
        json.loads("{oops")
    status, error = _error(info.value)
    assert status == 400 and "not valid JSON" in error["message"]
    status, error = _error(InvalidRequestError("prompt too long", param="prompt"))
    assert (status, error["param"], error["message"]) == (400, "prompt", "prompt too long")
    assert to_api_error(KeyError("secret detail")).status == 500
    assert "secret" not in to_api_error(KeyError("secret detail")).message
