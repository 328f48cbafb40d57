"""The traffic profile: one record per chat/completion request, token counts from the reply, size rotation."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.auth_keys import ApiKey
from gateway.reply_tap import ReplyTap
from gateway.traffic import TrafficRecord, TrafficRecorder
from tests.gateway.fakes import NUM_STREAM_CHUNKS, REGISTRY, FakeGateway, chat


def traffic_registry(path: Path) -> str:
    return REGISTRY.replace("max_body_bytes: 2048}", f"max_body_bytes: 2048, traffic: {{path: {path}}}}}")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_usage_of_replies_and_counts_streams_without_usage(with_gateway, tmp_path):
    log = tmp_path / "traffic.jsonl"

    async def scenario(gw: FakeGateway) -> None:
        assert (await gw.client.post("/v1/chat/completions", json=chat("a", max_tokens=16))).status_code == 200
        assert (await gw.client.post("/v1/chat/completions", json=chat("beta", stream=True))).status_code == 200
        assert (await gw.client.post("/v1/completions", json={"model": "comp", "prompt": "x", "priority": 2})
                ).status_code == 200
        assert (await gw.client.post("/v1/chat/completions", json=chat("nope"))).status_code == 404
        await gw.client.get("/v1/models")  # not a generation: not recorded

    with_gateway(scenario, registry_text=traffic_registry(log))
    rows = records(log)
    assert [(r["model"], r["endpoint"], r["status"]) for r in rows] == [
        ("alpha", "chat", 200), ("beta", "chat", 200), ("comp", "completions", 200), (None, "chat", 404)]
    first, stream, completion = rows[:3]
    # the reply's own usage (the fake's progress reply, which the gateway asks for, has NUM_STREAM_CHUNKS tokens)
    assert (first["prompt_tokens"], first["output_tokens"], first["usage"]) == (3, NUM_STREAM_CHUNKS, "reported")
    assert first["lane"] == "interactive"  # 3 prompt tokens, max_tokens 16: short both ways
    assert first["end_s"] >= first["start_s"] > 0
    assert (stream["stream"], stream["output_tokens"], stream["usage"]) == (True, NUM_STREAM_CHUNKS, "counted")
    assert stream["prompt_tokens"] == 3 and stream["lane"] == "normal"  # prompt size from a header; no max_tokens
    assert completion["lane"] == "background"  # its priority says so


def test_stream_usage_chunk_split_across_writes():
    tap = ReplyTap()
    tap.start({"status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    body = (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
            b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19}}\n\n'
            b"data: [DONE]\n\n")
    for i in range(0, len(body), 5):  # arbitrary network chunking
        tap.feed(body[i:i + 5])
    assert tap.counts() == (12, 7, "reported")


def test_rotation_keeps_a_bounded_number_of_files(tmp_path):
    log = tmp_path / "t.jsonl"
    recorder = TrafficRecorder(log, max_bytes=4096, backups=2)
    for i in range(200):
        recorder.record(TrafficRecord(float(i), float(i) + 1, "m", "chat", "normal", 200, False, 10, 5, "reported"))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    assert all(p.stat().st_size <= 4096 for p in tmp_path.iterdir())
    newest = records(log)[-1]
    assert newest["start_s"] == 199.0  # the live file holds the latest requests
    assert records(tmp_path / "t.jsonl.1")[-1]["start_s"] < records(log)[0]["start_s"]


def test_the_recorded_lane_uses_the_models_thresholds_and_the_keys_default(with_gateway, tmp_path):
    log = tmp_path / "traffic.jsonl"
    lanes = "{lanes: {interactive_max_prompt_tokens: 2, background_min_prompt_tokens: 3}}"
    text = traffic_registry(log).replace("    fallbacks: [beta]\n", f"    fallbacks: [beta]\n    policy: {lanes}\n")

    async def scenario(gw: FakeGateway) -> None:
        assert (await gw.client.post("/v1/chat/completions", json=chat("a", max_tokens=16),
                                     headers={"authorization": "Bearer k"})).status_code == 200
        assert (await gw.client.post("/v1/chat/completions", json=chat("beta", max_tokens=16),
                                     headers={"authorization": "Bearer batch"})).status_code == 200

    with_gateway(scenario, registry_text=text, api_keys={"k": ApiKey(), "batch": ApiKey(priority="background")})
    alpha, beta = records(log)
    assert alpha["lane"] == "background"  # 3 prompt tokens are "long" by alpha's own thresholds
    assert beta["lane"] == "background"  # short, but its key's default lane says background


def test_a_rate_limited_key_and_the_traffic_log_read_one_stream_alike(with_gateway, tmp_path):
    """Both count a stream without usage (the replica's prompt count + content events) from the same reply."""
    log = tmp_path / "traffic.jsonl"

    async def scenario(gw: FakeGateway) -> None:
        body = chat("a", max_tokens=1, stream=True)
        auth = {"authorization": "Bearer t"}
        assert (await gw.client.post("/v1/chat/completions", json=body, headers=auth)).status_code == 200
        # charged 3 + 4 of 10: the same request (6 reserved) no longer fits this minute
        assert (await gw.client.post("/v1/chat/completions", json=body, headers=auth)).status_code == 429

    with_gateway(scenario, registry_text=traffic_registry(log), api_keys={"t": ApiKey(tokens_per_minute=10)})
    (row,) = records(log)
    assert (row["prompt_tokens"], row["output_tokens"], row["usage"]) == (3, NUM_STREAM_CHUNKS, "counted")
