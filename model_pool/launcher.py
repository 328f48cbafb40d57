"""Launchers start a replica and hand back a handle: the local one spawns a worker process on loopback
with the environment the partitioner planned; the URL one adopts a replica started elsewhere.

A local worker gets a fresh random token (foundation/http/replica_auth.py) that every request to it must carry,
and does not inherit the gateway's own secrets: `LocalLauncher(env_drop=...)` names the variables (the admin
token's, the API keys') that are taken out of its environment.

The local launcher can keep a warm pool of standby workers (`warm_workers`, the registry's
`gateway.warm_workers`): processes that have imported the runtimes and wait for an assignment on their standard
input (multiserve/worker.py). A launch takes one when there is one, saving the interpreter's and the imports'
start (most of a small model's cold start); a replacement is started `refill_delay_s` later, so it does not compete
for the CPU with the model just being loaded.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from foundation.http.wire import REPLICA_TOKEN_ENV
from registry.launch import ReplicaLaunch, StandbyAssignment


class ReplicaHandle(Protocol):
    base_url: str
    token: str | None  # what requests to it must carry (None: it asks for nothing)

    @property
    def pid(self) -> int | None:
        """The local process id, for operators (and failover tests); None for replicas started elsewhere."""

    def exit_code(self) -> int | None:
        """The process's exit status once it has ended; None while running (or not ours to watch)."""

    async def stop(self, timeout_s: float) -> None:
        """Ask it to stop (SIGTERM), then kill it after `timeout_s`."""

    def output_tail(self) -> str:
        """The last of what its process wrote ("" when not ours to read): shown when it fails to start."""


class Launcher(Protocol):
    async def start(self, launch: ReplicaLaunch) -> ReplicaHandle: ...


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


TAIL_BYTES = 4096  # of a replica's output, shown when it fails to start


# Worker processes share the host's cores. GNU OpenMP (torch's CPU thread pool) spins 300,000 times at every barrier
# before it sleeps, since a process cannot see the others' threads: with several workers busy at once (models
# loading and decoding side by side) the spinning threads take the cores from the ones they wait for, and steps
# ran up to 10x slower. 1000 spins is what libgomp itself uses when it knows the cores are oversubscribed; a
# worker alone decodes as fast with it (docs/benchmarks.md, "Models on demand"). The gateway's own setting wins.
SHARED_HOST_ENV = {"GOMP_SPINCOUNT": "1000"}


def worker_env(drop: Iterable[str]) -> dict[str, str]:
    """The environment of a worker process on this host: the gateway's less the variables in `drop` (its
    secrets), with `SHARED_HOST_ENV` where the gateway sets none, and unbuffered output."""
    dropped = set(drop)
    return {**SHARED_HOST_ENV, **{k: v for k, v in os.environ.items() if k not in dropped and k != REPLICA_TOKEN_ENV},
            "PYTHONUNBUFFERED": "1"}


def replica_env(launch: ReplicaLaunch, token: str, drop: Iterable[str]) -> dict[str, str]:
    """A replica process's environment on this host: `worker_env`, the placement's device variables, and the
    launch token it must ask of every request."""
    return {**worker_env(drop), **launch.placement.env, REPLICA_TOKEN_ENV: token}


def read_tail(path: Path | None) -> str:
    """The last TAIL_BYTES of a replica's log file ("" without one)."""
    if path is None:
        return ""
    try:
        with path.open("rb") as log:
            log.seek(max(log.seek(0, os.SEEK_END) - TAIL_BYTES, 0))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux (a `preexec_fn`): the child gets SIGTERM if its parent dies, even by SIGKILL, so no orphan keeps a
    port."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class ProcessHandle:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path | None = None
    token: str | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def exit_code(self) -> int | None:
        return self.process.poll()

    async def stop(self, timeout_s: float) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            await asyncio.wait_for(asyncio.to_thread(self.process.wait), timeout_s)
        except TimeoutError:
            self.process.kill()
            await asyncio.to_thread(self.process.wait)

    def kill(self) -> None:
        """Hard kill (tests use it to simulate a crash)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)

    def output_tail(self) -> str:
        return read_tail(self.log_path)


class LocalLauncher:
    """Spawns `multiserve worker` processes bound to 127.0.0.1 on free ports, from a warm pool of standby workers
    when it keeps one (`warm_workers`, asked at each launch and `fill`)."""

    def __init__(self, host: str = "127.0.0.1", log_dir: Path | None = None, python: str = sys.executable,
                 env_drop: Callable[[], Iterable[str]] = lambda: (), warm_workers: Callable[[], int] = lambda: 0,
                 refill_delay_s: float = 1.0) -> None:
        self.host = host
        self.log_dir = log_dir
        self.python = python
        self.env_drop = env_drop  # asked at each launch: the names can change with the registry
        self.warm_workers = warm_workers
        self.refill_delay_s = refill_delay_s
        self._standby: list[subprocess.Popen[bytes]] = []
        self._spawned = 0
        self._refill: asyncio.TimerHandle | None = None
        self.took_standby = 0  # launches served by a standby worker (for tests and logs)
        self._closed = False  # `close`d: no more standby workers

    def command(self, launch: ReplicaLaunch, port: int) -> list[str]:
        """The worker's command line: the launch as one JSON document (it holds no secret: the token is in the
        environment)."""
        return [self.python, "-m", "multiserve", "worker", "--launch", launch.model_dump_json(), "--host", self.host,
                "--port", str(port)]

    async def start(self, launch: ReplicaLaunch) -> ProcessHandle:
        port = free_port(self.host)
        token = secrets.token_urlsafe(32)
        log_path = self._log_path(f"{launch.model}-{launch.index}.log")
        standby = self._take_standby()
        if standby is not None:
            assignment = StandbyAssignment(launch=launch, host=self.host, port=port, token=token,
                                           log_path=None if log_path is None else str(log_path))
            try:
                assert standby.stdin is not None
                standby.stdin.write(assignment.model_dump_json().encode() + b"\n")
                standby.stdin.close()
            except OSError:  # it died meanwhile: a fresh worker instead
                standby = None
        self._schedule_refill()
        if standby is not None:
            self.took_standby += 1
            return ProcessHandle(f"http://{self.host}:{port}", standby, log_path, token)
        return ProcessHandle(f"http://{self.host}:{port}",
                             self._spawn(self.command(launch, port), replica_env(launch, token, self.env_drop()),
                                         log_path), log_path, token)

    def _log_path(self, name: str) -> Path | None:
        """Where a process's output goes (None: nowhere, without a log directory)."""
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / name

    def _spawn(self, argv: list[str], env: dict[str, str], log_path: Path | None,
               stdin: Any = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        stdout: Any = subprocess.DEVNULL if log_path is None else log_path.open("ab")
        preexec = die_with_parent if sys.platform.startswith("linux") else None
        try:
            return subprocess.Popen(  # our own interpreter and module, no shell
                argv, env=env, stdin=stdin, stdout=stdout, stderr=subprocess.STDOUT, preexec_fn=preexec)
        finally:
            if stdout is not subprocess.DEVNULL:
                stdout.close()

    def _take_standby(self) -> subprocess.Popen[bytes] | None:
        while self._standby:
            process = self._standby.pop(0)
            if process.poll() is None:
                return process
        return None

    def fill(self) -> None:
        """Start standby workers up to `warm_workers()` (and let go of any beyond it)."""
        self._standby = [p for p in self._standby if p.poll() is None]
        wanted = 0 if self._closed else max(self.warm_workers(), 0)
        while len(self._standby) > wanted:
            self._release(self._standby.pop())
        while len(self._standby) < wanted:
            self._spawned += 1
            log_path = self._log_path(f"standby-{self._spawned}.log")
            self._standby.append(self._spawn([self.python, "-m", "multiserve", "worker", "--standby"],
                                             worker_env(self.env_drop()), log_path, stdin=subprocess.PIPE))

    def _schedule_refill(self) -> None:
        if self._closed or self._refill is not None or (self.warm_workers() <= 0 and not self._standby):
            return
        loop = asyncio.get_running_loop()

        def refill() -> None:
            self._refill = None
            self.fill()

        self._refill = loop.call_later(self.refill_delay_s, refill)

    def close(self) -> None:
        """Let the standby workers go (they exit when their standard input closes); none is started after."""
        self._closed = True
        if self._refill is not None:
            self._refill.cancel()
            self._refill = None
        while self._standby:
            self._release(self._standby.pop())

    @staticmethod
    def _release(process: subprocess.Popen[bytes]) -> None:
        try:
            if process.stdin is not None:
                process.stdin.close()
        except OSError:
            pass
        process.terminate()  # a standby has no handler of its own yet: it ends at once
        try:
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class RemoteHandle:
    base_url: str
    pid: int | None = None
    token: str | None = None  # a remote replica's credentials, if any, are in its URL

    def exit_code(self) -> int | None:
        return None

    async def stop(self, timeout_s: float) -> None:
        return None

    def output_tail(self) -> str:
        return ""


class UrlLauncher:
    """Replicas started elsewhere (another host, a Ray cluster): listed by URL in the registry."""

    async def start(self, launch: ReplicaLaunch) -> RemoteHandle:
        if not launch.url:
            raise ValueError(f"model {launch.model!r}: replica {launch.index} has no URL")
        return RemoteHandle(launch.url.rstrip("/"))
