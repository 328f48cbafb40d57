"""Closing a JSON output before its token budget runs out, so that a constrained reply cut by `max_tokens` (or by the
end of the context) is still one JSON value that its schema accepts, not a prefix of one.

A grammar keeps every prefix of the output valid, but nothing makes the output end: a small model can repeat array
items or run on inside a string until its budget is spent, and the reply is then cut mid-value. So in the last
`CLOSE_WINDOW` tokens of a JSON-constrained sequence's budget, each step plans the shortest way out it can find: on a
copy of the matcher, greedily, the grammar's forced tokens when it has some, else the first token the grammar accepts
from a short list of closing candidates (inside a string: close it, else an `@` or a `.`, what a format may need;
outside: close the containers, a separator, a minimal value), else the lowest allowed token id, until the grammar
accepts the output as complete. When the plan needs all but
`CLOSE_MARGIN` of the tokens left, the sequence is made to follow it (its mask is that one token). The plan depends
only on the sequence's own output, so a request closes the same way in any batch and after an exact resume.

Whether the output is inside a string decides which candidates come first: `JsonScan` follows the output's bytes (a
string's quote or backslash is never part of a multi-byte UTF-8 character).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

CLOSE_WINDOW = 64  # closing is planned once a sequence has at most this many tokens left
CLOSE_MARGIN = 8  # ... and followed once the plan needs at least (tokens left - CLOSE_MARGIN)

_CLOSERS = frozenset(b'"]}')
# after the closers and separators, outside a string: the smallest values of each JSON type, then what opens one
_VALUES = (b'""', b"0", b"1", b"null", b"true", b"false", b"[]", b"{}", b"[", b"{", b'"', b"-")
_SEPARATORS = (b",", b", ")
# inside a string that cannot end yet (a pattern or format): what an email or a host name needs next
_STRING_PARTS = (b"@", b".")


@dataclass
class JsonScan:
    """Whether a JSON text read so far ends inside a string (after its opening quote, before its closing one)."""

    in_string: bool = False
    escaped: bool = False

    def feed(self, data: bytes) -> None:
        in_string, escaped = self.in_string, self.escaped
        for byte in data:
            if escaped:
                escaped = False
            elif in_string and byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = not in_string
        self.in_string, self.escaped = in_string, escaped

    def copy(self) -> JsonScan:
        return JsonScan(self.in_string, self.escaped)


@dataclass(frozen=True)
class ClosingTokens:
    """A tokenizer's closing candidates, in the order they are tried, and every token's bytes."""

    in_string: tuple[int, ...]  # closers that begin with a quote (longest first), then the string parts
    outside: tuple[int, ...]  # the other closers (longest first), the separators, the small values
    token_bytes: tuple[bytes, ...]

    @classmethod
    def of(cls, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> ClosingTokens:
        token_bytes = tuple(tokenizer.decode_bytes([i]) for i in range(vocab_size))
        closers = sorted((i for i, b in enumerate(token_bytes) if b and set(b) <= _CLOSERS),
                         key=lambda i: (-len(token_bytes[i]), i))
        by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(token_bytes):
            by_bytes.setdefault(b, i)
        quoted = [i for i in closers if token_bytes[i].startswith(b'"')]
        unquoted = [i for i in closers if not token_bytes[i].startswith(b'"')]
        parts = [by_bytes[b] for b in _STRING_PARTS if b in by_bytes]
        others = [by_bytes[b] for b in (*_SEPARATORS, *_VALUES) if b in by_bytes]
        return cls(tuple(dict.fromkeys((*quoted, *parts))), tuple(dict.fromkeys((*unquoted, *others))), token_bytes)


def closing_plan(matcher: llguidance.LLMatcher, scan: JsonScan, tokens: ClosingTokens, limit: int,
                 eos_token_ids: frozenset[int], scratch: torch.Tensor) -> list[int] | None:
    """The tokens that complete the output from `matcher`'s state (not changed: the plan runs on a copy), at most
    `limit` of them; [] when it may end already; None when none was found within the limit. `scratch`: an int32
    tensor of the matcher's mask width, for the masks of the last resort."""
    copy = matcher.deep_copy()
    scan = scan.copy()
    plan: list[int] = []
    while not copy.is_accepting():
        if len(plan) >= limit or copy.is_error() or copy.is_stopped():
            return None
        forced = copy.compute_ff_tokens()
        taken = copy.try_consume_tokens(forced) if forced else 0
        if taken:
            step = forced[:taken]
        else:
            token = _first_accepted(copy, tokens.in_string if scan.in_string else tokens.outside)
            if token is None:
                token = _lowest_allowed(copy, eos_token_ids, len(tokens.token_bytes), scratch)
                if token is None or copy.try_consume_tokens([token]) != 1:
                    return None
            step = [token]
        for token in step:
            scan.feed(tokens.token_bytes[token])
        plan += step
    return plan if len(plan) <= limit else None


def _first_accepted(matcher: llguidance.LLMatcher, candidates: Sequence[int]) -> int | None:
    for token in candidates:
        if matcher.try_consume_tokens([token]) == 1:
            return token
    return None


def _lowest_allowed(matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int], vocab_size: int,
                    scratch: torch.Tensor) -> int | None:
    """The lowest token id the grammar allows next, EOS aside (the output cannot end here)."""
    matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
    words = scratch.numpy().view(np.uint32)
    for word in np.flatnonzero(words):
        bits = int(words[word])
        while bits:
            low = bits & -bits
            token = int(word) * 32 + low.bit_length() - 1
            if token >= vocab_size:
                return None
            if token not in eos_token_ids:
                return token
            bits ^= low
    return None
