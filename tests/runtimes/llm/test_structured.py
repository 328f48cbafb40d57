"""Constrained decoding through the engine (`SamplingParams.structured`), on the tiny random-weight model: whatever
the weights, the output follows the grammar; a structured request's tokens do not depend on its batch; a resumed one
continues exactly; the requests beside it are untouched; a bad constraint is refused naming its field and leaves
nothing behind."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from foundation.request_errors import InvalidRequestError
from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams, StructuredOutput
from tests.runtimes.llm.engine_utils import random_prompt, run_to_completion

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["colour", "ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture
def engine(tiny_loaded) -> LLMEngine:
    return LLMEngine(tiny_loaded(seed=3), EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=8))


def _params(structured: StructuredOutput, **extra: object) -> SamplingParams:
    fields: dict[str, object] = {"temperature": 0.0, "max_tokens": 120, **extra}
    return SamplingParams(structured=structured, **fields)  # type: ignore[arg-type]


def _assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_form_is_followed_whatever_the_weights(engine, temperature):
    requests = {
        "choice": (random_prompt(1, 7), _params(StructuredOutput(choice=("yes", "no", "maybe")),
                                                temperature=temperature, seed=1)),
        "regex": (random_prompt(2, 5), _params(StructuredOutput(regex=r"[a-c]{3}-[0-9]{2}"),
                                               temperature=temperature, seed=2)),
        "schema": (random_prompt(3, 9), _params(StructuredOutput(json_schema=json.dumps(SCHEMA)),
                                                temperature=temperature, seed=3)),
        "object": (random_prompt(4, 4), _params(StructuredOutput(json_object=True), temperature=temperature,
                                                seed=4, max_tokens=400)),
    }
    got = run_to_completion(engine, requests)
    assert got["choice"].text in ("yes", "no", "maybe") and got["choice"].finish_reason == "stop"
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", got["regex"].text) and got["regex"].finish_reason == "stop"
    value = json.loads(got["schema"].text)
    assert value.keys() == {"colour", "ok", "n"} and value["colour"] in ("red", "green")
    assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
    # random weights may run a string on to max_tokens: the object is then closed before it ("length")
    assert isinstance(json.loads(got["object"].text), dict)
    _assert_no_leak(engine)


RUNAWAY = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}},
                                            "done": {"type": "boolean"}}, "required": ["notes", "done"]}


@pytest.mark.parametrize("max_tokens", [40, 64])  # the whole object is ~30 of the tiny model's byte tokens
def test_a_json_output_its_budget_cuts_short_is_still_valid_and_says_length(engine, max_tokens):
    """Random weights write strings until the budget runs out: each output is closed before it, to JSON its schema
    accepts, with finish_reason "length"; the same tokens alone, beside others and resumed mid-close."""
    params = _params(StructuredOutput(json_schema=json.dumps(RUNAWAY)), max_tokens=max_tokens)
    requests = {f"j{i}": (random_prompt(20 + i, 4 + i), params) for i in range(1, 5)}
    alone = {key: run_to_completion(engine, {key: request})[key] for key, request in requests.items()}
    together = run_to_completion(engine, requests)
    closed = 0
    for key, out in alone.items():
        value = json.loads(out.text)
        assert isinstance(value["notes"], list) and all(isinstance(n, str) for n in value["notes"])
        assert isinstance(value["done"], bool) and len(out.token_ids) <= max_tokens
        closed += out.finish_reason == "length"
        assert together[key].token_ids == out.token_ids
    assert closed >= 2, "the random weights were meant to run on: pick other seeds"
    key, out = next((k, o) for k, o in alone.items() if o.finish_reason == "length")
    cut = len(out.token_ids) - 3  # inside the forced close
    engine.add_request("r", requests[key][0], requests[key][1], resume_token_ids=out.token_ids[:cut])
    rest = run_to_completion(engine, {})["r"]
    assert out.token_ids[:cut] + rest.token_ids == out.token_ids and rest.finish_reason == "length"
    _assert_no_leak(engine)


def test_a_structured_request_gives_the_same_tokens_alone_and_in_a_batch(engine):
    structured = ("s", (random_prompt(5, 6), _params(StructuredOutput(json_schema=json.dumps(SCHEMA)))))
    alone = run_to_completion(engine, dict([structured]))
    plain = {f"p{i}": (random_prompt(10 + i, 3 + i), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
             for i in range(4)}
    plain_alone = run_to_completion(engine, plain)
    together = run_to_completion(engine, {**plain, **dict([structured])})
    assert together["s"].token_ids == alone["s"].token_ids
    for key in plain:  # the mask is the structured row's alone
        assert together[key].token_ids == plain_alone[key].token_ids
    _assert_no_leak(engine)


def test_every_sample_follows_the_grammar(engine):
    params = _params(StructuredOutput(regex=r"(ab|cd)+!"), temperature=1.0, seed=9, n=3)
    got = run_to_completion(engine, {"r": (random_prompt(6, 5), params)})
    assert len(got) == 3
    assert all(re.fullmatch(r"(ab|cd)+!", got[f"r#{i}"].text) or got[f"r#{i}"].finish_reason == "length"
               for i in range(3))


def test_a_resumed_structured_request_continues_exactly(engine):
    prompt, params = random_prompt(7, 6), _params(StructuredOutput(json_schema=json.dumps(SCHEMA)))
    whole = run_to_completion(engine, {"w": (prompt, params)})["w"]
    cut = 5
    engine.add_request("r", prompt, params, resume_token_ids=whole.token_ids[:cut])
    rest = run_to_completion(engine, {})["r"]
    assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids
    _assert_no_leak(engine)


def test_resumed_tokens_the_grammar_refuses_are_refused_by_name(engine):
    params = _params(StructuredOutput(choice=("yes", "no")))
    bad = engine.tokenizer.encode("maybe")
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("r", random_prompt(8, 5), params, resume_token_ids=bad)
    assert refused.value.param == "resume.token_ids"
    _assert_no_leak(engine)


def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(engine):
    bad = StructuredOutput(regex="(unclosed", param="structured_outputs.regex")
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request("bad", random_prompt(9, 5), _params(bad))
    assert refused.value.param == "structured_outputs.regex"
    got = run_to_completion(engine, {"ok": (random_prompt(9, 5), _params(StructuredOutput(choice=("a", "b"))))})
    assert got["ok"].text in ("a", "b")
    _assert_no_leak(engine)


def test_the_async_engine_compiles_off_its_thread_and_follows_the_grammar(engine):
    async def main() -> tuple[str, str | None]:
        async_engine = AsyncLLMEngine(engine)
        try:
            text, reason = "", None
            async for out in async_engine.generate("a", random_prompt(11, 5),
                                                   _params(StructuredOutput(choice=("left", "right")))):
                text += out.text
                reason = out.finish_reason
            with pytest.raises(InvalidRequestError):
                async for _ in async_engine.generate("b", random_prompt(11, 5),
                                                     _params(StructuredOutput(json_schema="{not json"))):
                    pass
            return text, reason
        finally:
            async_engine.shutdown()

    text, reason = asyncio.run(main())
    assert text in ("left", "right") and reason == "stop"
