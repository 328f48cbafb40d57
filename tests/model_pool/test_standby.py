"""Standby workers (the local launcher's warm pool): a real `multiserve worker --standby` process takes a launch
from its standard input and serves it as a worker started for it would: on the assigned port, asking the launch
token, writing to the replica's log, without the gateway's secrets in its environment."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from model_pool.launcher import LocalLauncher, ProcessHandle
from registry.launch import ReplicaLaunch
from tests.e2e.conftest import wait_until_ready
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(hf_model(TinySpec(max_position_embeddings=256), seed=3),
                      tmp_path_factory.mktemp("standby") / "tiny.gguf")


def launch_of(model: Path, index: int) -> ReplicaLaunch:
    return ReplicaLaunch(model="tiny", index=index, type="chat", source=str(model), device="cpu",
                         engine={"kv_cache_gib": 0.01, "max_model_len": 256, "block_size": 16})


def wait_ready(handle: ProcessHandle) -> None:
    wait_until_ready(f"{handle.base_url}/ready", lambda: handle.exit_code() is not None, handle.output_tail, 90.0,
                     poll_s=0.1)


def test_a_launch_takes_a_standby_worker_which_serves_it_as_its_own(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTISERVE_ADMIN_TOKEN", "admin-secret")
    launcher = LocalLauncher(log_dir=tmp_path, env_drop=lambda: {"MULTISERVE_ADMIN_TOKEN"},
                             warm_workers=lambda: 1, refill_delay_s=3600)
    launcher.fill()
    standby = launcher._standby[0].pid

    async def start_two() -> tuple[ProcessHandle, ProcessHandle]:
        first = await launcher.start(launch_of(tiny_model, 0))
        second = await launcher.start(launch_of(tiny_model, 1))  # none left (the refill comes later): a fresh one
        return first, second

    first, second = asyncio.run(start_two())
    try:
        assert first.pid == standby and second.pid != standby and launcher.took_standby == 1
        for handle in (first, second):
            wait_ready(handle)
            token = handle.token
            assert token is not None
            models = httpx.get(f"{handle.base_url}/v1/models", headers={"authorization": f"Bearer {token}"})
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
            assert httpx.get(f"{handle.base_url}/v1/models").status_code == 401  # it asks the launch token
            environ = Path(f"/proc/{handle.pid}/environ").read_bytes()
            assert b"admin-secret" not in environ
        # the standby got its token on its standard input; a fresh worker gets it in its environment
        assert first.token.encode() not in Path(f"/proc/{first.pid}/environ").read_bytes()
        log = (tmp_path / "tiny-0.log").read_text()
        assert "model loaded" in log and "standby_ready" not in log  # its output moved to the replica's log
        assert "standby_ready" in (tmp_path / "standby-1.log").read_text()
    finally:
        asyncio.run(first.stop(10))
        asyncio.run(second.stop(10))
    assert first.exit_code() is not None and second.exit_code() is not None


def test_closing_the_launcher_lets_its_standby_workers_go(tmp_path):
    launcher = LocalLauncher(log_dir=tmp_path, warm_workers=lambda: 2)
    launcher.fill()
    processes = list(launcher._standby)
    assert len(processes) == 2
    launcher.close()
    assert all(p.poll() is not None for p in processes) and launcher._standby == []


def test_a_standby_worker_refuses_a_bad_assignment_and_ends_quietly_on_none():
    argv = [sys.executable, "-m", "multiserve", "worker", "--standby"]
    bad = subprocess.run(argv, input=b'{"launch": {"model": "m"}, "port": "x"}\n', capture_output=True, timeout=120)
    assert bad.returncode == 2
    assert b"error: the assignment: launch.index: Field required" in bad.stderr
    assert b"port: Input should be a valid integer" in bad.stderr
    none = subprocess.run(argv, input=b"", capture_output=True, timeout=120)
    assert none.returncode == 0
