"""`multiserve worker` as a real process on loopback, driven by the official openai client."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtimes.server.worker import engine_config, parse_engine_json
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

REPO_ROOT = Path(__file__).resolve().parents[3]
READY_TIMEOUT_S = 60.0


def test_engine_options_from_registry_json():
    config = parse_engine_json('{"block_size": 8, "kv_cache_gib": 0.5, "enable_prefix_caching": false}', "cpu")
    assert (config.block_size, config.kv_cache_bytes, config.device) == (8, 1 << 29, "cpu")
    assert not config.enable_prefix_caching
    assert parse_engine_json(None).device == "auto"
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['blok_size'\]"):
        engine_config({"blok_size": 8})
    with pytest.raises(ValueError, match="disagrees"):
        engine_config({"device": "cuda"}, "cpu")
    with pytest.raises(ValueError, match="not both"):
        engine_config({"kv_cache_gib": 1, "kv_cache_bytes": 10})
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_engine_json("[1]")
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        engine_config({"block_size": 3})


def test_bad_engine_json_exits_with_a_message():
    proc = subprocess.run(
        [sys.executable, "-m", "multiserve", "worker", "--source", "x.gguf", "--name", "x",
         "--engine-json", '{"nope": 1}'],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO_ROOT,
    )
    assert proc.returncode == 2 and "unknown engine option(s) ['nope']" in proc.stderr


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(base_url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"worker exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.TransportError):  # not listening yet
            if httpx.get(f"{base_url}/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"worker not ready after {READY_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")


@contextlib.contextmanager
def worker_process(args: list[str], log_path: Path) -> Iterator[str]:
    """`multiserve worker ARGS` on a free loopback port; yields its base URL once /ready, then stops it with
    SIGTERM and checks that it exited cleanly."""
    port = _free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "multiserve", "worker", *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base_url, proc, log_path)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
            pytest.fail(f"worker ignored SIGTERM:\n{log_path.read_text()[-4000:]}")
    assert proc.returncode == 0, log_path.read_text()[-4000:]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker process serving a tiny GGUF model as `tiny` (alias `tiny-a`); yields its base URL."""
    tmp = tmp_path_factory.mktemp("worker")
    path = write_gguf(hf_model(TinySpec(), seed=1), tmp / "tiny.gguf")
    args = ["--source", str(path), "--name", "tiny", "--alias", "tiny-a", "--device", "cpu",
            "--engine-json", '{"block_size": 4, "kv_cache_gib": 0.001, "max_num_seqs": 8}']
    with worker_process(args, tmp / "worker.log") as base_url:
        yield base_url


def _metric(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def test_openai_client_against_a_worker_process(worker):
    client = openai.OpenAI(base_url=f"{worker}/v1", api_key="x", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["tiny", "tiny-a"]

    completion = client.completions.create(model="tiny", prompt="hello", max_tokens=5,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5

    stream = client.chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, seed=1)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks[1:] if c.choices]
    assert len(content_chunks) == 6 and content_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=-1)


def test_client_leaving_a_real_stream_frees_its_blocks(worker):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{worker}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in received)
    deadline = time.monotonic() + 20
    while _metric(worker, "multiserve_kv_blocks_used") or _metric(worker, "multiserve_num_requests_running"):
        assert time.monotonic() < deadline, "the worker kept generating for a client that left"
        time.sleep(0.05)
    assert _metric(worker, "multiserve_request_success_total", finish_reason="abort") == 1
    assert _metric(worker, "multiserve_generation_tokens_total") < 400
