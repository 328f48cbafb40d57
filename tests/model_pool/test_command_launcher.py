"""The command launcher with real processes: the server it starts gets its filled command line, loopback, its API key
and its device share in the environment (never the gateway's secrets); stopping it, or its leader dying, leaves none of
its process group behind; what it wrote is there to show when it fails."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from model_pool.command_launcher import CommandHandle, CommandLauncher
from registry.command import CommandSpec
from registry.launch import ReplicaLaunch, ReplicaPlacement

# A tiny OpenAI-less server: GET /health answers what it was started with (its argv and a few variables).
SERVER = """
import http.server, json, os, sys
host, port = sys.argv[1], int(sys.argv[2])
print("server starting on", host, port, flush=True)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"argv": sys.argv, "env": {k: os.environ.get(k) for k in
                           ("MY_KEY", "MULTISERVE_REPLICA_TOKEN", "CUDA_VISIBLE_DEVICES", "ADMIN_SECRET")}}).encode()
        self.send_response(200 if self.path == "/healthz" else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer((host, port), Handler).serve_forever()
"""


def launch(tmp_path: Path, argv: list[str], **command: object) -> ReplicaLaunch:
    (tmp_path / "model.gguf").write_bytes(b"weights")
    return ReplicaLaunch(model="ext", index=1, type="chat", source=str(tmp_path / "model.gguf"), served_name="ext-s",
                         command=CommandSpec(argv=argv, **command),
                         placement=ReplicaPlacement(env={"CUDA_VISIBLE_DEVICES": "MIG-1234"}, memory_fraction=0.25))


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_server_gets_its_command_line_key_and_share_and_not_the_gateways_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("ADMIN_SECRET", "do-not-pass")
    server = SERVER.replace("{", "{{").replace("}", "}}")  # literal braces: not placeholders
    argv = [sys.executable, "-c", server, "{host}", "{port}", "{model_path}", "{served_name}", "{threads}",
            "{gpu_memory_fraction}"]
    launcher = CommandLauncher(log_dir=tmp_path / "logs", env_drop=lambda: ["ADMIN_SECRET"])

    async def main() -> None:
        handle = await launcher.start(launch(tmp_path, argv, token_env="MY_KEY", threads=3))
        try:
            assert handle.base_url.startswith("http://127.0.0.1:")
            seen = None
            for _ in range(200):
                try:
                    seen = httpx.get(f"{handle.base_url}/healthz", timeout=1).json()
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
            assert seen is not None, handle.output_tail()
            port = handle.base_url.rsplit(":", 1)[1]
            assert seen["argv"][1:] == ["127.0.0.1", port, str(tmp_path / "model.gguf"), "ext-s", "3", "0.25"]
            assert seen["env"] == {"MY_KEY": handle.token, "MULTISERVE_REPLICA_TOKEN": handle.token,
                                   "CUDA_VISIBLE_DEVICES": "MIG-1234", "ADMIN_SECRET": None}
            assert handle.token and handle.token not in " ".join(seen["argv"])  # never on the command line
            assert "server starting on 127.0.0.1" in handle.output_tail()
            assert (tmp_path / "logs" / "ext-1.log").exists()
        finally:
            await handle.stop(timeout_s=5)
        assert handle.exit_code() is not None

    asyncio.run(main())


def _family(tmp_path: Path) -> tuple[CommandHandle, list[int]]:
    """A server that starts two children of its own (as vLLM starts its engine processes), and their pids."""
    pids = tmp_path / "pids.json"
    script = ("import json, subprocess, sys, time\n"
              "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']) for _ in range(2)]\n"
              f"open({str(pids)!r}, 'w').write(json.dumps([k.pid for k in kids]))\n"
              "time.sleep(300)\n")

    async def start() -> CommandHandle:
        return await CommandLauncher(log_dir=tmp_path).start(launch(tmp_path, [sys.executable, "-c", script],
                                                                    stop_grace_s=2))

    handle = asyncio.run(start())
    wait_until(pids.exists)
    wait_until(lambda: bool(pids.read_text()))
    return handle, json.loads(pids.read_text())


def test_stop_ends_the_whole_process_group(tmp_path):
    handle, children = _family(tmp_path)
    assert group_alive(handle.process.pid) and len(children) == 2
    asyncio.run(handle.stop(timeout_s=5))
    assert handle.exit_code() is not None
    wait_until(lambda: not group_alive(handle.process.pid))


def test_a_leader_killed_outright_has_its_children_reaped_when_the_pool_sees_it_exit(tmp_path):
    handle, _ = _family(tmp_path)
    handle.kill()  # kill -9 of the server alone: its children live on, orphaned
    wait_until(lambda: handle.process.poll() is not None)
    assert group_alive(handle.process.pid)  # the children, still in its group
    assert handle.exit_code() == -9  # what the pool's supervision asks; it reaps the group
    wait_until(lambda: not group_alive(handle.process.pid))


def test_a_launch_without_a_command_is_refused(tmp_path):
    bare = ReplicaLaunch(model="ext", index=0, type="chat", source="m.gguf")
    with pytest.raises(ValueError, match="launcher 'command' needs a command section"):
        asyncio.run(CommandLauncher(log_dir=tmp_path).start(bare))
