"""Incremental detokenization with stop strings, for streaming generated text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from runtimes.llm.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that are safe to stream.

    - UTF-8 characters split across tokens are emitted only once complete (via `tokenizers`' DecodeStream),
      so no delta ever carries a U+FFFD for a half-decoded character.
    - Stop strings are matched on the decoded text, so they may span token boundaries. The earliest match
      ends generation (`stopped_by` is set); the stop string is cut unless `include_stop_str_in_output`,
      and anything decoded after it is always cut.
    - Text that could still be the beginning of a stop string is held back (at most max(len(stop)) - 1
      characters, as in vLLM, but only while it actually is a prefix of some stop string), so a stream
      never shows text that a later match would take back. `flush()` releases it when generation ends for
      another reason (EOS, max_tokens).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        """Start an empty output; `stop` may be a single string or a sequence (empty strings are ignored)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = tuple(dict.fromkeys(s for s in ((stop,) if isinstance(stop, str) else stop) if s))
        self._max_stop_len = max(map(len, self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = []
        self._emitted = 0  # length of the prefix of `text` already returned to the caller
        self.text = ""
        self.stopped_by: str | None = None

    @classmethod
    def resumed(cls, tokenizer: Tokenizer, token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                stop: Sequence[str] = ()) -> tuple[IncrementalDetokenizer, str]:
        """A detokenizer that has seen `token_ids` (what a request another replica began has output so far), and the
        text it released for them: what that replica's stream showed, and what a whole reply begins with. Text held
        back there (a possible start of a stop string) is held back here too, so the rest comes out right."""
        detokenizer = cls(tokenizer, skip_special_tokens=skip_special_tokens, stop=stop)
        return detokenizer, "".join(detokenizer.add(token) for token in token_ids)

    @property
    def finished(self) -> bool:
        """True once a stop string has matched; further tokens are ignored."""
        return self.stopped_by is not None

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text that can be streamed now (possibly "")."""
        if self.stopped_by is not None:
            return ""
        self._ids.append(token_id)
        chunk = self._stream.step(self._tokenizer.backend, token_id)
        if chunk:
            self._append(chunk)
        return self._release(final=False)

    def flush(self) -> str:
        """Return everything still held back; call once when generation ends without a stop string.

        A trailing incomplete UTF-8 sequence comes out as U+FFFD here, as `Tokenizer.decode` would give it.
        """
        if self.stopped_by is None and self._ids:
            full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)
            if len(full) > len(self.text) and full.startswith(self.text):
                self._append(full[len(self.text) :])
        return self._release(final=True)

    def _append(self, chunk: str) -> None:
        old_len = len(self.text)
        self.text += chunk
        if not self._stop:
            return
        # A new match must end inside `chunk`, so it starts at most max_len - 1 characters before it.
        start = max(0, old_len - self._max_stop_len + 1)
        found: tuple[int, str] | None = None
        for s in self._stop:
            pos = self.text.find(s, start)
            if pos >= 0 and (found is None or pos < found[0]):
                found = (pos, s)
        if found is not None:
            pos, s = found
            self.stopped_by = s
            self.text = self.text[: pos + len(s) if self._include_stop else pos]

    def _release(self, *, final: bool) -> str:
        end = len(self.text)
        if not final and self.stopped_by is None and self._stop and not self._include_stop:
            end -= self._held_back_len()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _held_back_len(self) -> int:
        """Length of the longest suffix of the unreleased text that is a proper prefix of a stop string."""
        tail = self.text[max(self._emitted, len(self.text) - self._max_stop_len + 1) :]
        for i in range(len(tail)):
            suffix = tail[i:]
            if any(s.startswith(suffix) for s in self._stop):
                return len(suffix)
        return 0
