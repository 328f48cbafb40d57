"""`launcher: command` replicas in the pool and behind the gateway, over fakes: probed at their command's health
path, given their command's ready timeout (a start that never gets ready is a crash, its output in the log), and
sent the model under the name their server answers to, which replies carry back as the registry's."""

from __future__ import annotations

import json
import sys

import structlog

from model_pool.replica import ReplicaState
from tests.gateway.fakes import REGISTRY, FakeGateway, chat

COMMAND = REGISTRY.replace("""  - name: beta   # alpha's fallback
    type: chat
    source: {path: /models/beta.gguf}
    replicas: 1
""", f"""  - name: beta   # alpha's fallback, a server of another engine
    type: chat
    source: {{path: /models/beta.gguf}}
    replicas: 1
    launcher: command
    command: {{argv: [{sys.executable}, -m, server, '{{port}}'], health_path: /health, ready_timeout_s: 20,
              served_name: Org/Beta-7B}}
""")


def test_a_command_replica_is_probed_at_its_health_path_and_answers_under_the_models_name(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        assert gw.replicas.probe_paths == {"fake-alpha-0": "/ready", "fake-alpha-1": "/ready",
                                           "fake-beta-0": "/health", "fake-emb-0": "/ready", "fake-comp-0": "/ready"}
        assert gw.pool.find_replica("beta/0").state == ReplicaState.READY
        response = await gw.client.post("/v1/chat/completions", json=chat("beta"))
        assert response.status_code == 200 and response.json()["model"] == "beta"  # not the server's own name
        [received] = gw.replicas.received
        assert received.body["model"] == "Org/Beta-7B"  # what the server was started to answer to
        stream = await gw.client.post("/v1/chat/completions", json=chat("beta", stream=True))
        chunks = [json.loads(b.removeprefix("data: ")) for b in stream.text.split("\n\n") if b and "[DONE]" not in b]
        assert chunks and {c["model"] for c in chunks} == {"beta"}
        assert "Org/Beta-7B" not in stream.text

    with_gateway(scenario, registry_text=COMMAND)


def test_a_command_replica_that_never_gets_ready_is_a_failed_start_with_its_output(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set("beta/0", "not_ready")
        await gw.pool.apply(gw.store.registry)
        replica = gw.pool.find_replica("beta/0")
        with structlog.testing.capture_logs() as logs:
            gw.clock.advance(10)
            await gw.pool.tick()
            assert replica.state == ReplicaState.STARTING  # within the command's 20 s
            gw.clock.advance(11)
            await gw.pool.tick()
        assert replica.restarts == 1
        [crash] = [e for e in logs if e["event"] == "replica_crashed"]
        assert crash["replica"] == "beta/0" and crash["output"].startswith("output of pid")

    with_gateway(scenario, registry_text=COMMAND, ready=False)
