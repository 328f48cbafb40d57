"""`launcher: command`: the pool starts any OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, or an `argv`
of the registry's) as a replica, supervised like our own workers (model_pool/pool.py does the rest: readiness on
the command's health path, restarts with backoff, crash loops, drains, rollouts).

Each start: a free loopback port, the command line from the model's template (registry/command.py), and an
environment of the gateway's less its secrets, plus the partitioner's share of the device (CUDA_VISIBLE_DEVICES, the
MPS variables) and a fresh API key in the variable the server reads it from. The server runs in a process group of
its own (vLLM and SGLang start workers of their own): stopping it signals the whole group, SIGTERM then SIGKILL after
the command's `stop_grace_s`, and a leader that died (kill -9) has its group reaped too, so no orphan keeps a GPU or
a port. Its output goes to `<log_dir>/<model>-<index>.log`, whose tail the pool reports when it never gets ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from model_pool.launcher import ProcessHandle, die_with_parent, free_port, replica_env
from registry.command import DEFAULT_GPU_MEMORY_FRACTION, CommandSpec
from registry.launch import ReplicaLaunch
from registry.sources import resolve_model_path


@dataclass
class CommandHandle(ProcessHandle):
    """A server the pool started: a process handle whose process leads a process group of its own."""

    stop_grace_s: float = 30.0
    _group_reaped: bool = field(default=False, repr=False)

    def exit_code(self) -> int | None:
        code = self.process.poll()
        if code is not None and not self._group_reaped:
            # What the leader started must not outlive it. Once only: while any of the group lives, its id cannot
            # be given to another process; after that it could be.
            self._signal_group(signal.SIGKILL)
            self._group_reaped = True
        return code

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM to the process group; SIGKILL to it after the command's grace (or `timeout_s` if shorter)."""
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(self.process.wait), min(timeout_s, self.stop_grace_s))
        if not self._group_reaped:
            self._signal_group(signal.SIGKILL)
            self._group_reaped = True
        await asyncio.to_thread(self.process.wait)

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
            os.killpg(self.process.pid, signum)  # the leader's pid is the group's id (start_new_session)


class CommandLauncher:
    """Starts `launcher: command` replicas bound to `host` (loopback) on free ports."""

    def __init__(self, host: str = "127.0.0.1", log_dir: Path | None = None,
                 env_drop: Callable[[], Iterable[str]] = lambda: ()) -> None:
        self.host = host
        self.log_dir = log_dir
        self.env_drop = env_drop  # asked at each launch: the names can change with the registry

    def command(self, launch: ReplicaLaunch, port: int) -> list[str]:
        """The server's command line for `launch` on `port`."""
        command = _command_of(launch)
        fraction = launch.placement.memory_fraction or DEFAULT_GPU_MEMORY_FRACTION
        values = {"host": self.host, "port": str(port), "model_path": str(resolve_model_path(launch.source)),
                  "served_name": launch.served_name or launch.model,
                  "threads": str(command.threads or default_threads()), "gpu_memory_fraction": f"{fraction:.4g}"}
        return command.argv_for(values)

    def environment(self, launch: ReplicaLaunch, token: str) -> dict[str, str]:
        """The gateway's environment less its secrets, the placement's device variables, and the API key: in the
        command's own variable, and in ours (a `multiserve worker` run as a command reads that one)."""
        env = replica_env(launch, token, self.env_drop())
        key_env = _command_of(launch).api_key_env
        if key_env is not None:
            env[key_env] = token
        return env

    async def start(self, launch: ReplicaLaunch) -> CommandHandle:
        port = free_port(self.host)
        argv = self.command(launch, port)
        token = secrets.token_urlsafe(32)
        log_dir = self.log_dir or Path(tempfile.gettempdir()) / "multiserve-commands"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{launch.model}-{launch.index}.log"
        preexec = die_with_parent if sys.platform.startswith("linux") else None
        with log_path.open("ab") as out:
            out.write(f"--- starting: {' '.join(argv)}\n".encode())
            out.flush()
            process = subprocess.Popen(  # argv as the registry gave it: no shell
                argv, env=self.environment(launch, token), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec)
        return CommandHandle(f"http://{self.host}:{port}", process, log_path, token,
                             stop_grace_s=_command_of(launch).stop_grace_s)


def default_threads() -> int:
    """The CPUs this process may run on: what a command replica gets for `{threads}` unless `threads` says."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _command_of(launch: ReplicaLaunch) -> CommandSpec:
    if launch.command is None:
        raise ValueError(f"model {launch.model!r}: launcher 'command' needs a command section")
    return launch.command
