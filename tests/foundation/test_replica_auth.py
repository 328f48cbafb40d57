"""A replica launched with a token serves only requests that carry it; its probes stay open."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from foundation.http.replica_auth import ReplicaTokenMiddleware


async def hello(request):
    return PlainTextResponse("hello")


def _client() -> TestClient:
    app = Starlette(routes=[Route(path, hello, methods=["GET", "POST"])
                            for path in ("/health", "/ready", "/metrics", "/v1/completions")])
    return TestClient(ReplicaTokenMiddleware(app, "s3cret"))


def test_every_path_but_the_probes_needs_the_token():
    client = _client()
    for path in ("/v1/completions", "/metrics"):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Bearer s3cret "}):
            response = client.post(path, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_replica_token"
        assert client.post(path, headers={"authorization": "Bearer s3cret"}).text == "hello"
    assert client.get("/health").text == "hello" and client.get("/ready").text == "hello"


def test_an_empty_token_is_refused():
    import pytest

    with pytest.raises(ValueError, match="must not be empty"):
        ReplicaTokenMiddleware(Starlette(), "")
