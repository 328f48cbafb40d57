"""JSON outputs closed before their budget runs out (runtimes/llm/grammar/closing.py) and objects closed to their
named properties (runtimes/llm/grammar/schemas.py), on SmolLM2's real tokenizer: an output cut after any number of
random allowed tokens has a closing plan that the schema accepts, within its budget; a matcher near the end of its
budget allows only the plan's next token and, followed, ends as valid JSON; other forms and outputs with room left
are never forced."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from runtimes.llm.grammar import GrammarCompiler, GrammarMatcher, allocate_bitmask
from runtimes.llm.grammar.closing import CLOSE_MARGIN, CLOSE_WINDOW, JsonScan, closing_plan
from runtimes.llm.grammar.schemas import closed_objects
from runtimes.llm.sampling_params import StructuredOutput
from runtimes.llm.tokenizer import Tokenizer
from tests.runtimes.llm.conftest import SMOLLM2_FILE, smollm2_dir

VOCAB = 49152
EOS = 2

# what users send: pydantic's model_json_schema() (no additionalProperties), $refs, formats, patterns, minimums
SCHEMAS = {
    "weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "temp_c": {"type": "number"},
        "conditions": {"type": "string", "enum": ["sunny", "rain", "snow", "cloudy"]}},
        "required": ["city", "temp_c", "conditions"], "additionalProperties": False},
    "pydantic": {"title": "CalendarEvent", "type": "object", "properties": {
        "name": {"title": "Name", "type": "string"}, "date": {"title": "Date", "type": "string"},
        "participants": {"title": "Participants", "type": "array", "items": {"type": "string"}}},
        "required": ["name", "date", "participants"]},
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "email": {"type": "string", "format": "email"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age"]},
    "refs": {"$defs": {"Step": {"type": "object", "properties": {
        "explanation": {"type": "string"}, "output": {"type": "string"}}, "required": ["explanation", "output"]}},
        "type": "object", "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/Step"}},
                                         "final_answer": {"type": "string"}},
        "required": ["steps", "final_answer"]},
    "bounds": {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 5, "pattern": "^[A-Z]+$"},
        "n": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 3},
        "nested": {"type": "object", "properties": {"deep": {"type": "array", "items": {"type": "array", "items": {
            "anyOf": [{"type": "string"}, {"type": "number"}, {"type": "null"}]}}}}, "required": ["deep"]}},
        "required": ["code", "n", "nested"]},
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_dir() / SMOLLM2_FILE)


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, VOCAB, [EOS])


def _allowed(bitmask: torch.Tensor) -> list[int]:
    words = bitmask[0].tolist()
    return [32 * j + i for j, w in enumerate(words) if w for i in range(32) if (w >> i) & 1]


def _random_walk(matcher: GrammarMatcher, rng: random.Random, steps: int) -> list[int]:
    """Up to `steps` tokens, each drawn uniformly from what the grammar allows (EOS aside): outputs no model would
    write, deep in strings, numbers and nesting."""
    bitmask = allocate_bitmask(1, VOCAB)
    out: list[int] = []
    for _ in range(steps):
        if matcher.is_terminated:
            break
        matcher.fill_bitmask(bitmask, 0)
        choices = [t for t in _allowed(bitmask) if t != EOS]
        token = rng.choice(choices)
        assert matcher.accept(token)
        out.append(token)
    return out


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_an_output_cut_anywhere_has_a_closing_plan_its_schema_accepts(name: str, tok: Tokenizer,
                                                                      compiler: GrammarCompiler):
    schema = SCHEMAS[name]
    grammar = compiler.compile(StructuredOutput(json_schema=json.dumps(schema)))
    rng = random.Random(name)
    scratch = torch.empty((VOCAB + 31) // 32, dtype=torch.int32)
    for _ in range(12):
        matcher = grammar.matcher()
        out = _random_walk(matcher, rng, rng.randint(1, 60))
        plan = closing_plan(matcher._matcher, matcher._scan, matcher._closing, CLOSE_WINDOW, frozenset([EOS]),
                            scratch)
        assert plan is not None, f"no way out of {tok.decode(out)!r}"
        assert len(plan) <= CLOSE_WINDOW - CLOSE_MARGIN
        jsonschema.validate(json.loads(tok.decode(out + plan)), schema)
        # the plan ran on a copy: the matcher is where the output left it
        assert not matcher.is_terminated or not plan


@pytest.mark.parametrize("budget", [24, 40, CLOSE_WINDOW])
def test_near_the_end_of_its_budget_a_json_output_follows_its_plan_to_a_valid_end(budget: int, tok: Tokenizer,
                                                                                  compiler: GrammarCompiler):
    """A generation loop that always takes the most "runaway" allowed token (the longest text), given `budget`
    tokens: the output still ends as JSON its schema accepts, within the budget, and says it was closed early."""
    schema = SCHEMAS["pydantic"]
    matcher = compiler.compile(StructuredOutput(json_schema=json.dumps(schema))).matcher()
    bitmask = allocate_bitmask(1, VOCAB)
    out: list[int] = []
    forced = 0
    while not matcher.is_terminated:
        assert len(out) < budget, f"over budget: {tok.decode(out)!r}"
        matcher.fill_bitmask(bitmask, 0, budget - len(out))
        allowed = [t for t in _allowed(bitmask) if t != EOS]
        forced += len(allowed) == 1
        token = max(allowed, key=lambda t: (len(tok.decode([t])), -t))
        assert matcher.accept(token)
        out.append(token)
    jsonschema.validate(json.loads(tok.decode(out)), schema)
    assert matcher.closed_early and forced >= 1


def test_with_room_left_or_without_a_budget_nothing_is_forced(compiler: GrammarCompiler, tok: Tokenizer):
    matcher = compiler.compile(StructuredOutput(json_schema=json.dumps(SCHEMAS["pydantic"]))).matcher()
    for token in tok.encode('{"name": "a long', add_special_tokens=False):
        assert matcher.accept(token)
    bitmask = allocate_bitmask(1, VOCAB)
    for remaining in (None, CLOSE_WINDOW + 1, CLOSE_WINDOW):  # a plan of 15 tokens: 64 left is room enough
        matcher.fill_bitmask(bitmask, 0, remaining)
        assert len(_allowed(bitmask)) > 1000
    assert not matcher.closed_early
    matcher.fill_bitmask(bitmask, 0, 20)  # its plan, 15 tokens, needs more than 20 - CLOSE_MARGIN: follow it
    assert len(_allowed(bitmask)) == 1 and matcher.closed_early


def test_regex_and_grammar_outputs_are_never_forced(compiler: GrammarCompiler):
    for spec in (StructuredOutput(regex="[a-z]+ [0-9]+"), StructuredOutput(grammar='start: "x"+ "!"')):
        matcher = compiler.compile(spec).matcher()
        bitmask = allocate_bitmask(1, VOCAB)
        matcher.fill_bitmask(bitmask, 0, 1)
        assert len(_allowed(bitmask)) > 1 and not matcher.closed_early


def test_a_plan_that_cannot_fit_forces_nothing(compiler: GrammarCompiler, tok: Tokenizer):
    """Three more items are required: with 2 tokens left no plan fits, and the output is left to run out."""
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 5}
    matcher = compiler.compile(StructuredOutput(json_schema=json.dumps(schema))).matcher()
    for token in tok.encode("[1, 2", add_special_tokens=False):
        assert matcher.accept(token)
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0, 2)
    assert len(_allowed(bitmask)) > 1 and not matcher.closed_early


@pytest.mark.parametrize(("text", "inside"), [
    ('{"a": "b', True), ('{"a": "b"', False), (r'{"a": "b\"', True), (r'{"a": "b\\"', False),
    ('["\\\\\\"', True), ('{"é": "ü', True), ("", False)])
def test_json_scan_knows_whether_it_is_inside_a_string(text: str, inside: bool):
    whole, pieces = JsonScan(), JsonScan()
    whole.feed(text.encode())
    for byte in text.encode():  # byte by byte: a token may end after a backslash
        pieces.feed(bytes([byte]))
    assert whole.in_string is inside and pieces.in_string is inside


# ------------------------------------------------------------------------------------------ closed objects


def test_objects_that_name_properties_are_closed_unless_they_say_otherwise():
    schema = {
        "type": "object", "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "b": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
            "c": {"type": "object"},  # names no properties: any object
            "d": {"type": "array", "items": {"properties": {"z": {}}}},
            "e": {"anyOf": [{"properties": {"p": {}}}, {"type": "null"}]},
            "f": {"allOf": [{"properties": {"q": {}}}, {"properties": {"r": {}}}]},
            "g": {"properties": {"s": {}}, "patternProperties": {"^t": {}}},
            "h": {"$ref": "#/$defs/H"}},
        "$defs": {"H": {"properties": {"u": {}}}}}
    closed = json.loads(closed_objects(json.dumps(schema)))
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["additionalProperties"] is True
    assert "additionalProperties" not in props["c"]
    assert props["d"]["items"]["additionalProperties"] is False
    assert props["e"]["anyOf"][0]["additionalProperties"] is False
    assert all("additionalProperties" not in branch for branch in props["f"]["allOf"])  # would refuse each other
    assert "additionalProperties" not in props["g"]
    assert closed["$defs"]["H"]["additionalProperties"] is False
    assert props["a"]["properties"] == {"x": {"type": "integer"}}  # nothing else changes


def test_a_schema_with_nothing_to_close_is_passed_as_written():
    text = '{"type": "object",  "properties": {"x": {}}, "additionalProperties": {"type": "string"}}'
    assert closed_objects(text) is text


def test_a_property_named_like_a_keyword_is_a_property(compiler: GrammarCompiler, tok: Tokenizer):
    """`properties` maps names to schemas: a property called "properties" or "items" is not read as a keyword."""
    schema = {"type": "object", "properties": {"properties": {"type": "string"}, "items": {"type": "integer"}},
              "required": ["properties", "items"]}
    closed = json.loads(closed_objects(json.dumps(schema)))
    assert closed["properties"]["properties"] == {"type": "string"}
    assert closed["properties"]["items"] == {"type": "integer"}
    matcher = compiler.compile(StructuredOutput(json_schema=json.dumps(schema))).matcher()
    for token in tok.encode('{"properties": "x", "items": 3}', add_special_tokens=False):
        assert matcher.accept(token)
    assert matcher.is_terminated


def test_an_unnamed_key_is_refused_where_the_schema_names_its_properties(compiler: GrammarCompiler, tok: Tokenizer):
    matcher = compiler.compile(StructuredOutput(json_schema=json.dumps(SCHEMAS["pydantic"]))).matcher()
    ids = tok.encode('{"name": "a", "date": "b", "participants": [], "extra"', add_special_tokens=False)
    accepted = [matcher.accept(t) for t in ids]
    assert not all(accepted)


def test_properties_come_in_the_schemas_order(compiler: GrammarCompiler, tok: Tokenizer):
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 3},
                                               "answer": {"type": "integer"}}, "required": ["reasoning", "answer"]}
    matcher = compiler.compile(StructuredOutput(json_schema=json.dumps(schema))).matcher()
    bitmask = allocate_bitmask(1, VOCAB)
    out: list[int] = []
    while not matcher.is_terminated:
        matcher.fill_bitmask(bitmask, 0)
        token = min(t for t in _allowed(bitmask) if t != EOS)
        assert matcher.accept(token)
        out.append(token)
    assert list(json.loads(tok.decode(out))) == ["reasoning", "answer"]
