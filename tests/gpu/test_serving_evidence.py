"""The serving checks' evidence that a process uses the GPU (tests/gpu/serving.py), without a GPU: the process's own
open device files, never a device-wide rise in memory that another process could have caused."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.gpu import serving


def _holding(path: Path) -> subprocess.Popen:
    """A child process that keeps `path` open until it is killed."""
    code = f"import sys, time\nf = open({str(path)!r})\nprint('open', flush=True)\ntime.sleep(60)\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "open"
    return child


def test_device_files_are_the_matching_files_a_process_holds_open(tmp_path):
    held = tmp_path / "nvidia3"
    held.write_text("")
    child = _holding(held)
    try:
        assert serving.device_files(child.pid, re.compile(re.escape(str(tmp_path)) + r"/nvidia\d+")) == [str(held)]
        assert serving.device_files(child.pid) == []  # no GPU device file
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
    assert serving.device_files(child.pid) == []  # gone


def test_memory_rising_elsewhere_on_the_device_is_no_evidence(monkeypatch, tmp_path):
    """Another process took 500 MiB of the GPU while ours ran without touching it: not on the device."""
    readings = iter([1500])
    monkeypatch.setattr(serving, "gpu_memory_used_mib", lambda: next(readings))
    monkeypatch.setattr(serving, "gpu_pids", lambda: {4242})  # somebody else's
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        found = serving.on_device([idle.pid], before_mib=1000)
    finally:
        idle.kill()
        idle.wait()
    assert found["ok"] is False and found["memory_used_delta_mib"] == 500


def test_a_listed_pid_is_evidence(monkeypatch):
    monkeypatch.setattr(serving, "gpu_memory_used_mib", lambda: None)
    monkeypatch.setattr(serving, "gpu_pids", lambda: {4242})
    assert serving.on_device([4242], before_mib=None)["ok"] is True
