"""Grammars for constrained decoding on llguidance: a request's `StructuredOutput` compiled once (cached), and a
matcher per output sequence that says which next tokens the grammar allows and follows the tokens drawn.

Each form is llguidance's own: a JSON schema through its JSON-schema compiler, `json_object` as the schema
`{"type": "object"}`, a regex as its regex (Rust `regex` syntax, matched in full), `choice` as its choice form (a Lark
alternation of the literal strings), `grammar` as Lark, or GBNF (llama.cpp's syntax), which its converter turns into
Lark first. JSON is written as `json.dumps` writes it: ", " between items, ": " after keys, no other whitespace (a
small model given free whitespace can emit newlines forever); a schema may choose otherwise with llguidance's
"x-guidance" options. Unknown schema keywords are refused, not ignored.

llguidance builds the lexer and parser when a matcher is made (milliseconds) and computes each mask as the output
goes (tens of microseconds a token), so a compiled grammar is a matcher at the start of the output, copied for each
sequence. Measurements and the comparison with xgrammar: docs/benchmarks.md, "Grammar engines".
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import torch

from foundation.request_errors import InvalidRequestError
from runtimes.llm.grammar.bitmask import bitmask_width
from runtimes.llm.grammar.closing import CLOSE_MARGIN, CLOSE_WINDOW, ClosingTokens, JsonScan, closing_plan
from runtimes.llm.grammar.schemas import closed_objects, schema_problem
from runtimes.llm.sampling_params import StructuredOutput
from runtimes.llm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its type stubs only

__all__ = ["CompiledGrammar", "FixedMask", "GrammarCompiler", "GrammarMatcher"]

# The JSON layout: `json.dumps`'s separators, no free whitespace (defaults: a schema's "x-guidance" may override).
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = '{"type": "object"}'

# A spec's content without the field it came from: what the cache is keyed by.
_SpecKey = tuple[str | None, bool, str | None, tuple[str, ...] | None, str | None]


class GrammarMatcher:
    """One output sequence's place in its grammar. Used by one thread at a time (the engine's loop)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, mask_words: int,
                 eos_token_ids: frozenset[int], closing: ClosingTokens | None = None) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._ended = False  # an EOS was accepted
        # JSON output: closed before its budget runs out (runtimes/llm/grammar/closing.py)
        self._closing = closing
        self._scan = JsonScan()
        self._plan: list[int] | None = None  # the closing plan from here on, while it is followed
        self.closed_early = False  # the output was made to close: its budget was nearly spent
        self._words = bitmask_width(vocab_size)
        # llguidance writes ceil(V' / 32) words for its vocabulary of V' = max(vocab_size, the tokenizer's) tokens;
        # where that is wider than the bitmask (a tokenizer with ids the model cannot emit), it writes here first
        self._scratch = torch.empty(mask_words, dtype=torch.int32) if mask_words != self._words else None
        self._mask_words = mask_words
        self._plan_scratch: torch.Tensor | None = None  # a closing plan's masks (llguidance's width)
        self._bitmask: torch.Tensor | None = None  # the last bitmask filled, checked
        self._bitmask_shape = torch.Size()

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False, with the state unchanged, if the grammar does not allow it."""
        if self._ended or not 0 <= token_id < self._vocab_size:
            return False
        if self._matcher.is_stopped():
            # complete, nothing can extend it: only EOS (which llguidance's try_consume_tokens refuses here)
            if token_id not in self._eos or self._matcher.is_error():
                return False
            accepted = bool(self._matcher.consume_token(token_id))
        else:
            accepted = self._matcher.try_consume_tokens([token_id]) == 1
        if self._matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._matcher.get_error()}")
        self._ended = accepted and token_id in self._eos
        if accepted and self._closing is not None:
            self._scan.feed(self._closing.token_bytes[token_id])
            plan = self._plan
            self._plan = plan[1:] if plan and plan[0] == token_id else None
        return accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, remaining: int | None = None) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 `[B, ceil(V / 32)]` on the CPU): those that
        continue the grammar, and the EOS ids exactly when the output may end here. `remaining`: the tokens the
        sequence may still generate, this one included; near that end a JSON output is allowed only the next token
        of its closing plan. Raises RuntimeError if the matcher failed (a limit of llguidance's parser was hit),
        which fails the sequence's request."""
        if bitmask is not self._bitmask or bitmask.shape != self._bitmask_shape:
            self._check(bitmask)  # once per bitmask tensor (a bitmask kept from step to step is checked once)
        if not 0 <= row < self._bitmask_shape[0]:
            raise IndexError(f"row {row} of a bitmask of {self._bitmask_shape[0]} rows")
        token = self._closing_token(remaining)
        if token is not None:
            bitmask[row] = 0
            bitmask[row, token // 32] = _bit(token % 32)
            self.closed_early = True
            return
        self._write_mask(self._matcher, bitmask, row)

    def _write_mask(self, matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
        """`matcher`'s allowed next tokens into `bitmask[row]` (a checked bitmask of this grammar's width)."""
        address = bitmask.data_ptr() + row * self._words * 4
        if self._scratch is None:
            matcher.unsafe_compute_mask_ptr(address, self._words * 4)
        else:
            matcher.unsafe_compute_mask_ptr(self._scratch.data_ptr(), self._scratch.numel() * 4)
            target = bitmask[row]
            target.copy_(self._scratch[: self._words])
            tail = self._vocab_size % 32
            if tail:  # ids from vocab_size on, in the last word, are not the model's
                target[-1] &= (1 << tail) - 1
        if matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {matcher.get_error()}")

    def masks_along(self, tokens: Sequence[int]) -> list[FixedMask]:
        """The bitmasks of the next token after each prefix of `tokens` the grammar allows, as `fill_bitmask` would
        write them with the matcher advanced that far (speculative decoding's verification rows): one for the
        empty prefix, then one more for each token allowed, up to the first one it refuses, an EOS, or one that
        completes the grammar (plain decoding ends the output there: no position after it is sampled). A copy of
        the matcher walks the tokens, so this one stays where it is whatever happens (llguidance's errors stick).
        Away from the end of the budget only: these masks never follow a closing plan."""
        if self._ended:
            return []
        walker = self._matcher.deep_copy()
        bitmask = torch.empty(len(tokens) + 1, self._words, dtype=torch.int32)
        count = 0
        for j, token in enumerate([*tokens, None]):
            self._write_mask(walker, bitmask, j)
            count = j + 1
            if token is None or not 0 <= token < self._vocab_size or token in self._eos or walker.is_stopped():
                break
            if walker.try_consume_tokens([token]) != 1 or walker.is_error() or walker.is_stopped():
                break  # refused, failed, or complete (the token is not proposed: see above)
        return [FixedMask(bitmask[i]) for i in range(count)]

    @property
    def plans_closing(self) -> bool:
        """Whether its output follows a closing plan near the end of its budget (a JSON form: closing.py)."""
        return self._closing is not None

    def _closing_token(self, remaining: int | None) -> int | None:
        """The next token of the closing plan, when the output must follow it now (closing.py), else None."""
        if self._closing is None or remaining is None or remaining > CLOSE_WINDOW or self._ended:
            return None
        plan = self._plan
        if plan is None:
            if self._plan_scratch is None:
                self._plan_scratch = torch.empty(self._mask_words, dtype=torch.int32)
            plan = closing_plan(self._matcher, self._scan, self._closing, remaining, self._eos, self._plan_scratch)
        if not plan or len(plan) < remaining - CLOSE_MARGIN:
            self._plan = None
            return None
        self._plan = plan
        return plan[0]

    def _check(self, bitmask: torch.Tensor) -> None:
        shape = bitmask.shape
        if (bitmask.dtype != torch.int32 or not bitmask.is_cpu or len(shape) != 2 or shape[1] != self._words
                or not bitmask.is_contiguous()):
            raise ValueError(f"the bitmask must be a contiguous int32 [B, {self._words}] tensor on the CPU (words a "
                             f"row for vocab_size {self._vocab_size}), got {bitmask.dtype} {tuple(shape)} on "
                             f"{bitmask.device}")
        self._bitmask, self._bitmask_shape = bitmask, shape

    @property
    def is_terminated(self) -> bool:
        """Nothing more may follow: EOS was accepted, or the grammar is complete and no token can extend it (then
        only EOS is allowed)."""
        return self._ended or bool(self._matcher.is_stopped())


class FixedMask:
    """The mask of one token position computed ahead (`GrammarMatcher.masks_along`): written as it was computed."""

    __slots__ = ("words",)

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words  # int32 [ceil(V / 32)]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, remaining: int | None = None) -> None:
        bitmask[row] = self.words


class CompiledGrammar:
    """A compiled constraint: makes a matcher per output sequence (thread-safe)."""

    def __init__(self, template: llguidance.LLMatcher, vocab_size: int, mask_words: int,
                 eos_token_ids: frozenset[int], closing: ClosingTokens | None = None) -> None:
        self._template = template  # at the start of the output; never advanced, only copied
        self._closing = closing  # a JSON form: its outputs close before their budget runs out
        self._vocab_size = vocab_size
        self._mask_words = mask_words
        self._eos = eos_token_ids
        self._lock = threading.Lock()

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the output."""
        with self._lock:
            copy = self._template.deep_copy()
        return GrammarMatcher(copy, self._vocab_size, self._mask_words, self._eos, self._closing)


class GrammarCompiler:
    """Compiles `StructuredOutput` specs against one model's tokenizer, with an LRU cache of the results.

    `vocab_size` is the model's logits width, which may exceed the tokenizer's vocabulary (ids past it are never
    allowed) or fall short of it (ids past it are never allowed either). `eos_token_ids` are the ids that end the
    output (allowed exactly where the grammar may end). `compile` is thread-safe; a spec it cannot compile, one over
    `max_spec_chars` or one whose compile takes over `timeout_s` is an InvalidRequestError naming the spec's `param`.
    Refusals are cached like grammars (re-raised naming the new spec's field); timeouts are not, and a compile
    that ran past its caller's timeout still fills the cache when it finishes."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *,
                 max_spec_chars: int = 65536, timeout_s: float = 10.0, cache_size: int = 128) -> None:
        eos = list(dict.fromkeys(eos_token_ids)) or list(tokenizer.eos_token_ids)
        if not eos:
            raise ValueError("constrained decoding needs at least one EOS token id")
        if vocab_size < 1 or cache_size < 1 or max_spec_chars < 1 or timeout_s <= 0:
            raise ValueError("vocab_size, cache_size, max_spec_chars and timeout_s must be positive")
        self.vocab_size = vocab_size
        self.max_spec_chars = max_spec_chars
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        n_vocab = max(vocab_size, tokenizer.vocab_size)
        self._mask_words = bitmask_width(n_vocab)
        self._eos = frozenset(eos)
        self._tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=eos)
        self._lock = threading.Lock()
        self._closing: ClosingTokens | None = None
        self._closing_lock = threading.Lock()
        # spec -> CompiledGrammar, or the message of a refusal; most recently used last
        self._cache: OrderedDict[_SpecKey, CompiledGrammar | str] = OrderedDict()
        self._pending: dict[_SpecKey, concurrent.futures.Future[CompiledGrammar | str]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                                           thread_name_prefix="grammar-compile")

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar for `spec` (from the cache when it was compiled before)."""
        key = _spec_key(spec)
        size = _spec_chars(spec)
        if size > self.max_spec_chars:
            raise InvalidRequestError(f"{spec.param}: the {_form_name(spec)} has {size} characters, over the limit "
                                      f"of {self.max_spec_chars}", param=spec.param)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return self._result(hit, spec)
            future = self._pending.get(key)
            if future is None:  # one compile per spec, however many callers wait for it
                future = self._pool.submit(self._run, key)
                self._pending[key] = future
        try:
            result = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise InvalidRequestError(f"{spec.param}: compiling the {_form_name(spec)} took longer than "
                                      f"{self.timeout_s:g} s", param=spec.param) from None
        return self._result(result, spec)

    def close(self) -> None:
        """Stop the compile threads (compiles under way finish first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _result(self, result: CompiledGrammar | str, spec: StructuredOutput) -> CompiledGrammar:
        if isinstance(result, str):
            raise InvalidRequestError(f"{spec.param}: {result}", param=spec.param)
        return result

    def _run(self, key: _SpecKey) -> CompiledGrammar | str:
        """On a pool thread: compile, and cache the result before any waiter sees it."""
        try:
            result = self._build(key)
            with self._lock:
                self._cache[key] = result
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return result
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def _build(self, key: _SpecKey) -> CompiledGrammar | str:
        """Compile on a pool thread: the grammar, or why it cannot be compiled (a message without the field)."""
        json_schema, json_object, regex, choice, grammar = key
        try:
            if json_schema is not None:
                problem = schema_problem(json_schema)
                if problem:
                    return problem
                source = llguidance.LLMatcher.grammar_from_json_schema(closed_objects(json_schema),
                                                                       defaults=_JSON_OPTIONS)
            elif json_object:
                source = llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_OPTIONS)
            elif regex is not None:
                source = llguidance.grammar_from("regex", regex)
            elif choice is not None:
                source = llguidance.grammar_from("choice", json.dumps(list(choice)))
            elif grammar is not None:
                source = llguidance.grammar_from("grammar", grammar)  # Lark, or GBNF converted to Lark
            else:
                return "no constraint given: set one of json, json_object, regex, choice, grammar"
        except ValueError as e:  # llguidance's own refusal of the text (e.g. GBNF it cannot convert)
            return f"invalid {_form_name_of(key)}: {_clip(str(e))}"
        # log_level 0: a grammar's problems come back through is_error/get_error, not on stderr
        template = llguidance.LLMatcher(self._tokenizer, source, log_level=0)
        if not template.is_error():
            # the first mask, here rather than on the engine's loop: the lexer states it builds are copied with the
            # template (a regex's first mask: 109 µs on a cold copy, 2 µs on a copy of a warmed template)
            first = torch.empty(self._mask_words, dtype=torch.int32)
            template.unsafe_compute_mask_ptr(first.data_ptr(), self._mask_words * 4)
        if template.is_error():
            return f"invalid {_form_name_of(key)}: {_clip(template.get_error().strip())}"
        closing = self._closing_tokens() if json_schema is not None or json_object else None
        return CompiledGrammar(template, self.vocab_size, self._mask_words, self._eos, closing)

    def _closing_tokens(self) -> ClosingTokens:
        """The tokenizer's closing candidates, read once (on a pool thread: ~0.1 s for 50k tokens)."""
        with self._closing_lock:
            if self._closing is None:
                self._closing = ClosingTokens.of(self._tokenizer, self.vocab_size)
            return self._closing


def _bit(index: int) -> int:
    """Bit `index` (0-31) of an int32 word, as the signed value torch stores."""
    return (1 << index) - (1 << 32 if index == 31 else 0)


def _clip(message: str, limit: int = 2000) -> str:
    """A library's error message, cut to `limit` characters (it may quote the whole grammar)."""
    return message if len(message) <= limit else message[:limit] + " ..."


def _spec_key(spec: StructuredOutput) -> _SpecKey:
    return (spec.json_schema, bool(spec.json_object), spec.regex,
            tuple(spec.choice) if spec.choice is not None else None, spec.grammar)


def _spec_chars(spec: StructuredOutput) -> int:
    texts = [spec.json_schema, spec.regex, spec.grammar, *(spec.choice or ())]
    return sum(len(t) for t in texts if t is not None)


def _form_name_of(key: _SpecKey) -> str:
    json_schema, json_object, regex, choice, _ = key
    if json_schema is not None:
        return "JSON schema"
    if json_object:
        return "JSON object constraint"
    if regex is not None:
        return "regex"
    return "choice" if choice is not None else "grammar"


def _form_name(spec: StructuredOutput) -> str:
    return _form_name_of(_spec_key(spec))
