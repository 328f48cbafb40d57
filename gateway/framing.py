"""Cutting a replica's byte stream into frames (SSE events, progress lines) in time linear in its length, with every
byte held for a frame bounded, and reading the token-id lines of the continuation protocol (foundation/http/wire.py).

What a replica sends is never trusted to be short, well framed or well formed: a frame longer than its bound, or a
token line that is not a list of ids, is `UpstreamMalformed`, which ends the client's reply with an error (a 502, or
an error event in a stream that has begun) instead of being held in memory or passed on.
"""

from __future__ import annotations

from gateway.upstream import UpstreamError

MAX_FRAME_BYTES = 1 << 20  # one SSE event or progress line; a real one is a token or a usage chunk (well under 64 KiB)
MAX_TOKEN_ID = (1 << 31) - 1  # the vocabularies the engine loads are far smaller; an id must fit an int32 there
_MAX_ID_DIGITS = len(str(MAX_TOKEN_ID))


class UpstreamMalformed(UpstreamError):
    """The replica's reply breaks the protocol or a bound: an answer from a replica that misbehaves, to be ended
    for the client, never resumed elsewhere. `before`: the well-formed output that came ahead of the fault in the same
    read, still to be sent."""

    def __init__(self, message: str, before: bytes = b"") -> None:
        super().__init__(message)
        self.before = before


class Framer:
    """Cuts bytes into frames ended by `delimiter`, holding at most `max_frame_bytes` of an unfinished frame.

    Linear: while a frame is unfinished, only the new bytes are searched for the delimiter (from the end of what was
    held, less the delimiter's length); what is held is split once a delimiter has come, and is never more than the
    bound. A read with nothing held, the usual case, is split as it is, without a copy."""

    def __init__(self, delimiter: bytes, max_frame_bytes: int = MAX_FRAME_BYTES, what: str = "frame") -> None:
        self.delimiter = delimiter
        self.max_frame_bytes = max_frame_bytes
        self.what = what
        self._held = bytearray()

    @property
    def held(self) -> bytes:
        """The unfinished frame (what came after the last delimiter)."""
        return bytes(self._held)

    def clear(self) -> None:
        self._held.clear()

    def feed(self, data: bytes) -> list[bytes]:
        """The frames `data` completes, in order, without their delimiters (cut as `bytes.split` cuts the whole
        stream: leftmost first); UpstreamMalformed once an unfinished frame passes the bound."""
        held = self._held
        if held:
            start = max(len(held) - len(self.delimiter) + 1, 0)
            held += data
            if held.find(self.delimiter, start) < 0:
                self._check(len(held))
                return []
            *frames, rest = bytes(held).split(self.delimiter)
        else:
            *frames, rest = data.split(self.delimiter)
        held[:] = rest
        self._check(len(rest))
        if any(len(frame) > self.max_frame_bytes for frame in frames):
            raise UpstreamMalformed(f"the replica sent a {self.what} over {self.max_frame_bytes} bytes")
        return frames

    def _check(self, num_held: int) -> None:
        if num_held > self.max_frame_bytes:
            self._held.clear()
            raise UpstreamMalformed(f"the replica sent a {self.what} over {self.max_frame_bytes} bytes without "
                                    f"ending it")


def parse_token_ids(text: bytes) -> list[int]:
    """The ids of a token line (after its prefix): `12,345`, plain ASCII digits, each at most MAX_TOKEN_ID;
    UpstreamMalformed for anything else (a sign, `_`, spaces, an empty id, a huge number)."""
    parts = text.split(b",")
    if not all(part.isdigit() and len(part) <= _MAX_ID_DIGITS for part in parts):
        raise UpstreamMalformed(f"not a token-id line: {text[:80]!r}")
    ids = [int(part) for part in parts]
    if max(ids) > MAX_TOKEN_ID:
        raise UpstreamMalformed(f"a token id over {MAX_TOKEN_ID}: {max(ids)}")
    return ids
