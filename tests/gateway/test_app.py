"""The gateway app around the forwarder: model list, health and readiness, metrics, request ids, body limits,
API keys and the admin API (registry edits persisted to the YAML and applied to the pool)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from gateway.auth_keys import ApiKey
from model_pool.replica import ReplicaState
from tests.gateway.fakes import ADMIN_TOKEN, REGISTRY, FakeGateway, chat, error_of

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
KEYS = {"k1": ApiKey(), "k2": ApiKey(models=frozenset({"beta"}))}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def make_unhealthy(gw: FakeGateway, replica_id: str) -> None:
    gw.replicas.set(replica_id, "down")
    for _ in range(gw.pool.settings.unhealthy_after):
        await gw.pool.tick()
    assert gw.pool.find_replica(replica_id).state == ReplicaState.UNHEALTHY


# ------------------------------------------------------------------------------------ models, health, metrics


def test_models_lists_every_enabled_name_and_alias(with_gateway):
    text = REGISTRY + "\n  - name: retired\n    type: chat\n    source: {path: /m/r.gguf}\n    enabled: false\n"

    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.get("/v1/models")
        assert response.status_code == 200
        body = response.json()
        assert body["object"] == "list"
        assert [(m["id"], m["root"], m["type"]) for m in body["data"]] == [
            ("alpha", "alpha", "chat"), ("a", "alpha", "chat"), ("beta", "beta", "chat"),
            ("emb", "emb", "embedding"), ("comp", "comp", "completion")]
        assert {m["object"] for m in body["data"]} == {"model"}

    with_gateway(scenario, registry_text=text)


def test_health_is_200_while_the_process_lives(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.get("/health")
        assert response.status_code == 200 and response.json() == {"status": "ok"}

    with_gateway(scenario, ready=False)  # even with no replica ready


def test_ready_is_200_when_every_enabled_model_has_a_ready_replica(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.get("/ready")
        assert response.status_code == 200
        body = response.json()
        assert body["status"] == "ready"
        assert body["models"]["alpha"] == {"ready_replicas": 2, "replicas": 2, "states": ["ready", "ready"]}
        assert sorted(body["models"]) == ["alpha", "beta", "comp", "emb"]
        await make_unhealthy(gw, "alpha/0")
        assert (await gw.client.get("/ready")).status_code == 200  # one ready replica is enough

    with_gateway(scenario)


def test_ready_is_503_with_detail_when_a_model_has_no_ready_replica(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        await make_unhealthy(gw, "beta/0")
        response = await gw.client.get("/ready")
        assert response.status_code == 503
        body = response.json()
        assert body["status"] == "not_ready"
        assert body["models"]["beta"] == {"ready_replicas": 0, "replicas": 1, "states": ["unhealthy"]}
        assert body["models"]["alpha"]["ready_replicas"] == 2

    with_gateway(scenario)


def test_ready_is_503_before_the_pool_has_started_anything(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.get("/ready")
        assert response.status_code == 503
        assert response.json()["models"]["comp"] == {"ready_replicas": 0, "replicas": 0, "states": []}

    with_gateway(scenario, ready=False)


def test_a_model_scaled_to_zero_does_not_hold_readiness_back(with_gateway):
    text = REGISTRY + "\n  - name: spare\n    type: chat\n    source: {path: /m/s.gguf}\n    replicas: 0\n"

    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.get("/ready")
        assert response.status_code == 200 and "spare" not in response.json()["models"]

    with_gateway(scenario, registry_text=text)


def test_health_models_shows_each_replica(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        await make_unhealthy(gw, "alpha/1")
        response = await gw.client.get("/health/models")
        assert response.status_code == 200
        models = response.json()["models"]
        assert sorted(models) == ["alpha", "beta", "comp", "emb"]
        first, second = models["alpha"]["replicas"]
        assert (first["id"], first["state"], first["breaker"], first["in_flight"]) == ("alpha/0", "ready", "closed", 0)
        assert first["consecutive_failures"] == 0 and first["last_probe_ok"] is True
        assert first["last_probe_at"] is not None
        assert (second["state"], second["consecutive_failures"], second["last_probe_ok"]) == ("unhealthy", 2, False)
        assert models["alpha"]["ready_replicas"] == 1

    with_gateway(scenario)


def test_metrics_count_requests_by_model_and_status_and_show_replica_states(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        await gw.client.post("/v1/chat/completions", json=chat("a"))
        await gw.client.post("/v1/chat/completions", json=chat("alpha", stream=True))
        gw.replicas.set("comp/0", "down")
        await gw.client.post("/v1/completions", json={"model": "comp", "prompt": "x"})
        await make_unhealthy(gw, "beta/0")
        response = await gw.client.get("/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        text = response.text
        assert re.search(r'^multiserve_gateway_requests_total\{[^}]*model="alpha"[^}]*status="200"[^}]*\} 2\.0$',
                         text, re.MULTILINE), text
        assert gw.metric("multiserve_gateway_requests_total", model="comp", endpoint="completions",
                         status="503") == 1
        assert gw.metric("multiserve_gateway_replica_state", replica="alpha/0", state="ready") == 1
        assert gw.metric("multiserve_gateway_replica_state", replica="beta/0", state="ready") == 0
        assert gw.metric("multiserve_gateway_replica_state", replica="beta/0", state="unhealthy") == 1
        assert gw.metric("multiserve_gateway_breaker_state", replica="alpha/0", state="closed") == 1
        assert gw.metric("multiserve_gateway_replica_in_flight", replica="alpha/0") == 0
        assert gw.metric("multiserve_gateway_time_to_first_byte_seconds_count", model="alpha") == 1
        assert gw.metric("multiserve_gateway_request_duration_seconds_count", model="alpha") == 2

    with_gateway(scenario)


# ------------------------------------------------------------------------------------ middleware


def test_a_given_request_id_is_echoed_and_passed_to_the_replica(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "req-42.a:b"})
        assert response.headers["x-request-id"] == "req-42.a:b"
        assert gw.replicas.received[-1].headers["x-request-id"] == "req-42.a:b"
        missing = await gw.client.post("/v1/chat/completions", json=chat("nope"), headers={"x-request-id": "r-1"})
        assert missing.status_code == 404 and missing.headers["x-request-id"] == "r-1"  # on errors too

    with_gateway(scenario)


@pytest.mark.parametrize("given", [None, "has spaces", "x" * 129])
def test_a_request_id_is_generated_when_missing_or_unsafe(with_gateway, given):
    async def scenario(gw: FakeGateway) -> None:
        headers = {} if given is None else {"x-request-id": given}
        first = await gw.client.post("/v1/chat/completions", json=chat(), headers=headers)
        second = await gw.client.get("/health", headers=headers)
        generated = first.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", generated)
        assert gw.replicas.received[-1].headers["x-request-id"] == generated
        assert second.headers["x-request-id"] != generated  # one per request

    with_gateway(scenario)


def test_a_body_over_the_limit_is_413_by_content_length(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.post("/v1/chat/completions", json=chat(padding="x" * 3000))
        assert response.status_code == 413
        error = error_of(response)
        assert error["code"] == "body_too_large" and "2048 bytes" in error["message"]
        assert gw.replicas.received == []

    with_gateway(scenario)


def test_a_chunked_body_over_the_limit_is_413(with_gateway):
    async def chunks(count: int) -> AsyncIterator[bytes]:
        yield b'{"model": "alpha", "messages": [], "padding": "'
        for _ in range(count):
            yield b"x" * 500
        yield b'"}'

    async def scenario(gw: FakeGateway) -> None:
        small = await gw.client.post("/v1/chat/completions", content=chunks(2))
        assert small.status_code == 200, small.text  # chunked and under the limit: served
        assert small.request.headers["transfer-encoding"] == "chunked"
        response = await gw.client.post("/v1/chat/completions", content=chunks(6))
        assert "content-length" not in response.request.headers  # only counting can catch it
        assert response.status_code == 413
        assert error_of(response)["code"] == "body_too_large"
        assert len(gw.replicas.received) == 1

    with_gateway(scenario)


def test_api_keys_guard_the_openai_endpoints(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        for headers in ({}, bearer("wrong"), {"authorization": "k1"}):
            response = await gw.client.post("/v1/chat/completions", json=chat(), headers=headers)
            assert response.status_code == 401
            assert error_of(response)["code"] == "invalid_api_key"
        assert (await gw.client.get("/v1/models")).status_code == 401
        assert (await gw.client.post("/v1/chat/completions", json=chat(), headers=bearer("k1"))).status_code == 200
        assert (await gw.client.get("/health")).status_code == 200  # liveness and readiness need no key
        assert (await gw.client.get("/ready")).status_code == 200
        for path in ("/metrics", "/health/models"):  # what operators see needs a key or the admin token
            assert (await gw.client.get(path)).status_code == 401
            assert (await gw.client.get(path, headers=bearer("wrong"))).status_code == 401
            assert (await gw.client.get(path, headers=bearer("k2"))).status_code == 200
            assert (await gw.client.get(path, headers=bearer(ADMIN_TOKEN))).status_code == 200
        assert gw.replicas.count("alpha/0") + gw.replicas.count("alpha/1") == 1

    with_gateway(scenario, api_keys=KEYS)


def test_url_credentials_never_show_in_health_or_metrics(with_gateway):
    registry = REGISTRY + """
  - name: remote
    type: chat
    launcher: url
    urls: [http://svc-user:s3cret-pass@fake-remote-0:80]
    replicas: 1
"""

    async def scenario(gw: FakeGateway) -> None:
        health = (await gw.client.get("/health/models")).text
        metrics = (await gw.client.get("/metrics")).text
        assert "fake-remote-0" in health and "s3cret" not in health and "svc-user" not in health
        assert "s3cret" not in metrics
        assert gw.pool.group("remote").replicas[0].display_url == "http://***@fake-remote-0:80"

    with_gateway(scenario, registry_text=registry)


def test_a_key_limited_to_some_models_sees_only_those(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        for name in ("alpha", "a"):
            denied = await gw.client.post("/v1/chat/completions", json=chat(name), headers=bearer("k2"))
            assert denied.status_code == 404  # not 403: other keys' models are not revealed
            error = error_of(denied)
            assert error["code"] == "model_not_found" and error["message"].endswith("available: beta")
        allowed = await gw.client.post("/v1/chat/completions", json=chat("beta"), headers=bearer("k2"))
        assert allowed.status_code == 200 and allowed.json()["replica"] == "fake-beta-0"
        listed = await gw.client.get("/v1/models", headers=bearer("k2"))
        assert [m["id"] for m in listed.json()["data"]] == ["beta"]
        everything = await gw.client.get("/v1/models", headers=bearer("k1"))
        assert len(everything.json()["data"]) == 5
        assert gw.replicas.count("alpha/0") + gw.replicas.count("alpha/1") == 0

    with_gateway(scenario, api_keys=KEYS)


# ------------------------------------------------------------------------------------ admin


@pytest.mark.parametrize("headers", [{}, bearer("wrong"), {"authorization": ADMIN_TOKEN}, bearer("k1")])
def test_admin_endpoints_need_the_admin_token(with_gateway, headers):
    async def scenario(gw: FakeGateway) -> None:
        calls = [("GET", "/admin/models"), ("GET", "/admin/registry/status"), ("DELETE", "/admin/models/comp"),
                 ("POST", "/admin/replicas/alpha/0/drain"), ("POST", "/admin/models/alpha/scale")]
        for method, path in calls:
            response = await gw.client.request(method, path, headers=headers, json={"replicas": 5})
            assert response.status_code == 401, (method, path)
            assert error_of(response)["code"] == "invalid_admin_token"
        assert gw.store.version == 1 and gw.pool.find_replica("alpha/0").state == ReplicaState.READY

    with_gateway(scenario, api_keys=KEYS)


def test_the_admin_api_is_closed_when_no_token_is_configured(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.get("/admin/models", headers={"authorization": "Bearer "})
        assert response.status_code == 401 and "disabled" in error_of(response)["message"]

    with_gateway(scenario, admin_token=None)


def test_admin_lists_and_shows_models(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        listed = await gw.client.get("/admin/models", headers=ADMIN)
        assert listed.status_code == 200
        assert [m["name"] for m in listed.json()["models"]] == ["alpha", "beta", "emb", "comp"]
        assert listed.json()["version"] == 1
        one = await gw.client.get("/admin/models/alpha", headers=ADMIN)
        assert one.json()["fallbacks"] == ["beta"] and one.json()["replicas"] == 2
        assert (await gw.client.get("/admin/models/nope", headers=ADMIN)).status_code == 404

    with_gateway(scenario)


def test_admin_put_adds_a_model_to_the_file_and_the_pool(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        body = {"type": "chat", "aliases": ["d"], "source": {"path": "/models/delta.gguf"}, "replicas": 2}
        response = await gw.client.put("/admin/models/delta", json=body, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert response.json()["diff"]["added"] == ["delta"] and response.json()["version"] == 2
        text = gw.path.read_text()
        assert "# Gateway test registry: keep this comment." in text and "# alpha's fallback" in text
        assert "name: delta" in text and "/models/delta.gguf" in text
        assert [h.request.index for h in gw.launcher.running("delta")] == [0, 1]
        await gw.pool.tick()
        served = await gw.client.post("/v1/chat/completions", json=chat("d"))
        assert served.json()["replica"].startswith("fake-delta-")
        assert "d" in [m["id"] for m in (await gw.client.get("/v1/models")).json()["data"]]

    with_gateway(scenario)


def test_admin_put_replacing_a_model_restarts_its_group(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        old = list(gw.pool.group("beta").replicas)
        body = {"type": "chat", "source": {"path": "/models/beta.gguf"}, "engine": {"block_size": 32}}
        response = await gw.client.put("/admin/models/beta", json=body, headers=ADMIN)
        assert response.status_code == 200 and response.json()["diff"]["changed"] == ["beta"]
        assert old[0].state == ReplicaState.STOPPED and gw.pool.group("beta").replicas[0] is not old[0]
        assert gw.launcher.latest("beta/0").request.engine.block_size == 32
        assert "block_size: 32" in gw.path.read_text()

    with_gateway(scenario)


@pytest.mark.parametrize(("name", "body", "says"), [
    ("delta", {"type": "chat", "source": {"path": "/m"}, "replicas": -1}, "models[4].replicas"),
    ("delta", {"type": "chat", "source": {"path": "/m"}, "fallbacks": ["nope"]}, "unknown model 'nope'"),
    ("delta", {"type": "chat", "source": {"path": "/m"}, "replicsa": 2}, "did you mean 'replicas'"),
    ("beta", {"type": "embedding", "source": {"path": "/m"}}, "same type"),  # alpha falls back to beta
])
def test_an_invalid_admin_put_is_400_and_changes_nothing(with_gateway, name, body, says):
    async def scenario(gw: FakeGateway) -> None:
        before = gw.path.read_bytes()
        launched = len(gw.launcher.handles)
        response = await gw.client.put(f"/admin/models/{name}", json=body, headers=ADMIN)
        assert response.status_code == 400
        error = error_of(response)
        assert error["code"] == "registry_rejected" and says in error["message"]
        assert gw.path.read_bytes() == before
        assert gw.store.version == 1 and len(gw.launcher.handles) == launched
        assert gw.pool.group("delta") is None and gw.pool.group("beta").spec.type == "chat"
        status = (await gw.client.get("/admin/registry/status", headers=ADMIN)).json()
        assert status["version"] == 1 and status["last_rejected"]["source"] == "admin"
        assert any(says in f"{e['field']}: {e['message']}" for e in status["last_rejected"]["errors"])

    with_gateway(scenario)


@pytest.mark.parametrize(("content", "status"), [
    (b"{not json", 400),
    (b'["a", "list"]', 400),
    (b'{"name": "other", "type": "chat", "source": {"path": "/m"}}', 400),  # the URL and the body disagree
])
def test_a_malformed_admin_put_is_400(with_gateway, content, status):
    async def scenario(gw: FakeGateway) -> None:
        before = gw.path.read_bytes()
        response = await gw.client.put("/admin/models/delta", content=content, headers=ADMIN)
        assert response.status_code == status and error_of(response)["type"] == "invalid_request_error"
        assert gw.path.read_bytes() == before and gw.store.version == 1

    with_gateway(scenario)


def test_registry_status_reports_the_applied_version(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        status = (await gw.client.get("/admin/registry/status", headers=ADMIN)).json()
        assert status["version"] == 1 and status["last_rejected"] is None
        assert status["num_models"] == 4 and status["path"] == str(gw.path)
        assert status["hash"].startswith("sha256:")

    with_gateway(scenario)


def test_admin_delete_removes_a_model_and_stops_its_replicas(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.delete("/admin/models/comp", headers=ADMIN)
        assert response.status_code == 200 and response.json()["diff"]["removed"] == ["comp"]
        assert gw.pool.group("comp") is None and gw.launcher.latest("comp/0").stopped
        assert "name: comp" not in gw.path.read_text()
        assert "# Gateway test registry: keep this comment." in gw.path.read_text()
        gone = await gw.client.post("/v1/completions", json={"model": "comp", "prompt": "x"})
        assert gone.status_code == 404
        assert (await gw.client.delete("/admin/models/comp", headers=ADMIN)).status_code == 404

    with_gateway(scenario)


def test_admin_delete_of_a_model_others_fall_back_to_is_rejected(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        before = gw.path.read_bytes()
        response = await gw.client.delete("/admin/models/beta", headers=ADMIN)
        assert response.status_code == 400 and "unknown model 'beta'" in error_of(response)["message"]
        assert gw.path.read_bytes() == before and not gw.launcher.latest("beta/0").stopped
        status = (await gw.client.get("/admin/registry/status", headers=ADMIN)).json()
        assert status["last_rejected"]["errors"][0]["field"] == "models[0].fallbacks[0]"

    with_gateway(scenario)


def test_admin_scale_resizes_the_group_and_persists_it(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        response = await gw.client.post("/admin/models/alpha/scale", json={"replicas": 3}, headers=ADMIN)
        assert response.status_code == 200
        assert response.json()["diff"]["resized"] == [{"name": "alpha", "old_replicas": 2, "new_replicas": 3}]
        assert len(gw.launcher.running("alpha")) == 3 and len(gw.pool.group("alpha").replicas) == 3
        assert "replicas: 3" in gw.path.read_text()
        await gw.client.post("/admin/models/alpha/scale", json={"replicas": 1}, headers=ADMIN)
        assert [r.replica_id for r in gw.pool.group("alpha").replicas] == ["alpha/0"]
        for bad in ({"replicas": -1}, {"replicas": "2"}, {"replicas": True}, {}, [3]):
            refused = await gw.client.post("/admin/models/alpha/scale", json=bad, headers=ADMIN)
            assert refused.status_code == 400 and error_of(refused)["param"] == "replicas"
        assert (await gw.client.post("/admin/models/nope/scale", json={"replicas": 1},
                                     headers=ADMIN)).status_code == 404
        assert gw.store.version == 3

    with_gateway(scenario)


def test_admin_drain_and_undrain_a_replica(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        drained = await gw.client.post("/admin/replicas/alpha/0/drain", headers=ADMIN)
        assert drained.status_code == 200 and drained.json()["state"] == "draining"
        for _ in range(4):
            await gw.client.post("/v1/chat/completions", json=chat())
        assert gw.replicas.count("alpha/0") == 0 and gw.replicas.count("alpha/1") == 4
        assert not gw.launcher.latest("alpha/0").stopped
        undrained = await gw.client.post("/admin/replicas/alpha/0/undrain", headers=ADMIN)
        assert undrained.status_code == 200 and undrained.json()["state"] == "ready"
        for _ in range(4):
            await gw.client.post("/v1/chat/completions", json=chat())
        assert gw.replicas.count("alpha/0") == 2
        missing = await gw.client.post("/admin/replicas/alpha/7/drain", headers=ADMIN)
        assert missing.status_code == 404 and error_of(missing)["param"] == "replica_id"

    with_gateway(scenario)
