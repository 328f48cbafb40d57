"""The keep-alive client's bounds on what a replica may send, against a real server on 127.0.0.1: bodies read
whole of any size up to `max_body_bytes`, heads held to `max_header_fields` and `max_head_bytes` as they
arrive, and repeated headers handled in linear time."""

from __future__ import annotations

import asyncio

import pytest

from gateway.httpclient import KeepAliveClient
from gateway.upstream import Timeouts, UpstreamError
from tests.gateway.test_httpclient import TIMEOUTS, Script, Seen, run, serve, wait_for_client_to_leave, whole


def sized(body: bytes, seen: Seen | None = None) -> Script:
    """A script that answers `body` with its content-length; given `seen`, it then counts the client leaving."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        if seen is None:
            return True
        await writer.drain()
        return await wait_for_client_to_leave(seen)(reader, writer)

    return script


def test_a_whole_body_past_the_high_water_mark_is_read_to_its_end_and_the_connection_kept():
    body = bytes(range(256)) * (16 << 10)  # 4 MiB: past the 1 MiB at which a stream stops reading its socket

    async def scenario() -> None:
        async with serve({"/big": sized(body), "/w": whole}) as (url, seen):
            client = KeepAliveClient()
            quick = Timeouts(connect_s=2.0, read_s=0.5)
            reply = await client.post(url + "/big", b"{}", {}, quick)
            await asyncio.sleep(0.1)  # long enough for the buffer to fill and reading to pause
            assert await reply.aread() == body
            assert await (await client.post(url + "/w", b"{}", {}, quick)).aread() == b'{"ok":true}'
            await client.aclose()
        assert seen.num_connections == 1

    run(scenario)


def test_a_whole_body_past_max_body_bytes_is_refused_and_its_connection_closed():
    async def scenario() -> None:
        seen = Seen()
        async with serve({"/big": sized(b"b" * (3 << 20), seen)}, seen) as (url, _):
            client = KeepAliveClient(max_body_bytes=2 << 20)
            reply = await client.post(url + "/big", b"{}", {}, TIMEOUTS)
            with pytest.raises(UpstreamError, match=r"max_body_bytes=2097152"):
                await asyncio.wait_for(reply.aread(), 1.0)
            await asyncio.sleep(0.05)
            await client.aclose()
        assert seen.num_client_closed == 1

    run(scenario)


@pytest.mark.parametrize("wait_s", [0.0, 0.1])
def test_max_body_bytes_holds_for_bytes_buffered_before_aread_but_not_for_a_stream(wait_s):
    body = b"b" * 300_000

    async def scenario() -> None:
        async with serve({"/big": sized(body)}) as (url, _):
            client = KeepAliveClient(max_body_bytes=100_000)
            reply = await client.post(url + "/big", b"{}", {}, TIMEOUTS)
            await asyncio.sleep(wait_s)
            with pytest.raises(UpstreamError, match=r"max_body_bytes=100000"):
                await asyncio.wait_for(reply.aread(), 1.0)
            stream = await client.post(url + "/big", b"{}", {}, TIMEOUTS)
            assert b"".join([chunk async for chunk in stream.aiter_raw()]) == body
            await client.aclose()

    run(scenario)


@pytest.mark.timeout(10)  # a head handled in quadratic time would freeze the loop, out of wait_for's reach
def test_many_repeated_headers_are_refused_quickly_naming_the_limit():
    head = b"HTTP/1.1 200 OK\r\n" + b"x-repeat: a\r\n" * 100_000 + b"content-length: 2\r\n\r\nok"

    async def scenario() -> None:
        seen = Seen()

        async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
            writer.write(head)
            return await wait_for_client_to_leave(seen)(reader, writer)

        async with serve({"/flood": flood}, seen) as (url, _):
            client = KeepAliveClient()
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(UpstreamError, match=r"max_header_fields=100\b"):
                await asyncio.wait_for(client.post(url + "/flood", b"{}", {}, TIMEOUTS), 1.0)
            assert loop.time() - start < 0.5
            await asyncio.sleep(0.05)
            await client.aclose()
        assert seen.num_client_closed == 1

    run(scenario)


@pytest.mark.timeout(10)
def test_repeated_headers_are_joined_in_linear_time_when_the_limits_allow_them():
    num_repeats = 120_000  # about 2 s joined by repeated concatenation, about 0.2 s joined once
    head = b"HTTP/1.1 200 OK\r\n" + b"x-r: a\r\n" * num_repeats + b"content-length: 2\r\n\r\nok"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(head)
        return True

    async def scenario() -> None:
        async with serve({"/many": answer}) as (url, _):
            client = KeepAliveClient(max_header_fields=num_repeats + 1, max_head_bytes=len(head))
            loop = asyncio.get_running_loop()
            start = loop.time()
            reply = await asyncio.wait_for(client.post(url + "/many", b"{}", {}, TIMEOUTS), 2.0)
            assert loop.time() - start < 1.0
            assert reply.headers["x-r"] == ", ".join(["a"] * num_repeats)
            assert await reply.aread() == b"ok"
            await client.aclose()

    run(scenario)


@pytest.mark.parametrize(("start", "piece"), [
    (b"HTTP/1.1 200 OK\r\nx-endless: ", b"a" * 1024),  # one endless header line
    (b"", b"HTTP/1.1 100 Continue\r\n\r\n" * 40),  # endless interim replies
], ids=["header-line", "interim-replies"])
def test_a_head_trickled_past_max_head_bytes_is_cut_off_as_it_arrives(start, piece):
    async def scenario() -> None:
        sent_all = asyncio.Event()

        async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
            writer.write(start)
            for _ in range(1024):  # up to about 1 MiB, one piece a loop turn
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0)
            sent_all.set()
            await reader.read(1)  # then silence, until the client leaves
            return False

        async with serve({"/t": trickle}) as (url, _):
            client = KeepAliveClient()
            with pytest.raises(UpstreamError, match=r"max_head_bytes=65536"):
                await asyncio.wait_for(client.post(url + "/t", b"{}", {}, Timeouts(connect_s=2.0, read_s=1.0)), 1.5)
            assert not sent_all.is_set()  # cut off at the limit, not after buffering all that was sent
            await client.aclose()

    run(scenario)


@pytest.mark.parametrize(("room", "fits"), [(0, True), (-1, False)])
def test_max_head_bytes_counts_the_head_exactly_when_head_and_body_come_in_one_read(room, fits):
    body = b"b" * 200_000
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)

    async def scenario() -> None:
        async with serve({"/one": sized(body)}) as (url, _):
            client = KeepAliveClient(max_head_bytes=len(answer) + room)
            if fits:
                assert await (await client.post(url + "/one", b"{}", {}, TIMEOUTS)).aread() == body
            else:
                with pytest.raises(UpstreamError, match=f"max_head_bytes={len(answer) - 1}"):
                    await client.post(url + "/one", b"{}", {}, TIMEOUTS)
            await client.aclose()

    run(scenario)


@pytest.mark.parametrize("limit", ["max_header_fields", "max_head_bytes", "max_body_bytes"])
def test_a_limit_below_one_is_refused(limit):
    with pytest.raises(ValueError, match=f"{limit} must be at least 1"):
        KeepAliveClient(**{limit: 0})
