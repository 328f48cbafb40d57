"""No broken streams: a replica killed mid-generation, or drained with migration, and every stream goes on on the
other replica, on the same client connection, with the text the undisturbed run gives; a non-streamed request is
finished there too, as one whole reply (real gateway, real workers, the official openai client; two tiny-chat
replicas as in tests/e2e/conftest.py, on the default engine: the GGUF's own Q4_1 blocks on the int8 kernel, where the
continuation, which prefills the tokens a stream had, must equal what decoding them gave)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from model_pool.launcher import free_port
from tests.e2e.conftest import ADMIN_TOKEN, REGISTRY, Gateway, running_gateway
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

MAX_TOKENS = 300
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("gateway")
    model = write_gguf(hf_model(TinySpec(max_position_embeddings=512), seed=2), root / "tiny-Q4_1.gguf", "Q4_1")
    port = free_port()
    with running_gateway(root, REGISTRY.format(port=port, model=model), port, model) as gw:
        yield gw


@dataclass
class Run:
    """One completion as its client saw it (streamed, or `whole`)."""

    whole: bool = False
    text: str = ""
    ids: set[str] = field(default_factory=set)
    chunks: int = 0
    finish_reason: str | None = None
    usage: tuple[int, int] | None = None
    error: str | None = None


def _requests(count_greedy: int, count_seeded: int, count_whole: int = 0) -> list[dict]:
    """Streamed greedy and seeded requests, then `count_whole` non-streamed ones (greedy and seeded in turn)."""
    requests = [{"prompt": f"request {i}: the story goes", "temperature": 0.0} for i in range(count_greedy)]
    requests += [{"prompt": f"sampled {i}: once upon a time", "temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
                 for i in range(count_seeded)]
    requests += [{"prompt": f"whole {i}: it was late", "whole": True,
                  **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 300 + i})}
                 for i in range(count_whole)]
    return requests


async def _stream(client: openai.AsyncOpenAI, request: dict, run: Run) -> None:
    if request.get("whole"):
        return await _whole(client, {k: v for k, v in request.items() if k != "whole"}, run)
    try:
        stream = await client.completions.create(model="tiny-chat", max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}, **request)
        async for chunk in stream:
            run.ids.add(chunk.id)
            if chunk.usage is not None:
                run.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for choice in chunk.choices:
                run.text += choice.text
                run.chunks += 1
                run.finish_reason = choice.finish_reason or run.finish_reason
    except Exception as err:  # recorded: the assertions say which request broke and how
        run.error = repr(err)


async def _whole(client: openai.AsyncOpenAI, request: dict, run: Run) -> None:
    run.whole = True
    try:
        completion = await client.completions.create(model="tiny-chat", max_tokens=MAX_TOKENS,
                                                     extra_body={"ignore_eos": True}, **request)
    except Exception as err:
        run.error = repr(err)
        return
    run.ids.add(completion.id)
    run.text, run.finish_reason = completion.choices[0].text, completion.choices[0].finish_reason
    assert completion.usage is not None
    run.usage = (completion.usage.prompt_tokens, completion.usage.completion_tokens)


async def _run_all(gateway: Gateway, requests: list[dict], disturb=None) -> list[Run]:
    """Stream every request at once; `disturb(runs)` runs alongside (it waits for what it needs)."""
    runs = [Run() for _ in requests]
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        tasks = [asyncio.create_task(_stream(client, r, run)) for r, run in zip(requests, runs, strict=True)]
        if disturb is not None:
            await disturb(runs)
        await asyncio.gather(*tasks)
    return runs


async def _until_all_streaming(runs: list[Run], min_chunks: int = 3, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(run.chunks >= min_chunks or run.error or run.whole for run in runs):
        assert time.monotonic() < deadline, "the streams did not start"
        await asyncio.sleep(0.005)
    assert not any(run.finish_reason for run in runs), "a stream ended before the disturbance: make them longer"


def _replicas(gateway: Gateway) -> list[dict]:
    return httpx.get(f"{gateway.url}/health/models", timeout=10).json()["models"]["tiny-chat"]["replicas"]


def _busiest(gateway: Gateway) -> dict:
    return max(_replicas(gateway), key=lambda r: r["in_flight"])


def _assert_same(runs: list[Run], reference: list[Run]) -> None:
    for i, (run, ref) in enumerate(zip(runs, reference, strict=True)):
        assert run.error is None, f"request {i}: {run.error}"
        assert run.finish_reason == "length" and run.usage is not None and run.usage[1] == MAX_TOKENS, i
        assert run.usage == ref.usage, i
        assert len(run.ids) == 1, f"request {i} changed its id: {run.ids}"  # (a whole reply's is its own)
        assert run.text == ref.text, f"request {i} differs from its undisturbed run"


def _wait_all_ready(gateway: Gateway, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(r["state"] == "ready" for r in _replicas(gateway)):
        assert time.monotonic() < deadline, _replicas(gateway)
        time.sleep(0.1)


def test_a_replica_killed_mid_stream_loses_no_stream(gateway):
    _wait_all_ready(gateway)
    requests = _requests(16, 8, count_whole=6)
    reference = asyncio.run(_run_all(gateway, requests))
    assert all(r.error is None for r in reference)
    retries_before = _metric(gateway, 'multiserve_gateway_retries_total{model="tiny-chat"}')
    killed: list[dict] = []

    async def kill_busiest(runs: list[Run]) -> None:
        await _until_all_streaming(runs)
        victim = _busiest(gateway)
        killed.append(victim)
        os.kill(victim["pid"], signal.SIGKILL)

    runs = asyncio.run(_run_all(gateway, requests, kill_busiest))
    assert killed and killed[0]["in_flight"] >= 15  # the one serving most of them
    _assert_same(runs, reference)
    # the whole replies the killed replica had were continued, not sent again from the start (a retry)
    assert _metric(gateway, 'multiserve_gateway_retries_total{model="tiny-chat"}') == retries_before
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert 'multiserve_gateway_stream_migrations_total{cause="replica_failed",model="tiny-chat"}' in metrics
    _wait_all_ready(gateway)  # the pool restarts it


def test_drain_with_migrate_empties_a_replica_at_once(gateway):
    _wait_all_ready(gateway)
    requests = _requests(8, 0)
    reference = asyncio.run(_run_all(gateway, requests))
    drained: list[tuple[dict, float]] = []

    async def drain_busiest(runs: list[Run]) -> None:
        await _until_all_streaming(runs)
        victim = _busiest(gateway)
        async with httpx.AsyncClient(timeout=10) as http:
            reply = await http.post(f"{gateway.url}/admin/replicas/{victim['id']}/drain", json={"migrate": True},
                                    headers=ADMIN)
            assert reply.status_code == 200, reply.text
            start = time.monotonic()
            while any(r["id"] == victim["id"] and r["in_flight"] for r in _replicas(gateway)):
                await asyncio.sleep(0.01)
            drained.append((victim, time.monotonic() - start))

    runs = asyncio.run(_run_all(gateway, requests, drain_busiest))
    [(victim, empty_after_s)] = drained
    assert victim["in_flight"] >= 4 and empty_after_s < 2.0, drained
    _assert_same(runs, reference)
    # the replica itself holds no request either (its engine aborted each one when its stream moved)
    state = next(r for r in _replicas(gateway) if r["id"] == victim["id"])
    assert state["state"] == "draining" and state["in_flight"] == 0
    reply = httpx.post(f"{gateway.url}/admin/replicas/{victim['id']}/undrain", headers=ADMIN, timeout=10)
    assert reply.status_code == 200


def test_drain_with_migrate_of_the_last_ready_replica_lets_its_streams_finish(gateway):
    """The other replica drained first (without migration), the busy one is the model's last: drained with
    migration, its streams have nowhere to go, and finish where they are rather than end in an error event."""
    _wait_all_ready(gateway)
    requests = _requests(4, 0)
    reference = asyncio.run(_run_all(gateway, requests))
    migrated_before = _migrations(gateway, "drained")
    answers: list[dict] = []

    async def drain_both(runs: list[Run]) -> None:
        await _until_all_streaming(runs)
        busiest = _busiest(gateway)
        other = next(r for r in _replicas(gateway) if r["id"] != busiest["id"])
        async with httpx.AsyncClient(timeout=10) as http:
            first = await http.post(f"{gateway.url}/admin/replicas/{other['id']}/drain", headers=ADMIN)
            assert first.status_code == 200, first.text
            reply = await http.post(f"{gateway.url}/admin/replicas/{busiest['id']}/drain", json={"migrate": True},
                                    headers=ADMIN)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json())

    try:
        runs = asyncio.run(_run_all(gateway, requests, drain_both))
    finally:
        for replica in _replicas(gateway):
            httpx.post(f"{gateway.url}/admin/replicas/{replica['id']}/undrain", headers=ADMIN, timeout=10)
    [answer] = answers
    assert answer["migrated_streams"] == 0 and answer["finishing_in_place"] >= 1, answer
    assert answer["migration_waiting"] is True
    _assert_same(runs, reference)  # every stream whole: all its tokens, then [DONE], no error event
    assert _migrations(gateway, "drained") == migrated_before


def test_a_live_engine_edit_rolls_out_without_breaking_a_stream(gateway):
    """16 clients stream back to back while an admin edit changes the model's engine settings: the replicas are
    replaced one by one (the new one ready before the old one is drained with migration), and every stream, before,
    during and after, completes unchanged."""
    _wait_all_ready(gateway)
    requests = _requests(12, 4)
    reference = asyncio.run(_run_all(gateway, requests))
    old_ids = {r["id"] for r in _replicas(gateway)}
    migrated_before = _migrations(gateway, "drained")
    edit_done = asyncio.Event()
    finished: list[tuple[int, Run]] = []

    async def client_loop(client: openai.AsyncOpenAI, i: int) -> None:
        while True:
            last = edit_done.is_set()
            run = Run()
            await _stream(client, requests[i], run)
            finished.append((i, run))
            if last:
                return

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            loops = [asyncio.create_task(client_loop(client, i)) for i in range(len(requests))]
            await asyncio.sleep(0.5)
            entry = {"type": "chat", "source": {"path": str(gateway.model_path)}, "aliases": ["tiny"], "replicas": 2,
                     "device": "cpu", "engine": {"block_size": 16, "kv_cache_gib": 0.02, "max_model_len": 512,
                                                 "max_num_seqs": 24}}
            async with httpx.AsyncClient(timeout=300) as http:
                reply = await http.put(f"{gateway.url}/admin/models/tiny-chat", json=entry, headers=ADMIN)
            assert reply.status_code == 200, reply.text
            assert reply.json()["diff"]["relaunched"] == ["tiny-chat"]
            edit_done.set()
            await asyncio.gather(*loops)

    asyncio.run(main())
    assert len(finished) > 2 * len(requests)
    for i, run in finished:
        _assert_same([run], [reference[i]])
    health = httpx.get(f"{gateway.url}/health/models", timeout=10).json()["models"]["tiny-chat"]
    assert health["engine"]["max_num_seqs"] == 24 and health["rollout"]["state"] == "done"
    assert not old_ids & {r["id"] for r in health["replicas"]}
    assert _migrations(gateway, "drained") > migrated_before  # streams did move mid-way


def _migrations(gateway: Gateway, cause: str) -> float:
    return _metric(gateway, f'multiserve_gateway_stream_migrations_total{{cause="{cause}",model="tiny-chat"}}')


def _metric(gateway: Gateway, sample: str) -> float:
    """The value of one sample (name and labels as exposed) of the gateway's metrics; 0 when absent."""
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return sum(float(line.removeprefix(f"{sample} ")) for line in text.splitlines() if line.startswith(f"{sample} "))
