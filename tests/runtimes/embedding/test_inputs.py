"""The input policy: tokenization without the tokenizer file's own truncation/padding, refusal or truncation of
long inputs, token-id inputs as given."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from foundation.request_errors import InvalidRequestError
from runtimes.embedding.inputs import InputProcessor
from tests.runtimes.embedding.conftest import SENTENCES, long_text, minilm_dir

CLS, SEP = 101, 102


@pytest.fixture(scope="module")
def inputs() -> InputProcessor:
    return InputProcessor.from_dir(minilm_dir(), limit=256)


def reference(max_length: int | None = None) -> Tokenizer:
    """The same tokenizer.json with HF's own truncation (what sentence-transformers applies)."""
    tok = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tok.no_padding()
    if max_length is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_length)
    return tok


def test_texts_tokenize_like_the_tokenizer_without_its_128_token_padding(inputs):
    prepared = inputs.prepare(SENTENCES)
    expected = [e.ids for e in reference().encode_batch(SENTENCES)]
    assert prepared.token_ids == expected
    assert all(ids[0] == CLS and ids[-1] == SEP for ids in prepared.token_ids)
    assert prepared.num_prompt_tokens == sum(map(len, expected)) and len(expected[-1]) == 3  # "hi"


def test_long_text_refused_by_default_naming_the_limit(inputs):
    with pytest.raises(InvalidRequestError, match=r"input\[1\] has \d+ tokens, over this model's limit of 256") as err:
        inputs.prepare(["short", long_text()])
    assert err.value.param == "input" and "truncate_prompt_tokens" in str(err.value)
    with pytest.raises(InvalidRequestError, match="over this model's limit of 256"):
        inputs.prepare([list(range(1000, 1300))])


@pytest.mark.parametrize("keep", [-1, 256, 17, 3])
def test_truncation_keeps_the_head_and_the_special_tokens(inputs, keep):
    length = 256 if keep == -1 else keep
    prepared = inputs.prepare([long_text(), "hi"], truncate_prompt_tokens=keep)
    assert prepared.token_ids[0] == reference(length).encode(long_text()).ids
    assert len(prepared.token_ids[0]) == length and prepared.token_ids[0][-1] == SEP
    assert prepared.token_ids[1] == [CLS, reference().encode("hi").ids[1], SEP]  # short inputs untouched
    assert prepared.num_prompt_tokens == length + 3


def test_truncate_prompt_tokens_bounds(inputs):
    with pytest.raises(InvalidRequestError, match=r"within \[1, 256\].*got 257") as err:
        inputs.prepare(["x"], truncate_prompt_tokens=257)
    assert err.value.param == "truncate_prompt_tokens"
    with pytest.raises(InvalidRequestError, match="got 0"):
        inputs.prepare(["x"], truncate_prompt_tokens=0)
    with pytest.raises(InvalidRequestError, match="no room for text next to the model's 2 special tokens"):
        inputs.prepare(["x"], truncate_prompt_tokens=2)
    assert inputs.prepare([[5, 6, 7]], truncate_prompt_tokens=2).token_ids == [[5, 6]]  # ids: no specials


def test_token_ids_are_used_as_given(inputs):
    ids = reference().encode("Paris is the capital of France.").ids
    assert inputs.prepare([ids, [7592]]).token_ids == [ids, [7592]]
    with pytest.raises(InvalidRequestError, match=r"input\[1\] has token id 30522, outside this model's vocabulary"):
        inputs.prepare([ids, [30522]])
    with pytest.raises(InvalidRequestError, match="token id -1"):
        inputs.prepare([[-1]])
    with pytest.raises(InvalidRequestError, match=r"input\[0\] is empty"):
        inputs.prepare([[]])
    with pytest.raises(InvalidRequestError, match="input must not be empty"):
        inputs.prepare([])
