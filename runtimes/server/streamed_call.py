"""One tool call's JSON as a model writes it, checked strictly character by character: the tool parsers
(runtimes/server/tool_parsers.py) show a call once its name is complete and all before it is valid, and stream its
arguments as the model's own text, each character once it is known to be valid, so that the pieces add up to valid
JSON."""

from __future__ import annotations

import json

_NUM = {  # JSON number grammar: state -> {character class -> state}; it may end in z(ero), i(nt), f(raction), x
    "-": {"0": "z", "d": "i"}, "z": {".": ".", "e": "e"}, "i": {"0": "i", "d": "i", ".": ".", "e": "e"},
    ".": {"0": "f", "d": "f"}, "f": {"0": "f", "d": "f", "e": "e"}, "e": {"+": "s", "-": "s", "0": "x", "d": "x"},
    "s": {"0": "x", "d": "x"}, "x": {"0": "x", "d": "x"},
}
_LIT = {"t": "rue", "f": "alse", "n": "ull"}  # what a literal lacks after its first letter
_CLOSER = {"{": "}", "[": "]"}


class StreamedCall:
    """One call as its JSON text arrives, checked strictly character by character (ValueError at the first one no
    JSON text could have there): `{"name": ..., "arguments"|"parameters": ...}`, or with `bare` (the name, given
    before it) the arguments alone. Knows its name once complete and the raw text of its arguments so far."""

    def __init__(self, bare: str | None = None) -> None:
        self.raw, self.bare, self.sent = "", bare, 0  # raw: all text given to it, also past its end
        self.name: str | None = None
        self.index: int | None = None  # set once shown to the client
        self._stack: list[str] = []
        self._expect, self._tok, self._rest, self._esc, self._is_key = "value", "", "", 0, False
        self._good, self._done, self._k0, self._v0 = 0, False, 0, 0
        self._key: str | None = None
        self._a0: int | None = None
        self._a1: int | None = None

    def args(self) -> str:
        if self._a0 is None:
            return "{}" if self._done else ""
        return self.raw[self._a0 : self._good if self._a1 is None else self._a1]

    def push(self, text: str) -> tuple[int, str]:
        """Takes `text` up to the call's end: (characters taken, "more" | "done" | "bad")."""
        base = len(self.raw)
        self.raw += text
        for i, ch in enumerate(text):
            try:
                self._done = self._char(ch, base + i)
            except ValueError:
                self._good = base + i
                return i, "bad"
            if self._done:
                self._good = base + i + 1
                return i + 1, "done"
        self._good = len(self.raw)
        return len(text), "more"

    def _char(self, ch: str, pos: int) -> bool:
        if self._tok == '"':
            if self._esc > 0 and ch in "0123456789abcdefABCDEF":
                self._esc -= 1
            elif self._esc < 0 and ch in '"\\/bfnrtu':
                self._esc = 4 if ch == "u" else 0
            elif self._esc or ch < " ":
                raise ValueError(ch)
            elif ch == "\\":
                self._esc = -1
            elif ch == '"':
                return self._ended(pos + 1)
            return False
        if self._tok == "t":
            if ch != self._rest[0]:
                raise ValueError(ch)
            self._rest = self._rest[1:]
            return not self._rest and self._ended(pos + 1)
        if self._tok == "0":
            cls = "d" if ch in "123456789" else "e" if ch in "eE" else ch
            if cls in _NUM[self._rest]:
                self._rest = _NUM[self._rest][cls]
                return False
            if self._rest not in "zifx":
                raise ValueError(ch)
            self._ended(pos)  # a number is never the outermost value: this ends no call
        e = self._expect
        if ch in " \t\n\r":
            pass
        elif e == "value" or (e == "item" and ch != "]"):
            self._value(ch, pos)
        elif e in ("member", "key") and ch == '"':
            self._tok, self._is_key, self._k0 = '"', True, pos
        elif e == "colon" and ch == ":":
            self._expect = "value"
        elif e == "next" and ch == ",":
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif e in ("member", "item", "next") and ch == _CLOSER[self._stack[-1]]:
            self._stack.pop()
            return self._ended(pos + 1)
        else:
            raise ValueError(ch)
        return False

    def _value(self, ch: str, pos: int) -> None:
        depth = len(self._stack)
        if ch not in '{["tfn-0123456789' or (depth == 0 and ch not in "{["):
            raise ValueError(ch)
        if self.bare is not None and depth == 0:
            self._a0, self.name = pos, self.bare
        elif self.bare is None and depth == 1:
            self._v0 = pos
            if self._key in ("arguments", "parameters") and self._a0 is None:
                self._a0 = pos
            elif self._key == "name" and self.name is None and ch != '"':
                raise ValueError("the name is not a string")
        if ch in "{[":
            self._stack.append(ch)
            self._expect = "member" if ch == "{" else "item"
        else:
            self._tok = '"' if ch == '"' else "t" if ch in _LIT else "0"
            self._rest = _LIT.get(ch, {"-": "-", "0": "z", '"': ""}.get(ch, "i"))

    def _ended(self, end: int) -> bool:
        """A key or value ended at `end`; True when it is the outermost one (the call's end)."""
        depth, self._tok = len(self._stack), ""
        if self._is_key:
            self._is_key, self._expect = False, "colon"
            if depth == 1:
                self._key = json.loads(self.raw[self._k0 : end])
            return False
        self._expect = "next" if depth else "done"
        if depth == 0 and self.bare is not None:
            self._a1 = end
        elif depth == 1 and self.bare is None:
            if self._a0 == self._v0 and self._a1 is None:
                self._a1 = end
            elif self._key == "name" and self.name is None:
                self.name = json.loads(self.raw[self._v0 : end]) or None
        return depth == 0
