"""The registry's `gateway:` section while the gateway runs: secrets and the body limit apply live; the socket and
the traffic log need a restart and an edit of them is refused saying so, never reported applied and ignored."""

from __future__ import annotations

from gateway.app import gateway_config_problems
from registry.schema import GatewayConfig
from tests.gateway.fakes import FakeGateway, chat

ENV = {"MULTISERVE_ADMIN_TOKEN": "old-admin", "ROTATED_ADMIN": "new-admin", "KEYS": '{"k1": "*"}', "BAD": "[1]"}


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_edits_that_need_a_restart_are_refused_by_name():
    running = GatewayConfig()
    problems = gateway_config_problems(running, GatewayConfig(port=9001, traffic={"path": "t.jsonl"}), ENV)
    assert [p.field for p in problems] == ["gateway.port", "gateway.traffic"]
    assert all("needs restart" in p.message for p in problems)
    assert gateway_config_problems(running, GatewayConfig(max_body_bytes=4096, admin_token_env="ROTATED_ADMIN",
                                                          api_keys_env="KEYS"), ENV) == []


def test_api_keys_that_do_not_parse_refuse_the_edit():
    problems = gateway_config_problems(GatewayConfig(), GatewayConfig(api_keys_env="BAD"), ENV)
    assert [p.field for p in problems] == ["gateway.api_keys_env"] and "$BAD" in problems[0].message


def test_secrets_and_the_body_limit_apply_live(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.state.env = ENV
        assert (await gw.client.get("/admin/models", headers=_bearer("admin-secret"))).status_code == 200
        assert (await gw.client.post("/v1/chat/completions", json=chat())).status_code == 200  # no keys yet
        gw.state.apply_gateway_config(GatewayConfig(admin_token_env="ROTATED_ADMIN", api_keys_env="KEYS",
                                                    max_body_bytes=1024))
        assert (await gw.client.get("/admin/models", headers=_bearer("admin-secret"))).status_code == 401
        assert (await gw.client.get("/admin/models", headers=_bearer("new-admin"))).status_code == 200
        assert (await gw.client.post("/v1/chat/completions", json=chat())).status_code == 401  # keys are on now
        ok = await gw.client.post("/v1/chat/completions", json=chat(), headers=_bearer("k1"))
        assert ok.status_code == 200
        big = chat(messages=[{"role": "user", "content": "x" * 2000}])
        too_big = await gw.client.post("/v1/chat/completions", json=big, headers=_bearer("k1"))
        assert too_big.status_code == 413 and "limit of 1024 bytes" in too_big.text

    with_gateway(scenario)
