"""`multiserve worker` as a real process on loopback, driven by the official openai client."""

from __future__ import annotations

import argparse
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

from multiserve.cli import build_parser
from multiserve.worker import launch_from_args
from runtimes.server.worker import engine_config
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

REPO_ROOT = Path(__file__).resolve().parents[3]
READY_TIMEOUT_S = 60.0


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["worker", *argv])


def test_a_launch_from_the_command_line_is_validated_like_the_registry():
    launch = launch_from_args(_args("--source", "m.gguf", "--name", "m", "--device", "cpu", "--engine-json",
                                    '{"block_size": 8, "kv_cache_gib": 0.5, "enable_prefix_caching": false, '
                                    '"max_queue_len": 4}'))
    config = engine_config(launch)
    assert (config.block_size, config.kv_cache_bytes, config.device, config.max_queue_len) == (8, 1 << 29, "cpu", 4)
    assert not config.enable_prefix_caching
    assert engine_config(launch_from_args(_args("--source", "m.gguf", "--name", "m"))).device == "auto"
    for engine_json, message in [('{"blok_size": 8}', "--engine-json: engine.blok_size: unknown field; did you "
                                                      "mean 'block_size'?"),
                                 ('{"kv_cache_bytes": 10}', "engine.kv_cache_bytes: unknown field"),
                                 ("[1]", "must be a JSON object"),
                                 ('{"block_size": 3}', "engine.block_size: must be a power of two, got 3"),
                                 ('{"multilevel": {"aging_s": 5}}', "queue.multilevel: only used with scheduling "
                                                                    "'multilevel'")]:
        with pytest.raises(ValueError) as info:
            launch_from_args(_args("--source", "m.gguf", "--name", "m", "--engine-json", engine_json))
        assert message in str(info.value)
    with pytest.raises(ValueError, match="give --launch, or --source and --name"):
        launch_from_args(_args("--name", "m"))


def test_bad_engine_json_exits_with_a_message():
    proc = subprocess.run(
        [sys.executable, "-m", "multiserve", "worker", "--source", "x.gguf", "--name", "x",
         "--engine-json", '{"nope": 1}'],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO_ROOT,
    )
    assert proc.returncode == 2 and "engine.nope: unknown field" in proc.stderr


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
