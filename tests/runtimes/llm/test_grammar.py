"""The constrained-decoding backend (runtimes/llm/grammar/) on SmolLM2's real tokenizer: every form compiles, and a
matcher walking a valid output's tokens accepts each one, finds it in its mask at every step, allows EOS exactly
where the output may end and is terminated after it; a refused token changes nothing; JSON built by always taking
the smallest allowed token parses and validates; bad, oversized or slow specs are InvalidRequestErrors naming their
field; the cache hands back the same grammar; `apply_bitmask` matches a plain loop."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema
import pytest
import torch

from foundation.request_errors import InvalidRequestError
from runtimes.llm.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
    backend,
)
from runtimes.llm.grammar import bitmask as bitmask_module
from runtimes.llm.sampling_params import StructuredOutput
from runtimes.llm.tokenizer import Tokenizer
from tests.runtimes.llm.conftest import SMOLLM2_FILE, smollm2_dir

VOCAB = 49152
EOS = 2  # <|im_end|>, SmolLM2-Instruct's end of turn (its GGUF's one EOS id)
ENDOFTEXT = 0  # <|endoftext|>: given as a second EOS id, to see that every one is allowed where the output may end


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_dir() / SMOLLM2_FILE)


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    assert tok.eos_token_ids == (EOS,)
    return GrammarCompiler(tok, VOCAB, [EOS, ENDOFTEXT])


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    words = bitmask[row].tolist()
    return {32 * j + i for j, w in enumerate(words) if w for i in range(32) if (w >> i) & 1}


def is_allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def _json_complete(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Form:
    spec: StructuredOutput
    output: str  # a valid output
    complete: Callable[[str], bool]  # whether a prefix of `output` is a whole valid output (EOS allowed there)
    invalid_starts: tuple[str, ...]  # outputs whose first token the grammar never allows first


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
LARK = 'start: pair ("," pair)*\npair: WORD "=" NUMBER\nWORD: /[a-z]+/\nNUMBER: /[0-9]+/\n'
GBNF = 'root ::= pair ("," pair)*\npair ::= [a-z]+ "=" [0-9]+\n'
PAIRS = re.compile(r"[a-z]+=[0-9]+(,[a-z]+=[0-9]+)*")

FORMS = {
    "json_schema": Form(StructuredOutput(json_schema=json.dumps(PERSON), param="response_format.json_schema"),
                        json.dumps({"name": "Ada", "age": 36, "tags": ["b", "a"]}), _json_complete,
                        ("hello", "[1]", " {", "42")),
    "json_object": Form(StructuredOutput(json_object=True, param="response_format"),
                        json.dumps({"x": [1, 2.5, None], "y": {"z": "w"}}), _json_complete, ("hello", "[1]", "42")),
    "regex": Form(StructuredOutput(regex=r"[a-z]+@[a-z]+\.(com|org)", param="structured_outputs.regex"),
                  "bob@example.org", lambda s: re.fullmatch(r"[a-z]+@[a-z]+\.(com|org)", s) is not None,
                  ("Bob", "42", "@")),
    "choice": Form(StructuredOutput(choice=("yes", "no", "not sure"), param="structured_outputs.choice"),
                   "not sure", lambda s: s in ("yes", "no", "not sure"), ("maybe", "Yes", " no")),
    "lark": Form(StructuredOutput(grammar=LARK, param="structured_outputs.grammar"), "x=1,yy=22,zzz=333",
                 lambda s: PAIRS.fullmatch(s) is not None, ("1", "=", "X", ",")),
    "gbnf": Form(StructuredOutput(grammar=GBNF, param="structured_outputs.grammar"), "x=1,yy=22,zzz=333",
                 lambda s: PAIRS.fullmatch(s) is not None, ("1", "=", "X", ",")),
}


@pytest.mark.parametrize("name", list(FORMS))
def test_a_valid_output_walks_to_termination(name: str, tok: Tokenizer, compiler: GrammarCompiler):
    form = FORMS[name]
    grammar = compiler.compile(form.spec)
    assert isinstance(grammar, CompiledGrammar)
    matcher = grammar.matcher()
    assert isinstance(matcher, GrammarMatcher)
    tokens = tok.encode(form.output, add_special_tokens=False)
    bitmask = allocate_bitmask(3, VOCAB)
    for step, token in enumerate([*tokens, EOS]):
        matcher.fill_bitmask(bitmask, 1)
        mask = allowed(bitmask, 1)
        assert token in mask, f"step {step}: token {token} ({tok.decode([token])!r}) not in the mask"
        assert not any(t >= VOCAB for t in mask)
        prefix = tok.decode(tokens[:step])
        # EOS exactly where the output may end (both EOS ids of the model)
        assert (EOS in mask) == form.complete(prefix), f"step {step}: EOS {'not ' * (EOS not in mask)}allowed"
        assert (ENDOFTEXT in mask) == (EOS in mask)
        assert matcher.is_terminated == (mask == {EOS, ENDOFTEXT})  # complete, and nothing can extend it
        if step == 0:
            for text in form.invalid_starts:
                assert tok.encode(text, add_special_tokens=False)[0] not in mask, text
        assert matcher.accept(token)
    assert matcher.is_terminated
    assert not matcher.accept(EOS) and not matcher.accept(tokens[0])  # nothing follows


def test_a_refused_token_changes_nothing(tok: Tokenizer, compiler: GrammarCompiler):
    form = FORMS["json_schema"]
    tokens = tok.encode(form.output, add_special_tokens=False)
    matcher = compiler.compile(form.spec).matcher()
    bitmask = allocate_bitmask(1, VOCAB)
    for token in tokens[:3]:
        assert matcher.accept(token)
    matcher.fill_bitmask(bitmask, 0)
    before = bitmask.clone()
    refused = [t for t in (EOS, tok.encode("}", add_special_tokens=False)[0], *tok.encode(" hello world", False),
                           VOCAB, VOCAB + 5, -1) if t >= VOCAB or t < 0 or not is_allowed(before, 0, t)]
    assert len(refused) >= 4
    for token in refused:
        assert not matcher.accept(token)
    matcher.fill_bitmask(bitmask, 0)
    assert torch.equal(bitmask, before)
    for token in [*tokens[3:], EOS]:
        assert matcher.accept(token)
    assert matcher.is_terminated


def test_masks_along_a_proposal_are_the_masks_of_advancing_and_leave_the_matcher_where_it_was(
        tok: Tokenizer, compiler: GrammarCompiler):
    """Speculative decoding's verified positions under a grammar (`masks_along`): the mask after each prefix of the
    proposal is what a matcher advanced that far fills; the proposal's masks stop at the first token the grammar
    refuses (and before an EOS); the matcher is left as it was."""
    form = FORMS["json_schema"]
    tokens = tok.encode(form.output, add_special_tokens=False)
    matcher = compiler.compile(form.spec).matcher()
    for token in tokens[:2]:
        assert matcher.accept(token)
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    before = bitmask.clone()
    proposal = tokens[2:9]
    masks = matcher.masks_along(proposal)
    assert len(masks) == len(proposal) + 1
    walker = compiler.compile(form.spec).matcher()  # advanced for real, token by token
    for token in tokens[:2]:
        walker.accept(token)
    for j, mask in enumerate(masks):
        walker.fill_bitmask(bitmask, 0)
        assert torch.equal(mask.words, bitmask[0])
        if j < len(proposal):
            assert walker.accept(proposal[j])
    matcher.fill_bitmask(bitmask, 0)
    assert torch.equal(bitmask, before)  # rolled back
    refused = next(t for t in range(3, VOCAB) if not is_allowed(masks[3].words[None], 0, t))
    cut = matcher.masks_along([*proposal[:3], refused, *proposal[4:]])
    assert len(cut) == 4 and all(torch.equal(a.words, b.words) for a, b in zip(cut, masks[:4], strict=False))
    assert len(matcher.masks_along([EOS, *proposal])) == 1  # an EOS ends the proposal (nothing is verified after it)
    # a token that completes the grammar is not proposed: plain decoding ends the output there, sampling nothing after
    assert len(matcher.masks_along(tokens[2:])) == len(tokens[2:])
    choice = compiler.compile(StructuredOutput(choice=("positive", "negative"))).matcher()
    label = tok.encode("positive", add_special_tokens=False)
    assert len(choice.masks_along(label)) == len(label)
    for token in [*tokens[2:], EOS]:  # and the matcher still takes the whole output
        assert matcher.accept(token)
    assert matcher.is_terminated and matcher.masks_along(proposal) == []


def test_a_complete_output_allows_only_eos(tok: Tokenizer, compiler: GrammarCompiler):
    matcher = compiler.compile(FORMS["choice"].spec).matcher()
    for token in tok.encode("yes", add_special_tokens=False):
        assert matcher.accept(token)
    assert matcher.is_terminated  # nothing can extend it: the engine may stop here
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0) == {EOS, ENDOFTEXT}
    assert matcher.accept(EOS) and matcher.is_terminated


WALK_SCHEMAS = {
    "flat": {"type": "object",
             "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                            "n": {"type": "integer", "minimum": 3, "maximum": 99},
                            "x": {"type": "number", "minimum": 0.5}, "label": {"type": "string", "maxLength": 6},
                            "none": {"type": "null"}, "kind": {"const": "fixed"}},
             "required": ["colour", "ok", "n", "x", "label", "none", "kind"], "additionalProperties": False},
    "nested": {
        "$defs": {"item": {"type": "object",
                           "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                          "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "note": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]}},
                           "required": ["sku", "qty", "note"], "additionalProperties": False}},
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 2, "maxItems": 3},
                       "owner": {"type": "object",
                                 "properties": {"id": {"type": "integer", "minimum": 10, "maximum": 500}},
                                 "required": ["id"], "additionalProperties": False},
                       "codes": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
                       "extra": {"type": "boolean"}},
        "required": ["items", "owner", "codes"], "additionalProperties": False},
}


def _check_by_hand(name: str, value: dict) -> None:
    if name == "flat":
        assert value["colour"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
        assert isinstance(value["n"], int) and 3 <= value["n"] <= 99 and value["x"] >= 0.5
        assert isinstance(value["label"], str) and len(value["label"]) <= 6
        assert value["none"] is None and value["kind"] == "fixed"
    else:
        assert 2 <= len(value["items"]) <= 3
        for item in value["items"]:
            assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", item["sku"]) and 1 <= item["qty"] <= 9
            assert item["note"] is None or len(item["note"]) <= 4
        assert 10 <= value["owner"]["id"] <= 500 and len(value["codes"]) <= 2
        assert set(value) <= {"items", "owner", "codes", "extra"}


@pytest.mark.parametrize("name", list(WALK_SCHEMAS))
def test_smallest_token_walk_gives_valid_json(name: str, tok: Tokenizer, compiler: GrammarCompiler):
    schema = WALK_SCHEMAS[name]
    matcher = compiler.compile(StructuredOutput(json_schema=json.dumps(schema))).matcher()
    bitmask = allocate_bitmask(1, VOCAB)
    out: list[int] = []
    for _ in range(1000):
        matcher.fill_bitmask(bitmask, 0)
        token = min(allowed(bitmask, 0))
        assert matcher.accept(token)
        if token in (EOS, ENDOFTEXT):
            break
        out.append(token)
    else:
        pytest.fail(f"no EOS after 1000 tokens: {tok.decode(out)!r}")
    assert matcher.is_terminated
    value = json.loads(tok.decode(out))
    jsonschema.validate(value, schema)
    _check_by_hand(name, value)


BAD = [
    (StructuredOutput(json_schema="{not json", param="response_format.json_schema"), "not valid JSON"),
    (StructuredOutput(json_schema="[1, 2]", param="response_format.json_schema"), "must be a JSON object"),
    (StructuredOutput(json_schema='{"type": "foo"}', param="response_format.json_schema"), "foo"),
    (StructuredOutput(json_schema='{"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}',
                      param="response_format.json_schema"), "nope"),
    (StructuredOutput(json_schema='{"type": "object", "dependentRequired": {"a": ["b"]}}',
                      param="response_format.json_schema"), "dependentRequired"),
    (StructuredOutput(regex="(ab", param="structured_outputs.regex"), "unclosed group"),
    (StructuredOutput(grammar='start: "a" | missing', param="structured_outputs.grammar"), "missing"),
    (StructuredOutput(grammar="root ::= [a-", param="structured_outputs.grammar"), "grammar"),
]


@pytest.mark.parametrize(("spec", "problem"), BAD)
def test_a_spec_it_cannot_compile_is_refused_naming_its_field(spec: StructuredOutput, problem: str,
                                                              compiler: GrammarCompiler):
    for _ in range(2):  # the second refusal comes from the cache, the same
        with pytest.raises(InvalidRequestError) as err:
            compiler.compile(spec)
        assert err.value.param == spec.param
        assert str(err.value).startswith(f"{spec.param}: ") and problem in str(err.value)


def test_a_cached_refusal_names_the_new_field(compiler: GrammarCompiler):
    with pytest.raises(InvalidRequestError):
        compiler.compile(StructuredOutput(regex="[z-a]", param="a"))
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(StructuredOutput(regex="[z-a]", param="b"))
    assert err.value.param == "b" and str(err.value).startswith("b: ")


def test_over_the_size_limit(tok: Tokenizer):
    small = GrammarCompiler(tok, VOCAB, tok.eos_token_ids, max_spec_chars=100)
    schema = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10)}})
    for spec in (StructuredOutput(json_schema=schema, param="response_format.json_schema"),
                 StructuredOutput(regex="a" * 101, param="regex"),
                 StructuredOutput(choice=tuple("x" * 30 for _ in range(4)), param="choice"),
                 StructuredOutput(grammar='start: "' + "a" * 100 + '"', param="grammar")):
        with pytest.raises(InvalidRequestError) as err:
            small.compile(spec)
        assert err.value.param == spec.param and "100" in str(err.value) and "limit" in str(err.value)
    small.compile(StructuredOutput(regex="a" * 100))  # at the limit: fine


def test_no_form_is_refused(compiler: GrammarCompiler):
    with pytest.raises(InvalidRequestError) as err:  # the request side refuses it first
        StructuredOutput(param="response_format")
    assert err.value.param == "response_format"
    spec = StructuredOutput(regex="a", param="response_format")
    object.__setattr__(spec, "regex", None)  # past that check: the compiler refuses it too
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(spec)
    assert err.value.param == "response_format"


def test_a_compile_over_the_timeout_is_refused_and_not_cached(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch):
    compiler = GrammarCompiler(tok, VOCAB, tok.eos_token_ids, timeout_s=0.2)
    build = compiler._build
    release = threading.Event()

    def slow_build(key: backend._SpecKey) -> CompiledGrammar | str:
        release.wait(5)
        return build(key)

    monkeypatch.setattr(compiler, "_build", slow_build)
    spec = StructuredOutput(regex="[0-9]+", param="structured_outputs.regex")
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(spec)
    assert time.monotonic() - start < 2
    assert err.value.param == spec.param and "0.2 s" in str(err.value)
    release.set()  # the compile finishes after all, and serves the next request
    deadline = time.monotonic() + 5
    while compiler._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(compiler.compile(spec), CompiledGrammar)
    compiler.close()


def test_the_cache_returns_the_same_grammar(tok: Tokenizer):
    compiler = GrammarCompiler(tok, VOCAB, tok.eos_token_ids, cache_size=2)
    a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutput(regex="a+", param="other")) is first  # the field does not matter
    assert compiler.compile(b) is compiler.compile(b)
    assert compiler.compile(a) is first  # a is now the most recent: c evicts b
    compiler.compile(c)
    assert compiler.compile(a) is first
    assert compiler.compile(b) is not None and compiler.compile(c) is not None  # b back, a evicted
    assert compiler.compile(a) is not first
    # matchers of one grammar are independent
    m1, m2 = first.matcher(), first.matcher()
    assert m1.accept(tok.encode("a", add_special_tokens=False)[0])
    bitmask = allocate_bitmask(2, VOCAB)
    m1.fill_bitmask(bitmask, 0)
    m2.fill_bitmask(bitmask, 1)
    assert EOS in allowed(bitmask, 0) and EOS not in allowed(bitmask, 1)
    compiler.close()


def test_concurrent_compiles_of_one_spec_share_one_grammar(tok: Tokenizer):
    compiler = GrammarCompiler(tok, VOCAB, tok.eos_token_ids)
    spec = StructuredOutput(json_schema=json.dumps(WALK_SCHEMAS["nested"]))
    results: list[CompiledGrammar] = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(spec))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(r is results[0] for r in results)
    compiler.close()


@pytest.mark.parametrize("vocab_size", [VOCAB + 70, VOCAB - 60])
def test_a_logits_width_other_than_the_tokenizers(vocab_size: int, tok: Tokenizer):
    compiler = GrammarCompiler(tok, vocab_size, [EOS])
    matcher = compiler.compile(StructuredOutput(json_object=True)).matcher()
    bitmask = allocate_bitmask(2, vocab_size)
    assert bitmask.shape == (2, (vocab_size + 31) // 32)
    bitmask.fill_(-1)
    inside_string = tok.encode('{"', add_special_tokens=False)
    for token in inside_string:
        assert matcher.accept(token)
    matcher.fill_bitmask(bitmask, 1)
    mask = allowed(bitmask, 1)
    assert len(mask) > 10_000  # almost anything goes inside a string
    assert max(mask) < min(vocab_size, tok.vocab_size)  # never an id the model or the tokenizer lacks
    assert not matcher.accept(vocab_size) and not matcher.accept(vocab_size + 1)
    with pytest.raises(ValueError, match="words"):
        matcher.fill_bitmask(allocate_bitmask(1, vocab_size + 64), 0)


def test_only_the_given_eos_ids_end_the_output(tok: Tokenizer):
    compiler = GrammarCompiler(tok, VOCAB, [ENDOFTEXT])
    matcher = compiler.compile(StructuredOutput(choice=("yes",))).matcher()
    for token in tok.encode("yes", add_special_tokens=False):
        assert matcher.accept(token)
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed(bitmask, 0) == {ENDOFTEXT}
    assert not matcher.accept(EOS)
    assert matcher.accept(ENDOFTEXT) and matcher.is_terminated


# --------------------------------------------------------------------------------------------- apply_bitmask


def _naive(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.shape[1]
    for i, row in enumerate(rows):
        for token in range(out.shape[1]):
            if token >= 32 * words or not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize(("batch", "width", "mask_vocab", "rows"), [
    (3, 64, 64, [0, 1, 2]),  # whole batch
    (5, 1000, 1000, [0, 2, 3]),  # vocab not a multiple of 32, rows skipped
    (4, 1000, 1000, [1, 2]),  # a contiguous run not at 0
    (3, 1100, 1000, [2, 0]),  # logits wider than the mask covers (1,024 tokens): the rest -inf; rows unordered
    (2, 1000, 1100, [1]),  # a mask wider than the logits
    (2, 40, 40, []),  # nothing to do
])
@pytest.mark.parametrize("through_copy", [False, True])
def test_apply_bitmask_matches_a_plain_loop(batch: int, width: int, mask_vocab: int, rows: list[int],
                                            through_copy: bool, monkeypatch: pytest.MonkeyPatch):
    if through_copy:  # the path of logits on a GPU: the mask rows (and row ids) copied to the logits' device
        rows_to = bitmask_module._rows_to
        monkeypatch.setattr(bitmask_module, "_rows_to",
                            lambda device, mask, r, *, copy: rows_to(device, mask, r, copy=True))
    gen = torch.Generator().manual_seed(width + batch)
    logits = torch.randn(batch, width, generator=gen) * 10
    logits[0, 3] = float("-inf")
    logits[-1, 5] = 1e30
    bitmask = allocate_bitmask(len(rows) + 2, mask_vocab)  # more rows than used: the tail is ignored
    bitmask.copy_(torch.randint(-(2**31), 2**31, bitmask.shape, generator=gen, dtype=torch.int64).to(torch.int32))
    bitmask[0, 0] = 0  # a word allowing nothing, and one allowing everything
    bitmask[-1, 1] = -1
    expected = _naive(logits, bitmask, rows)
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def _pack(allowed_tokens: torch.Tensor) -> torch.Tensor:
    """bool [B, V] -> int32 bitmask [B, ceil(V / 32)]."""
    b, v = allowed_tokens.shape
    padded = torch.zeros(b, -(-v // 32) * 32, dtype=torch.int64)
    padded[:, :v] = allowed_tokens.long()
    words = (padded.view(b, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("density", [0.001, 0.5, 0.98])
def test_apply_bitmask_on_smollm2s_width(density: float):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, VOCAB, generator=gen)
    allowed_tokens = torch.rand(16, VOCAB, generator=gen) < density
    expected = torch.where(allowed_tokens, logits, float("-inf"))
    apply_bitmask(logits, _pack(allowed_tokens), list(range(16)))
    assert torch.equal(logits, expected)


def test_allocate_bitmask():
    bitmask = allocate_bitmask(4, 1000)
    assert bitmask.shape == (4, 32) and bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
    assert bool((bitmask == -1).all())
