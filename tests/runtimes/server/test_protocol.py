"""Request models and the error mapping, without a model: what is accepted, refused, and how it reads."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from runtimes.llm.sampling_params import InvalidRequestError
from runtimes.server.errors import APIError, error_response, format_loc, to_api_error
from runtimes.server.protocol import ChatCompletionRequest, CompletionRequest


def _error(exc: Exception) -> tuple[int, dict]:
    response = error_response(exc)
    return response.status_code, json.loads(response.body)["error"]


def test_completion_request_maps_onto_sampling_params():
    body = CompletionRequest.model_validate_json(json.dumps({
        "model": "m", "prompt": ["hi"], "max_tokens": 7, "temperature": 0, "top_p": 0.5, "n": 2, "stop": "x",
        "seed": 3, "logprobs": 2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True,
        "min_tokens": 1, "stop_token_ids": [2], "skip_special_tokens": False, "user": "u", "unknown_field": 1,
    }))
    params = body.to_sampling_params()
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
    params = body.to_sampling_params()
    assert (params.max_tokens, params.logprobs) == (9, 3)
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert plain.to_sampling_params().max_tokens is None  # the rest of the context
    assert plain.to_sampling_params().logprobs is None


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
        request.to_sampling_params()
    status, error = _error(info.value)
    assert (status, error["param"]) == (400, param)


def test_unsupported_chat_fields_are_refused():
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for extra, param in [({"top_logprobs": 2}, "top_logprobs"), ({"tools": [{"type": "function"}]}, "tools"),
                         ({"response_format": {"type": "json_object"}}, "response_format")]:
        with pytest.raises(InvalidRequestError) as info:
            ChatCompletionRequest.model_validate({**base, **extra}).to_sampling_params()
        assert info.value.param == param


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
