"""An API key's lanes, enforced at the gateway: its `priority` is a ceiling (a more urgent lane is clamped down to
it, in what the replica receives), its `lanes` refuse any other lane with a 403; anonymous clients and keys that
set neither go as sent. The replica's lane is computed from what it received, as the replica does
(policies/classify.py, body first, then the header)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from foundation.http.errors import APIError
from gateway.auth_keys import ApiKey
from gateway.lanes import AS_SENT, LaneChoice, choose_lane
from policies.classify import classify
from policies.multilevel import BACKGROUND, INTERACTIVE, NORMAL
from tests.gateway.fakes import FakeGateway, Received, chat, error_of
from tests.gateway.test_traffic import records, traffic_registry

KEYS = {
    "batch": ApiKey(priority="background"),
    "normal": ApiKey(priority=1),
    "listed": ApiKey(lanes=frozenset({NORMAL, BACKGROUND})),
    "staff": ApiKey(priority="background", lanes=frozenset({INTERACTIVE, BACKGROUND})),
    "plain": ApiKey(tenant="internal"),
}


def bearer(key: str, **headers: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **headers}


def replica_lane(received: Received) -> int:
    """The lane the replica gives what it received (its own rule: the body's priority, X-Priority, length)."""
    return classify(received.body.get("priority"), received.headers.get("x-priority"), None, 3, None)


ASKS_INTERACTIVE: list[tuple[dict[str, Any], dict[str, str]]] = [
    ({"priority": 0}, {}),
    ({}, {"x-priority": "interactive"}),
    ({"priority": -2147483648}, {}),  # clamped to interactive by the lanes, then to the key's ceiling
    ({"priority": 0}, {"x-priority": "background"}),  # the body wins, as at the replica
]


@pytest.mark.parametrize("stream", [False, True])
def test_a_background_key_asking_for_interactive_runs_in_the_background_lane(with_gateway, stream):
    async def scenario(gw: FakeGateway) -> None:
        for body, headers in ASKS_INTERACTIVE:
            response = await gw.client.post("/v1/chat/completions", json=chat(stream=stream, **body),
                                            headers=bearer("batch", **headers))
            assert response.status_code == 200
        assert [replica_lane(r) for r in gw.replicas.received] == [BACKGROUND] * len(ASKS_INTERACTIVE)
        # a clamped body says the lane it got; the header carries it too
        assert [r.body.get("priority") for r in gw.replicas.received] == [2, None, 2, 2]
        assert {r.headers["x-priority"] for r in gw.replicas.received} == {"2"}

    with_gateway(scenario, api_keys=KEYS)


def test_the_clamped_priority_reaches_a_fallback_model(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "down")
        assert (await gw.client.post("/v1/chat/completions", json=chat(priority=0),
                                     headers=bearer("batch"))).status_code == 200
        assert gw.replicas.received[-1].host == "fake-beta-0"  # its body re-encoded for the other model
        assert [replica_lane(r) for r in gw.replicas.received] == [BACKGROUND] * len(gw.replicas.received)

    with_gateway(scenario, api_keys=KEYS)


def test_the_clamped_priority_reaches_a_streams_continuation(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        gw.replicas.set_all(["alpha/0", "alpha/1"], "break_midstream")
        response = await gw.client.post("/v1/chat/completions", json=chat(priority=0, stream=True),
                                        headers=bearer("batch"))
        assert response.status_code == 200
        continued = [r for r in gw.replicas.received if "multiserve_resume" in r.body]
        assert continued  # the stream went on on another replica
        assert [replica_lane(r) for r in gw.replicas.received] == [BACKGROUND] * len(gw.replicas.received)

    with_gateway(scenario, api_keys=KEYS)


def test_a_less_urgent_lane_than_the_keys_is_honoured_and_its_body_sent_as_is(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        for body, headers in [({"priority": 2}, {}), ({"priority": 7}, {}), ({}, {"x-priority": "background"}),
                              ({}, {})]:
            assert (await gw.client.post("/v1/chat/completions", json=chat(**body),
                                         headers=bearer("normal", **headers))).status_code == 200
        assert [replica_lane(r) for r in gw.replicas.received] == [BACKGROUND] * 3 + [NORMAL]
        assert [r.body.get("priority") for r in gw.replicas.received] == [2, 7, None, None]  # not rewritten

    with_gateway(scenario, api_keys=KEYS)


def test_a_keys_lanes_refuse_an_unlisted_lane_naming_the_allowed_ones(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        for body, headers in [({"priority": 0}, {}), ({}, {"x-priority": "interactive"}),
                              ({"priority": -5}, {"x-priority": "normal"})]:
            refused = await gw.client.post("/v1/chat/completions", json=chat(**body),
                                           headers=bearer("listed", **headers))
            assert refused.status_code == 403
            error = error_of(refused)
            assert (error["code"], error["param"], error["type"]) == ("lane_not_allowed", "priority",
                                                                    "permission_error")
            assert error["message"].endswith("the interactive lane is not one of this API key's lanes: normal, "
                                             "background")
        assert not gw.replicas.received
        for body, headers in [({"priority": 1}, {}), ({}, {"x-priority": "background"}), ({}, {})]:
            assert (await gw.client.post("/v1/chat/completions", json=chat(**body),
                                         headers=bearer("listed", **headers))).status_code == 200
        # listed lanes are honoured; a request that names none gets the least urgent listed
        assert [replica_lane(r) for r in gw.replicas.received] == [NORMAL, BACKGROUND, BACKGROUND]

    with_gateway(scenario, api_keys=KEYS)


def test_with_lanes_the_keys_priority_is_its_default_and_a_listed_urgent_lane_may_be_asked(with_gateway):
    async def scenario(gw: FakeGateway) -> None:
        for body in [{}, {"priority": 0}]:
            assert (await gw.client.post("/v1/chat/completions", json=chat(**body),
                                         headers=bearer("staff"))).status_code == 200
        assert [replica_lane(r) for r in gw.replicas.received] == [BACKGROUND, INTERACTIVE]
        assert (await gw.client.post("/v1/chat/completions", json=chat(priority=1), headers=bearer("staff"))
                ).status_code == 403

    with_gateway(scenario, api_keys=KEYS)


@pytest.mark.parametrize("keys", [None, {"plain": KEYS["plain"]}])
def test_anonymous_clients_and_keys_without_lanes_go_as_sent(with_gateway, keys):
    async def scenario(gw: FakeGateway) -> None:
        headers = {} if keys is None else bearer("plain")
        for body, extra in [({"priority": 0}, {}), ({}, {"x-priority": "interactive"}),
                            ({"priority": -2147483648}, {}), ({}, {})]:
            assert (await gw.client.post("/v1/chat/completions", json=chat(**body),
                                         headers={**headers, **extra})).status_code == 200
        received = gw.replicas.received
        assert [r.body.get("priority") for r in received] == [0, None, -2147483648, None]
        assert [r.headers.get("x-priority") for r in received] == [None, "interactive", None, None]
        assert [replica_lane(r) for r in received][:3] == [INTERACTIVE] * 3

    with_gateway(scenario, api_keys=keys)


def test_the_traffic_log_records_the_lane_the_key_allowed(with_gateway, tmp_path: Path):
    log = tmp_path / "traffic.jsonl"

    async def scenario(gw: FakeGateway) -> None:
        for body, headers in ASKS_INTERACTIVE[:3]:
            assert (await gw.client.post("/v1/chat/completions", json=chat(**body),
                                         headers=bearer("batch", **headers))).status_code == 200

    with_gateway(scenario, registry_text=traffic_registry(log), api_keys=KEYS)
    assert [r["lane"] for r in records(log)] == ["background"] * 3


@pytest.mark.parametrize("priority, header, key, choice", [
    (0, None, None, AS_SENT),  # anonymous: as sent
    (0, "interactive", ApiKey(tenant="t"), AS_SENT),  # a key that sets no lane: as sent
    (None, None, KEYS["batch"], LaneChoice(BACKGROUND)),
    (0, None, KEYS["batch"], LaneChoice(BACKGROUND, rewrite_priority=True)),
    (-(1 << 31), None, KEYS["batch"], LaneChoice(BACKGROUND, rewrite_priority=True)),
    (7, None, KEYS["batch"], LaneChoice(BACKGROUND)),  # the replica clamps 7 to background itself
    (None, "0", KEYS["batch"], LaneChoice(BACKGROUND)),  # the header is replaced, not the body
    (None, "background", KEYS["normal"], LaneChoice(BACKGROUND)),
    (None, "", KEYS["normal"], LaneChoice(NORMAL)),  # an empty header names no lane
    (None, None, KEYS["listed"], LaneChoice(BACKGROUND)),
    (1, "interactive", KEYS["listed"], LaneChoice(NORMAL)),  # the body's lane, not the header's
    (True, None, KEYS["batch"], LaneChoice(BACKGROUND)),  # not a priority: the replica refuses it (400)
    (1 << 31, None, KEYS["batch"], LaneChoice(BACKGROUND)),  # out of range: likewise
    (0.0, "interactive", KEYS["listed"], LaneChoice(BACKGROUND)),  # likewise, and the header is not read
])
def test_choose_lane(priority, header, key, choice):
    assert choose_lane(priority, header, key) == choice


def test_choose_lane_refusals_name_the_field():
    with pytest.raises(APIError) as refused:
        choose_lane(None, "interactive", KEYS["listed"])
    assert (refused.value.status, refused.value.code, refused.value.param) == (403, "lane_not_allowed", "priority")
    assert refused.value.message == ("X-Priority: the interactive lane is not one of this API key's lanes: normal, "
                                     "background")
    with pytest.raises(APIError) as bad:
        choose_lane(None, "urgent", KEYS["batch"])
    assert (bad.value.status, bad.value.param) == (400, "priority") and "X-Priority: priority must be" in str(bad.value)
