"""What the serving checks (check_serve.py, check_vllm.py) share: a process started and always stopped, waiting for
`/ready`, plain HTTP, the processes under a pid or in a process group (/proc), and evidence that processes use the
GPU (nvidia-smi). nvidia-smi helpers answer None or nothing where nvidia-smi is missing or fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from model_pool.launcher import die_with_parent
from tests.gpu.common import timed

ROOT = Path(__file__).resolve().parents[2]


def tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


@contextlib.contextmanager
def process(argv: list[str], log: Path, env: dict[str, str] | None = None,
            stop_timeout_s: float = 30.0) -> Iterator[subprocess.Popen]:
    """Start `argv` in the checkout (its output to `log`); on exit SIGTERM it and wait, SIGKILL after
    `stop_timeout_s`. It gets SIGTERM too if this process is killed outright (run.sh's timeout gives a check 10 s
    after its SIGTERM), so no gateway is left holding the GPU."""
    with log.open("wb") as handle:
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def http(method: str, url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_ready(base: str, proc: subprocess.Popen, log: Path, timeout_s: float, poll_s: float = 0.25) -> float:
    """Seconds until `base`/ready answered 200; raises if `proc` exits first or `timeout_s` passes."""
    with timed() as t:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode} before /ready: {tail(log)}")
            with contextlib.suppress(OSError):
                if http("GET", f"{base}/ready", timeout=2)[0] == 200:
                    break
            time.sleep(poll_s)
        else:
            raise RuntimeError(f"not ready after {timeout_s:.0f} s: {tail(log)}")
    return t["s"]


def _stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name: state, ppid, pgrp, ...) of every process."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                yield int(entry.name), (entry / "stat").read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    return [child for child, fields in _stats() if int(fields[1]) == pid]


def descendants(pid: int) -> list[int]:
    """Every live process under `pid`, at any depth."""
    parents = {child: int(fields[1]) for child, fields in _stats() if fields[0] != "Z"}
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group `pgid`."""
    return sorted(pid for pid, fields in _stats() if int(fields[2]) == pgid and fields[0] != "Z")


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def gpu_memory_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return sum(int(line.strip()) for line in out.splitlines() if line.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def gpu_pids() -> set[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {int(line) for line in out.split() if line.strip().isdigit()}


GPU_DEVICE_FILE = re.compile(r"/dev/nvidia\d+")  # a GPU's own device file, which a CUDA context keeps open


def device_files(pid: int, pattern: re.Pattern[str] = GPU_DEVICE_FILE) -> list[str]:
    """The files matching `pattern` that process `pid` has open (/proc/PID/fd), e.g. the GPUs it holds a context on."""
    opened: set[str] = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if pattern.fullmatch(target):
            opened.add(target)
    return sorted(opened)


def on_device(pids: list[int], before_mib: int | None) -> dict[str, object]:
    """Evidence that `pids` themselves use the GPU: their pids listed by nvidia-smi (not across pid namespaces), or a
    GPU's device file open in one of them (/proc: a CUDA context keeps it open; seen from our pid namespace too). GPU
    memory in use since `before_mib` is reported, never taken as evidence: another process on the host moves it."""
    now = gpu_memory_used_mib()
    delta = None if now is None or before_mib is None else now - before_mib
    listed = sorted(set(pids) & gpu_pids())
    opened = {pid: files for pid in pids if (files := device_files(pid))}
    return {"ok": bool(listed or opened), "pids_listed": listed, "device_files": opened,
            "memory_used_delta_mib": delta}
