"""Turning a request's inputs (texts or token ids) into the token ids the encoder sees, under the model's limit.

The limit policy (OpenAI-compatible by default): an input longer than the model's limit is refused with a
400 naming the input, its length and the limit. A request may instead ask for truncation with vLLM's
`truncate_prompt_tokens` (k >= 1, or -1 for the model's limit): each input keeps its first k tokens, the
way sentence-transformers truncates (for text the special tokens, [CLS] ... [SEP], are kept and counted).
Token-id inputs are used as given: no special tokens are added, so a client sends what the tokenizer makes.

Thread-safe: the server runs this off its event loop while the engine thread encodes other batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Encoding, Tokenizer, normalizers

from foundation.request_errors import InvalidRequestError

TRUNCATE_TO_LIMIT = -1  # truncate_prompt_tokens=-1: truncate to the model's limit


@dataclass(frozen=True)
class PreparedInputs:
    token_ids: list[list[int]]
    num_prompt_tokens: int  # after truncation: what the encoder reads, and what `usage` reports


class InputProcessor:
    """Tokenizes texts and applies the length policy; `limit` is the model's input limit in tokens. With
    `lowercase` (sentence-transformers' `do_lower_case`) texts are lowercased first, by a Lowercase normalizer
    ahead of the tokenizer's own, as sentence-transformers adds one."""

    def __init__(self, tokenizer: Tokenizer, limit: int, lowercase: bool = False) -> None:
        if lowercase:
            own = tokenizer.normalizer
            tokenizer.normalizer = normalizers.Sequence(
                [normalizers.Lowercase(), *([] if own is None else [own])])
        tokenizer.no_truncation()  # tokenizer.json may carry its own (all-MiniLM-L6-v2: truncate and pad to 128)
        tokenizer.no_padding()  # padding is the batcher's business, per length bucket
        self.tokenizer = tokenizer
        self.limit = limit
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.num_special_tokens = tokenizer.num_special_tokens_to_add(False)

    @classmethod
    def from_dir(cls, path: Path, limit: int, lowercase: bool = False) -> InputProcessor:
        return cls(Tokenizer.from_file(str(path / "tokenizer.json")), limit, lowercase)

    def prepare(self, inputs: Sequence[str] | Sequence[Sequence[int]],
                truncate_prompt_tokens: int | None = None) -> PreparedInputs:
        """Token ids per input; raises InvalidRequestError (a 400) naming the input or field at fault."""
        if not inputs:
            raise InvalidRequestError("input must not be empty", param="input")
        keep = self._keep(truncate_prompt_tokens, texts=isinstance(inputs[0], str))
        if isinstance(inputs[0], str):
            token_ids = self._texts(list(inputs), keep)  # type: ignore[arg-type]
        else:
            token_ids = [self._ids(i, ids, keep) for i, ids in enumerate(inputs)]  # type: ignore[arg-type]
        for i, ids in enumerate(token_ids):
            self._check_length(i, len(ids), keep)
        return PreparedInputs(token_ids, sum(len(ids) for ids in token_ids))

    def encode(self, text: str) -> list[int]:
        """One text's token ids with the model's special tokens, untruncated."""
        return list(self.tokenizer.encode(text).ids)

    def _keep(self, truncate_prompt_tokens: int | None, texts: bool) -> int | None:
        """Tokens each input keeps (None: no truncation asked)."""
        k = truncate_prompt_tokens
        if k is None:
            return None
        if k == TRUNCATE_TO_LIMIT:
            return self.limit
        if k < 1 or k > self.limit:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 (the model's limit) or within [1, "
                                      f"{self.limit}] (this model's limit), got {k}", param="truncate_prompt_tokens")
        if texts and k <= self.num_special_tokens:
            raise InvalidRequestError(f"truncate_prompt_tokens={k} leaves no room for text next to the model's "
                                      f"{self.num_special_tokens} special tokens", param="truncate_prompt_tokens")
        return k

    def _texts(self, texts: list[str], keep: int | None) -> list[list[int]]:
        encodings = self.tokenizer.encode_batch(texts)
        return [self._truncated_text(text, keep) if keep is not None and len(enc) > keep else list(enc.ids)
                for text, enc in zip(texts, encodings, strict=True)]

    def _truncated_text(self, text: str, keep: int) -> list[int]:
        # Cut the text's own tokens, then add the special tokens: what HF tokenizers do with truncation on.
        encoding: Encoding = self.tokenizer.encode(text, add_special_tokens=False)
        encoding.truncate(keep - self.num_special_tokens)
        return list(self.tokenizer.post_process(encoding).ids)

    def _ids(self, index: int, ids: Sequence[int], keep: int | None) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"input[{index}] has token id {bad}, outside this model's vocabulary "
                                      f"[0, {self.vocab_size})", param="input")
        return list(ids if keep is None else ids[:keep])

    def _check_length(self, index: int, num_tokens: int, keep: int | None) -> None:
        if num_tokens == 0:
            raise InvalidRequestError(f"input[{index}] is empty", param="input")
        if keep is None and num_tokens > self.limit:
            raise InvalidRequestError(
                f"input[{index}] has {num_tokens} tokens, over this model's limit of {self.limit} tokens; shorten "
                f"it or set truncate_prompt_tokens (-1 truncates to {self.limit})", param="input")
