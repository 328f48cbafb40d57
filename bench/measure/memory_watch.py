"""A gateway's memory as it runs, sampled from outside: what it counts resident on each device (its metrics) and its
worker processes' own resident memory (Linux /proc), for the models-on-demand benchmark and end-to-end test."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

HELD_METRIC = "multiserve_gateway_memory_held_bytes"


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc; zombies left out)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def rss_bytes(pid: int) -> int:
    """A process's resident memory (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((x for x in status.splitlines() if x.startswith("VmRSS:")), None)
    return 0 if line is None else int(line.split()[1]) * 1024


class MemoryWatch:
    """While entered, every `interval_s`: the memory the gateway at `url` counts on all its devices, and the number
    and resident memory of the gateway process `pid`'s workers; their peaks."""

    def __init__(self, url: str, pid: int, interval_s: float = 0.05) -> None:
        self.url, self.pid, self.interval_s = url, pid, interval_s
        self.held_peak = 0.0
        self.rss_peak = 0
        self.workers_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._stop.is_set():
                try:
                    families = text_string_to_metric_families(client.get("/metrics").text)
                    held = sum(s.value for f in families for s in f.samples if s.name == HELD_METRIC)
                    self.held_peak = max(self.held_peak, held)
                except httpx.HTTPError:
                    pass
                workers = children_of(self.pid)
                self.workers_peak = max(self.workers_peak, len(workers))
                self.rss_peak = max(self.rss_peak, sum(rss_bytes(p) for p in workers))
                self._stop.wait(self.interval_s)
