"""A client that goes away aborts its request and frees its KV blocks, streaming or not.

These drive the app with raw ASGI calls, since test transports (TestClient, httpx.ASGITransport) buffer
the whole response before the test sees it, so they cannot leave midway.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import pytest
from starlette.requests import ClientDisconnect

from tests.runtimes.server.conftest import SERVED_NAME, all_blocks_free, wait_until

LONG = {"model": SERVED_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 450, "ignore_eos": True}


ABORTED_ON_RETURN: dict[object, float] = {}


def _scope(path: str, body: bytes, spec_version: str) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
    }


async def _call(app, path: str, request: dict, leave_when: Callable[[list[dict]], bool],
                spec_version: str = "2.3", send_fails: bool = False) -> list[dict]:
    """Run one request; once `leave_when(messages sent so far)`, the client disconnects: `receive()` answers
    `http.disconnect` and, with `send_fails`, further sends raise OSError as a dead socket does.

    Records in ABORTED_ON_RETURN whether the request was aborted by the time the app returned (rather than
    later, when garbage collection finalizes a forgotten generator).
    """
    body = json.dumps(request).encode()
    sent: list[dict] = []
    gone = asyncio.Event()
    body_delivered = False

    async def receive() -> dict:
        nonlocal body_delivered
        if not body_delivered:
            body_delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set() and send_fails:
            raise OSError("connection reset by peer")
        sent.append(message)
        if leave_when(sent):
            gone.set()

    async def watch_engine() -> None:  # a non-streaming request sends nothing until done
        while not gone.is_set():
            if leave_when(sent):
                gone.set()
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch_engine())
    try:
        await asyncio.wait_for(app(_scope(path, body, spec_version), receive, send), timeout=30)
    finally:
        watcher.cancel()
        ABORTED_ON_RETURN[app] = _abort_count(app)
        await _engine_idle(app)
    return sent


async def _engine_idle(app) -> None:
    """Keep this loop open until the engine let go of the request: it delivers outputs to this loop."""
    engine = app.state.engine.engine
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.02)


def _body_chunks(sent: list[dict]) -> list[bytes]:
    return [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]


def _abort_count(app) -> float:
    labels = {"model_name": SERVED_NAME, "finish_reason": "abort"}
    return app.state.metrics.registry.get_sample_value("multiserve_request_success_total", labels) or 0.0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_disconnect_aborts_and_frees_blocks(engine, make_app, path):
    app = make_app()
    request = {**LONG, "stream": True}
    if path.endswith("chat/completions"):
        request = {**request, "messages": [{"role": "user", "content": "hi"}]}
        del request["prompt"]
    sent = asyncio.run(_call(app, path, request, lambda sent: len(_body_chunks(sent)) >= 4))
    assert sent[0]["status"] == 200, sent
    assert b"[DONE]" not in b"".join(_body_chunks(sent))
    wait_until(lambda: all_blocks_free(engine), what="the aborted request's blocks to be freed")
    assert ABORTED_ON_RETURN.pop(app) == 1 == _abort_count(app)


def test_stream_disconnect_seen_as_failed_send(engine, make_app):
    """ASGI spec 2.4 servers do not report disconnects while streaming; the failed send must still abort."""
    app = make_app()
    with pytest.raises(ClientDisconnect):  # what Starlette raises to the server, which drops the connection
        asyncio.run(_call(app, "/v1/completions", {**LONG, "stream": True},
                          lambda sent: len(_body_chunks(sent)) >= 3, spec_version="2.4", send_fails=True))
    wait_until(lambda: all_blocks_free(engine), what="the aborted request's blocks to be freed")
    assert ABORTED_ON_RETURN.pop(app) == 1 == _abort_count(app)


def test_non_stream_disconnect_aborts_and_frees_blocks(engine, make_app):
    app = make_app()
    sent = asyncio.run(_call(app, "/v1/completions", LONG,
                             lambda sent: engine.engine.has_unfinished_requests()))
    assert sent[0]["status"] == 499  # nobody is there to read it
    wait_until(lambda: all_blocks_free(engine), what="the aborted request's blocks to be freed")
    assert ABORTED_ON_RETURN.pop(app) == 1 == _abort_count(app)


@pytest.mark.parametrize("stream", [True, False])
def test_leaving_before_the_first_token_aborts_at_once(engine, make_app, monkeypatch, stream):
    """A client that leaves while its request waits for its first token (queued, or in a slow prefill) aborts it
    then: no response is started for nobody, and the engine does not run it to its first token."""
    execute = engine.engine.runner.execute
    steps: list[int] = []

    def slow(plan, block_tables, interrupt=None):
        steps.append(len(plan.scheduled))
        time.sleep(0.2)
        return execute(plan, block_tables, interrupt)

    monkeypatch.setattr(engine.engine.runner, "execute", slow)
    app = make_app()
    sent = asyncio.run(_call(app, "/v1/completions", {**LONG, "stream": stream},
                             lambda sent: engine.engine.has_unfinished_requests()))
    assert sent[0]["status"] == 499, sent  # nothing was streamed: the disconnect came before the first token
    wait_until(lambda: all_blocks_free(engine), what="the aborted request's blocks to be freed")
    assert len(steps) <= 1  # aborted within one engine step


def test_a_client_that_leaves_mid_body_gets_499_and_no_error_logged(engine, make_app):
    """The body's first half, then `http.disconnect`: reading it raises Starlette's ClientDisconnect, which is no
    error of the server's (no 500, no traceback; the engine never sees the request)."""
    import structlog

    app = make_app()
    body = json.dumps(LONG).encode()
    parts = [{"type": "http.request", "body": body[: len(body) // 2], "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    with structlog.testing.capture_logs() as logs:
        asyncio.run(app(_scope("/v1/completions", body, "2.3"), receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert not [e for e in logs if e["log_level"] == "error"], logs
    assert [e["event"] for e in logs] == ["client disconnected while sending its request"]
    assert all_blocks_free(engine)
