"""Cutting a replica's bytes into frames: the same frames however the bytes are split, never more held than the
bound, and token-id lines read strictly. The reply tap's line reading, bounded the same way."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.framing import MAX_TOKEN_ID, Framer, UpstreamMalformed, parse_token_ids
from gateway.reply_tap import MAX_LINE_BYTES, ReplyTap

FRAMES = [b"data: {}", b": multiserve-tokens 1\ndata: {\"a\": 1}", b"", b"x" * 300]


@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30))
def test_the_same_frames_however_the_bytes_are_split(sizes):
    data = b"".join(frame + b"\n\n" for frame in FRAMES) + b"partial"
    framer, frames, at = Framer(b"\n\n", 512), [], 0
    for size in sizes * (len(data) // sum(sizes) + 1):
        frames += framer.feed(data[at:at + size])
        at += size
        if at >= len(data):
            break
    assert frames == FRAMES and framer.held == b"partial"


def test_an_unfinished_frame_over_the_bound_is_malformed_and_not_kept():
    framer = Framer(b"\n\n", 1024, "stream event")
    for _ in range(8):  # 1024 bytes held: at the bound, still fine
        assert framer.feed(b"a" * 128) == []
    with pytest.raises(UpstreamMalformed, match="stream event over 1024 bytes"):
        framer.feed(b"a")
    assert framer.held == b""


def test_a_whole_frame_over_the_bound_in_one_read_is_malformed_too():
    with pytest.raises(UpstreamMalformed, match="over 16 bytes"):
        Framer(b"\n", 16).feed(b"ok\n" + b"b" * 17 + b"\n")


def test_a_delimiter_split_across_reads_is_found():
    framer = Framer(b"\n\n", 64)
    assert framer.feed(b"one\n") == []
    assert framer.feed(b"\ntwo\n") == [b"one"]
    assert framer.feed(b"\n") == [b"two"]


@pytest.mark.parametrize("text", [b"zz", b"-1", b"1_000", b" 1", b"1,", b"", b"1,,2", b"\xd9\xa1",
                                  str(MAX_TOKEN_ID + 1).encode(), b"0" * 11])
def test_token_lines_take_plain_ids_only(text):
    with pytest.raises(UpstreamMalformed):
        parse_token_ids(text)


def test_token_lines_read_ids():
    assert parse_token_ids(b"0,12,345") == [0, 12, 345]
    assert parse_token_ids(str(MAX_TOKEN_ID).encode()) == [MAX_TOKEN_ID]


def _stream_tap() -> ReplyTap:
    tap = ReplyTap()
    tap.start({"status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    return tap


@given(st.integers(min_value=1, max_value=50))
def test_the_tap_counts_the_same_events_however_the_stream_is_split(size):
    stream = (b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
              + b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n' * 3
              + b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}\n\ndata: [DONE]\n\n')
    tap = _stream_tap()
    for at in range(0, len(stream), size):
        tap.feed(stream[at:at + size])
    assert tap.counts() == (4, 3, "reported") and tap.num_content_events == 3


def test_the_tap_skips_a_line_over_its_bound_without_holding_it():
    tap = _stream_tap()
    tap.feed(b'data: {"choices": [{"delta": {"content": "')
    for _ in range(MAX_LINE_BYTES // 65536 + 2):
        tap.feed(b"a" * 65536)
        assert len(tap.buffer) <= MAX_LINE_BYTES
    tap.feed(b'"}}]}\n\ndata: {"choices": [{"delta": {"content": "b"}}]}\n\n')
    assert tap.num_content_events == 1  # the long line was not read; the next one was


def test_a_whole_reply_without_usage_is_charged_what_its_replicas_generated():
    tap = ReplyTap()
    tap.start({"status": 504, "headers": [(b"content-type", b"application/json")]})
    tap.feed(b'{"error": {"message": "timed out"}}')
    assert tap.counts(None, 0) == (None, None, "none")
    assert tap.counts(None, 15) == (None, 15, "generated")
