"""The gateway's keep-alive HTTP/1.1 client against a real server on 127.0.0.1 whose replies each test scripts
byte by byte: whole and streamed replies, connection reuse, aborts the server can see, timeouts, stale idle
connections, requests never sent twice, broken or unframed replies, bytes after a reply, and credentials in
the URL. Limits on what a replica may send are in test_httpclient_limits.py."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from gateway.httpclient import KeepAliveClient
from gateway.upstream import Timeouts, UpstreamError, UpstreamTimeout

TIMEOUTS = Timeouts(connect_s=2.0, read_s=5.0)
QUICK = Timeouts(connect_s=1.0, read_s=1.0)  # for a step that must not be what waits
JSON_REPLY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}"

# a scripted reply: writes to the connection, returns whether to keep it open for another request
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class Seen:
    """What the server saw: connections accepted, requests (path, headers, body) and their heads as sent,
    clients that left early."""

    num_connections: int = 0
    requests: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    heads: list[str] = field(default_factory=list)
    num_client_closed: int = 0


@asynccontextmanager
async def serve(scripts: dict[str, Script], seen: Seen | None = None) -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen() if seen is None else seen

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.num_connections += 1
        try:
            keep = True
            while keep:
                text = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                seen.heads.append(text)
                head = text.split("\r\n")
                path = head[0].split(" ")[1]
                headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in head[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                seen.requests.append((path, headers, body))
                keep = await scripts[path](reader, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection (with unread bytes, a reset)
        finally:
            writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


async def whole(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    writer.write(JSON_REPLY)
    return True


def wait_for_client_to_leave(seen: Seen) -> Script:
    """A script that answers nothing more and counts the client closing the connection."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            left = await reader.read(1) == b""
        except ConnectionError:  # it closed with bytes of ours unread
            left = True
        seen.num_client_closed += left
        return False

    return script


def test_a_whole_reply_and_the_connection_is_kept_for_the_next_request():
    async def scenario() -> None:
        async with serve({"/v1/chat": whole}) as (url, seen):
            client = KeepAliveClient()
            for _ in range(3):
                reply = await client.post(url + "/v1/chat", b'{"model":"m"}', {"x-request-id": "r1"}, TIMEOUTS)
                assert (reply.status_code, reply.headers["content-type"]) == (200, "application/json")
                assert await reply.aread() == b'{"ok":true}'
                await reply.aclose()
            await client.aclose()
        assert seen.num_connections == 1
        path, headers, body = seen.requests[0]
        assert (path, body, headers["x-request-id"], headers["content-length"]) == ("/v1/chat", b'{"model":"m"}',
                                                                                    "r1", "13")
        assert headers["host"] == url.removeprefix("http://")

    run(scenario)


def test_a_chunked_stream_arrives_piece_by_piece_before_the_server_is_done():
    async def scenario() -> None:
        go_on = asyncio.Event()

        async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"7\r\ndata: 1\r\n")
            await writer.drain()
            await go_on.wait()  # the client has the first piece while the server still holds the rest
            writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
            return True

        async with serve({"/s": stream, "/w": whole}) as (url, seen):
            client = KeepAliveClient()
            reply = await client.post(url + "/s", b"{}", {}, TIMEOUTS)
            chunks = reply.aiter_raw()
            assert await anext(chunks) == b"data: 1"
            go_on.set()
            assert [chunk async for chunk in chunks] == [b"data: 2"]
            await reply.aclose()
            assert await (await client.post(url + "/w", b"{}", {}, TIMEOUTS)).aread() == b'{"ok":true}'
            await client.aclose()
        assert seen.num_connections == 1  # the finished stream left its connection reusable

    run(scenario)


def test_closing_a_reply_before_its_end_closes_the_connection_so_the_server_sees_the_client_leave():
    async def scenario() -> None:
        seen = Seen()

        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await writer.drain()
            return await wait_for_client_to_leave(seen)(reader, writer)

        async with serve({"/hold": hold, "/w": whole}, seen) as (url, _):
            client = KeepAliveClient()
            reply = await client.post(url + "/hold", b"{}", {}, TIMEOUTS)
            assert await anext(reply.aiter_raw()) == b"abc"
            await reply.aclose()
            await client.post(url + "/w", b"{}", {}, TIMEOUTS)  # on a new connection
            await asyncio.sleep(0.05)
            await client.aclose()
        assert (seen.num_client_closed, seen.num_connections) == (1, 2)

    run(scenario)


def test_a_silent_server_is_a_timeout_and_the_request_is_abandoned():
    async def scenario() -> None:
        seen = Seen()
        async with serve({"/silent": wait_for_client_to_leave(seen)}, seen) as (url, _):
            client = KeepAliveClient()
            with pytest.raises(UpstreamTimeout, match=r"within 0\.05 s"):
                await client.post(url + "/silent", b"{}", {}, Timeouts(connect_s=2.0, read_s=0.05))
            await asyncio.sleep(0.05)
            await client.aclose()
        assert seen.num_client_closed == 1

    run(scenario)


def test_a_cancelled_request_closes_its_connection():
    async def scenario() -> None:
        seen = Seen()
        async with serve({"/silent": wait_for_client_to_leave(seen)}, seen) as (url, _):
            client = KeepAliveClient()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.post(url + "/silent", b"{}", {}, TIMEOUTS), 0.05)
            await asyncio.sleep(0.05)
        assert seen.num_client_closed == 1

    run(scenario)


def test_a_refused_connection_is_an_upstream_error():
    async def scenario() -> None:
        async with serve({}) as (url, _):
            pass  # the port is free again
        with pytest.raises(UpstreamError, match=r"connecting to 127\.0\.0\.1:\d+ failed") as info:
            await KeepAliveClient().post(url + "/v1/chat", b"{}", {}, TIMEOUTS)
        assert not isinstance(info.value, UpstreamTimeout)
        assert not info.value.maybe_sent  # no connection, so the request cannot have reached the replica

    run(scenario)


def test_an_idle_connection_the_server_dropped_is_replaced_without_failing_the_request():
    async def close_after(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(JSON_REPLY)
        return False  # says keep-alive, then drops it as an idle timeout would

    async def scenario() -> None:
        async with serve({"/w": close_after}) as (url, seen):
            client = KeepAliveClient()
            for _ in range(2):
                reply = await client.post(url + "/w", b"{}", {}, TIMEOUTS)
                assert await reply.aread() == b'{"ok":true}'
            await client.aclose()
        assert seen.num_connections == 2

    run(scenario)


def test_a_connection_idle_past_max_idle_s_is_not_reused():
    async def scenario() -> None:
        now = [0.0]
        async with serve({"/w": whole}) as (url, seen):
            client = KeepAliveClient(max_idle_s=4.0, clock=lambda: now[0])
            await (await client.post(url + "/w", b"{}", {}, TIMEOUTS)).aread()
            now[0] += 3.9
            await (await client.post(url + "/w", b"{}", {}, TIMEOUTS)).aread()
            assert seen.num_connections == 1
            now[0] += 4.1
            await (await client.post(url + "/w", b"{}", {}, TIMEOUTS)).aread()
            await client.aclose()
        assert seen.num_connections == 2

    run(scenario)


@pytest.mark.parametrize(("sent", "says"), [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 20\r\n\r\nonly ten b", "closed the connection mid-reply"),
    (b"SMTP ready\r\n\r\n", "not valid HTTP"),
])
def test_a_broken_reply_is_an_upstream_error(sent, says):
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(sent)
        return False

    async def scenario() -> None:
        async with serve({"/b": broken}) as (url, _):
            client = KeepAliveClient()
            with pytest.raises(UpstreamError, match=says):
                reply = await client.post(url + "/b", b"{}", {}, TIMEOUTS)
                await reply.aread()
            await client.aclose()

    run(scenario)


@pytest.mark.parametrize("framing", [b"", b"transfer-encoding: gzip\r\n", b"transfer-encoding: chunked, gzip\r\n"])
def test_a_reply_that_would_end_only_when_the_connection_closes_is_refused(framing):
    async def old_style(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n" + framing + b"\r\nall of it")
        return False  # a cut reply would look just the same

    async def scenario() -> None:
        async with serve({"/o": old_style}) as (url, _):
            client = KeepAliveClient()
            with pytest.raises(UpstreamError, match="neither content-length nor chunked"):
                await (await client.post(url + "/o", b"{}", {}, TIMEOUTS)).aread()
            await client.aclose()

    run(scenario)


@pytest.mark.parametrize(("sent", "status", "body"), [
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + JSON_REPLY, 200,
     b'{"ok":true}'),
    (b"HTTP/1.1 204 No Content\r\n\r\n", 204, b""),
])
def test_interim_replies_and_a_reply_without_a_body_are_read_and_keep_the_connection(sent, status, body):
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(sent)
        return True

    async def scenario() -> None:
        async with serve({"/a": answer}) as (url, seen):
            client = KeepAliveClient()
            for _ in range(2):
                reply = await client.post(url + "/a", b"{}", {}, TIMEOUTS)
                assert (reply.status_code, await reply.aread()) == (status, body)
                assert "link" not in reply.headers  # an interim reply's headers are not the reply's
            await client.aclose()
        assert seen.num_connections == 1

    run(scenario)


def test_a_large_streamed_body_arrives_whole_through_the_buffer_limits():
    body = bytes(range(256)) * (16 << 10)  # 4 MiB: past the high-water mark, so reading pauses and resumes

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        return True

    async def scenario() -> None:
        async with serve({"/big": big}) as (url, _):
            client = KeepAliveClient()
            reply = await client.post(url + "/big", b"{}", {}, TIMEOUTS)
            await asyncio.sleep(0.2)  # let it fill the buffer
            received = [chunk async for chunk in reply.aiter_raw()]
            assert b"".join(received) == body
            await client.aclose()

    run(scenario)


def test_a_header_value_with_a_line_break_is_refused_before_anything_is_sent():
    async def scenario() -> None:
        with pytest.raises(ValueError, match="line breaks"):
            await KeepAliveClient().post("http://127.0.0.1:9/v1", b"{}", {"x-priority": "1\r\nx-evil: 1"}, TIMEOUTS)

    run(scenario)


def test_a_request_the_server_read_before_dropping_the_connection_is_not_sent_again():
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        return False  # reads the request, answers nothing, closes the kept-alive connection

    async def scenario() -> None:
        async with serve({"/w": whole, "/drop": drop}) as (url, seen):
            client = KeepAliveClient()
            assert await (await client.post(url + "/w", b"{}", {}, TIMEOUTS)).aread() == b'{"ok":true}'
            with pytest.raises(UpstreamError) as info:
                await asyncio.wait_for(client.post(url + "/drop", b"{}", {}, TIMEOUTS), 1.0)
            await asyncio.sleep(0.05)  # room for a resend to arrive, were there one
            await client.aclose()
        assert [path for path, _, _ in seen.requests] == ["/w", "/drop"]
        assert "closed the connection before any byte of its reply" in str(info.value)
        assert info.value.maybe_sent

    run(scenario)


STALE_REPLY = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale"


@pytest.mark.parametrize("after", [STALE_REPLY, b"junk"])
def test_bytes_after_a_reply_in_the_same_read_close_its_connection(after):
    async def answer_and_more(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(JSON_REPLY + after)
        return True

    async def scenario() -> None:
        async with serve({"/more": answer_and_more, "/w": whole}) as (url, seen):
            client = KeepAliveClient()
            assert await (await client.post(url + "/more", b"{}", {}, TIMEOUTS)).aread() == b'{"ok":true}'
            reply = await asyncio.wait_for(client.post(url + "/w", b"{}", {}, TIMEOUTS), 1.0)
            assert await reply.aread() == b'{"ok":true}'
            await client.aclose()
        assert seen.num_connections == 2

    run(scenario)


@pytest.mark.timeout(5)  # the events below are awaited without wait_for, which would add a loop turn
@pytest.mark.parametrize("meanwhile", ["closes it", "sends a stale reply"])
def test_an_idle_connection_that_changed_just_before_reuse_is_not_written_to(meanwhile):
    async def scenario() -> None:
        has_reply, changed = asyncio.Event(), asyncio.Event()

        async def answer_then_change(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
            writer.write(JSON_REPLY)
            await has_reply.wait()
            if meanwhile == "closes it":
                writer.write_eof()  # with nothing buffered, the FIN leaves now, not a loop turn later
            else:
                writer.write(STALE_REPLY)  # a reply to no request, as a desynchronised replica would send
            changed.set()
            return meanwhile != "closes it"

        async with serve({"/first": answer_then_change, "/w": whole}) as (url, seen):
            client = KeepAliveClient()
            await (await client.post(url + "/first", b"{}", {}, TIMEOUTS)).aread()
            has_reply.set()
            await changed.wait()
            # at once, in this task (wait_for would start another): the loop has not yet read what came, only a
            # look at the socket can tell
            reply = await client.post(url + "/w", b"{}", {}, QUICK)
            assert await reply.aread() == b'{"ok":true}'
            await client.aclose()
        assert seen.num_connections == 2

    run(scenario)


def test_a_malformed_reply_closes_its_connection_even_when_the_server_keeps_it():
    async def scenario() -> None:
        seen = Seen()

        async def bad_chunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n")
            return await wait_for_client_to_leave(seen)(reader, writer)

        async with serve({"/bad": bad_chunk}, seen) as (url, _):
            client = KeepAliveClient()
            with pytest.raises(UpstreamError, match="not valid HTTP"):
                await (await client.post(url + "/bad", b"{}", {}, TIMEOUTS)).aread()
            await asyncio.sleep(0.05)
            await client.aclose()
        assert seen.num_client_closed == 1

    run(scenario)


@pytest.mark.parametrize(("userinfo", "user_pass"), [
    ("us%40er:p%3Ass%20w@", b"us@er:p:ss w"),
    ("bot@", b"bot:"),
])
def test_credentials_in_the_url_go_in_an_authorization_header_and_not_in_host(userinfo, user_pass):
    async def scenario() -> None:
        async with serve({"/a": whole}) as (url, seen):
            client = KeepAliveClient()
            address = url.removeprefix("http://")
            await (await client.post(f"http://{userinfo}{address}/a", b"{}", {}, TIMEOUTS)).aread()
            await client.aclose()
        _, headers, _ = seen.requests[0]
        assert headers["host"] == address
        assert headers["authorization"] == "Basic " + base64.b64encode(user_pass).decode()

    run(scenario)


def test_the_callers_own_authorization_header_is_the_one_sent():
    async def scenario() -> None:
        async with serve({"/a": whole}) as (url, seen):
            client = KeepAliveClient()
            credentialed = url.replace("http://", "http://user:secret@")
            await (await client.post(credentialed + "/a", b"{}", {"Authorization": "Bearer mine"}, TIMEOUTS)).aread()
            await client.aclose()
        assert seen.heads[0].lower().count("authorization:") == 1
        assert seen.requests[0][1]["authorization"] == "Bearer mine"

    run(scenario)
