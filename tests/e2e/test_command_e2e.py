"""`launcher: command` end to end: `multiserve serve` starts two replicas of a model from an `argv` that runs
`multiserve worker` itself (a real OpenAI-compatible server this project builds, started as any outside server
would be), the official openai client streams through the gateway, a replica killed with `kill -9` is restarted
while every request sent meanwhile succeeds, an edit of the command rolls both replicas with no failed request, and
shutdown leaves no process behind.

Tests run in file order on one gateway; the last one shuts it down.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from bench.measure.memory_watch import children_of
from model_pool.launcher import free_port
from tests.e2e.conftest import Gateway, running_gateway
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

pytestmark = pytest.mark.slow

ENGINE = '{{"kv_cache_gib": 0.02, "max_model_len": 512, "max_num_seqs": 16}}'  # braces doubled: not placeholders


def registry(port: int, model: Path, extra_args: list[str]) -> str:
    argv = [sys.executable, "-m", "multiserve", "worker", "--source", "{model_path}", "--name", "{served_name}",
            "--host", "{host}", "--port", "{port}", "--device", "cpu", "--engine-json", ENGINE, *extra_args]
    return yaml.safe_dump({
        "gateway": {"host": "127.0.0.1", "port": port},
        "models": [{"name": "ext-chat", "aliases": ["ext"], "type": "chat", "source": {"path": str(model)},
                    "replicas": 2, "launcher": "command", "device": "cpu",
                    "command": {"argv": argv, "health_path": "/ready", "ready_timeout_s": 120,
                                "served_name": "tiny-served"}}]})


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("command")
    model = write_gguf(hf_model(TinySpec(max_position_embeddings=512), seed=5), root / "tiny.gguf")
    port = free_port()
    with running_gateway(root, registry(port, model, []), port, model) as gw:
        _wait_for(lambda: _ready(gw) == 2, "both command replicas ready")
        yield gw


def _replicas(gateway: Gateway) -> list[dict]:
    return httpx.get(f"{gateway.url}/health/models", timeout=10).json()["models"]["ext-chat"]["replicas"]


def _ready(gateway: Gateway) -> int:
    return sum(r["state"] == "ready" for r in _replicas(gateway))


def _wait_for(check, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_the_official_client_streams_through_a_command_replica(gateway):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        chunks = list(client.chat.completions.create(
            model="ext", messages=[{"role": "user", "content": "hi"}], max_tokens=9, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9
        assert {c.model for c in chunks} == {"ext-chat"}  # the server answers as tiny-served; the client sees ours
        done = client.completions.create(model="ext-chat", prompt="hello", max_tokens=4,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4 and done.model == "ext-chat"


class Traffic:
    """Requests sent one after another from a thread of their own (a stream every other one), each one's outcome
    recorded, until stopped."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway, self.outcomes, self.stop = gateway, [], threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with openai.AsyncOpenAI(base_url=f"{self.gateway.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            i = 0
            while not self.stop.is_set():
                i += 1
                try:
                    if i % 2:
                        reply = await client.completions.create(model="ext", prompt=f"request {i}", max_tokens=24,
                                                                extra_body={"ignore_eos": True})
                        self.outcomes.append(reply.usage.completion_tokens == 24)
                    else:
                        stream = await client.completions.create(model="ext", prompt=f"stream {i}", max_tokens=24,
                                                                 stream=True, extra_body={"ignore_eos": True})
                        texts = [c.choices[0].text async for c in stream if c.choices]
                        self.outcomes.append(len(texts) >= 1)
                except openai.OpenAIError as err:
                    self.outcomes.append(repr(err))

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(180)


def test_a_command_replica_killed_outright_is_restarted_while_every_request_succeeds(gateway):
    victim = _replicas(gateway)[0]
    with Traffic(gateway) as traffic:
        _wait_for(lambda: len(traffic.outcomes) >= 4, "traffic under way")
        os.kill(victim["pid"], signal.SIGKILL)

        def back() -> bool:
            replica = next(r for r in _replicas(gateway) if r["id"] == victim["id"])
            return replica["state"] == "ready" and replica["restarts"] >= 1 and replica["pid"] != victim["pid"]

        _wait_for(back, "the killed replica restarted and ready")
        count = len(traffic.outcomes)
        _wait_for(lambda: len(traffic.outcomes) >= count + 4, "traffic on the restarted pair")
    failed = [o for o in traffic.outcomes if o is not True]
    assert not failed and len(traffic.outcomes) >= 8, failed


def test_an_edit_of_the_command_rolls_both_replicas_with_no_failed_request(gateway):
    before = {r["pid"] for r in _replicas(gateway)}
    text = gateway.registry_path.read_text()
    edited = yaml.safe_load(text)
    edited["models"][0]["command"]["argv"] += ["--stall-timeout-s", "90"]
    with Traffic(gateway) as traffic:
        _wait_for(lambda: len(traffic.outcomes) >= 2, "traffic under way")
        gateway.registry_path.write_text(yaml.safe_dump(edited))

        def rolled() -> bool:
            group = httpx.get(f"{gateway.url}/health/models", timeout=10).json()["models"]["ext-chat"]
            rollout = group.get("rollout") or {}
            return rollout.get("state") == "done" and _ready(gateway) == 2

        _wait_for(rolled, "the rollout", timeout_s=180)
        count = len(traffic.outcomes)
        _wait_for(lambda: len(traffic.outcomes) >= count + 2, "traffic on the new replicas")
    failed = [o for o in traffic.outcomes if o is not True]
    assert not failed, failed
    after = {r["pid"] for r in _replicas(gateway)}
    assert not before & after and len(after) == 2


def test_shutdown_leaves_no_process_behind(gateway):
    servers = children_of(gateway.process.pid)
    assert len(servers) >= 2
    assert gateway.stop() == 0
    time.sleep(0.5)
    alive = [pid for pid in servers if Path(f"/proc/{pid}").exists()
             and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]
    assert alive == []
