"""A real gateway (`multiserve serve`) in a subprocess, with real worker processes on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from foundation.http.wire import REPLICA_TOKEN_ENV
from model_pool.launcher import free_port
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

ADMIN_TOKEN = "e2e-admin-token"
REGISTRY = """\
# e2e registry: the operator's comments must survive admin edits
gateway: {{host: 127.0.0.1, port: {port}}}
models:
  - name: tiny-chat   # two replicas for failover
    aliases: [tiny]
    type: chat
    source: {{path: {model}}}
    replicas: 2
    device: cpu
    engine: {{block_size: 16, kv_cache_gib: 0.02, max_model_len: 512, max_num_seqs: 32}}
"""


def replica_token(pid: int) -> str:
    """The launch token of the worker process `pid`, read as its own user may from /proc (the gateway passed it in
    the worker's environment; every request to the worker but its probes must carry it)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    prefix = f"{REPLICA_TOKEN_ENV}=".encode()
    return next(entry[len(prefix):].decode() for entry in environ if entry.startswith(prefix))


def replica_get(replica: dict, path: str) -> httpx.Response:
    """GET `path` from a worker, as its gateway does; `replica` is its entry in the gateway's /health/models."""
    headers = {"authorization": f"Bearer {replica_token(replica['pid'])}"}
    return httpx.get(f"{replica['url']}{path}", headers=headers, timeout=10)


def wait_until_ready(url: str, exited: Callable[[], bool], output: Callable[[], str], timeout_s: float,
                     poll_s: float = 0.25) -> None:
    """Poll `url` until it answers 200; fail with the process's `output()` if it `exited()` or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert not exited(), f"exited: {output()}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise AssertionError(f"not ready in {timeout_s} s: {output()}")


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen[bytes]
    registry_path: Path
    model_path: Path
    log_path: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        wait_until_ready(f"{self.url}/ready", lambda: self.process.poll() is not None,
                         lambda: f"gateway: {self.log_path.read_text()[-3000:]}", timeout_s)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


@contextlib.contextmanager
def running_gateway(root: Path, registry_text: str, port: int, model_path: Path,
                    extra_env: dict[str, str] | None = None) -> Iterator[Gateway]:
    """`multiserve serve` over `registry_text` (written to root/registry.yaml), ready; stopped on exit.
    `extra_env` goes to the gateway and, through it, to its workers."""
    registry = root / "registry.yaml"
    registry.write_text(registry_text)
    log_path = root / "gateway.log"
    env = {**os.environ, "MULTISERVE_ADMIN_TOKEN": ADMIN_TOKEN, "MULTISERVE_LOG_DIR": str(root / "logs"),
           **(extra_env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "multiserve", "serve", "--config", str(registry)],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)
    gw = Gateway(f"http://127.0.0.1:{port}", process, registry, model_path, log_path)
    try:
        gw.wait_ready()
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("gateway")
    model = write_gguf(hf_model(TinySpec(max_position_embeddings=512), seed=2), root / "tiny.gguf")
    port = free_port()
    with running_gateway(root, REGISTRY.format(port=port, model=model), port, model) as gw:
        yield gw
