"""Gateway overhead: the latency the gateway adds in front of a fast fake backend, and the rate it holds.

Two subprocesses on loopback: `bench.measure.fake_backend` (a raw ASGI OpenAI stub, no delays) and `multiserve serve`
(the real gateway; registry: one chat model `fake`, `launcher: url` pointing at the stub). This process is
the load generator: one keep-alive client per target (`--client`: httpx.AsyncClient, or the gateway's own lean
`KeepAliveClient`, which leaves the shared cores to the servers), C requests in flight (closed loop), the same
body to both targets. Latency: time.perf_counter around one request until the whole reply is read; streams
also report TTFB (time to the first body chunk).

Scenarios: non-streaming chat at each `--concurrency` (C=1: the pure added latency; higher C: the request
rate) and streaming chat at each `--stream-concurrency`. Per scenario: `--warmup` untimed requests per
target, then `--repeats` x `--requests` timed ones per target in `--chunks` chunks alternating direct and
gateway (the first target alternates per repeat) to cancel drift. Per repeat: p50/p99 per target and
added = gateway - direct; reported: medians over repeats, req/s, and CPU per request (/proc) of the server
process (backend for direct, gateway for gateway) and of this client. All processes share the cores, so at
C>1 the gateway's req/s is a floor and 1e6 / its CPU µs per request the ceiling on a free core.
Goal: added <= 1 ms at p50 and <= 5 ms at p99, non-streaming at C=1.

Results: a markdown table on stdout, a JSON line appended to `--out`. `--profile-gateway [PROF]` runs the
gateway under cProfile and prints its top functions (inflated times, start-up included, and each resumption
of a coroutine counts as a call; use few requests).

    python -m bench.measure.gateway_overhead                                   # 3 repeats x 2000 requests, ~2 min
    python -m bench.measure.gateway_overhead --requests 200 --warmup 50 --repeats 1        # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.measure.timing import machine_info
from bench.stats import nearest_rank
from gateway.httpclient import KeepAliveClient
from gateway.upstream import Timeouts
from model_pool.launcher import die_with_parent, free_port

_REQUEST = {"model": "fake", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
BODY = {False: json.dumps(_REQUEST).encode(), True: json.dumps({**_REQUEST, "stream": True}).encode()}
HEADERS = {"content-type": "application/json"}
MODES = ("direct", "gateway")
GOAL_MS = {"p50": 1.0, "p99": 5.0}
PROFILE_FILTER = r"/(gateway|model_pool|policies)/|starlette|httpx|httpcore|h11|uvicorn|structlog|tenacity|prometheus"
REGISTRY = """gateway: {{host: 127.0.0.1, port: 0}}
models:
  - {{name: fake, type: chat, launcher: url, urls: ["http://127.0.0.1:{port}"], replicas: 1}}
"""


@dataclass
class Samples:
    """One target's timed requests in one repeat of one scenario."""

    latency: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the server process's (backend for direct, gateway for gateway)
    client_cpu_s: float = 0.0  # this process's: the load generator's client


def spawn(cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{url} not ready (exit code {proc.poll()}); log tail:\n{tail}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc, 10 ms ticks; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Client = httpx.AsyncClient | KeepAliveClient


def make_client(kind: str, concurrency: int) -> Client:
    if kind == "keepalive":
        return KeepAliveClient()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=30.0)


async def one_request(client: Client, url: str, stream: bool) -> tuple[float, float]:
    """(latency, ttfb) in seconds; ttfb = latency for non-streaming requests."""
    start = time.perf_counter()
    if isinstance(client, KeepAliveClient):
        reply = await client.post(url, BODY[stream], HEADERS, Timeouts(connect_s=30.0, read_s=30.0))
        ttfb = 0.0
        async for _ in reply.aiter_raw():
            ttfb = ttfb or time.perf_counter() - start
        await reply.aclose()
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status_code}")
        latency = time.perf_counter() - start
        return latency, ttfb if stream else latency
    async with client.stream("POST", url, content=BODY[stream], headers=HEADERS) as response:
        ttfb = 0.0
        async for _ in response.aiter_raw():
            ttfb = ttfb or time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}")
    latency = time.perf_counter() - start
    return latency, ttfb if stream else latency


async def run_chunk(client: Client, url: str, n: int, concurrency: int, stream: bool,
                    pid: int, into: Samples | None) -> None:
    """`n` requests with `concurrency` in flight; recorded into `into` (None: warm-up)."""
    remaining = n
    results: list[tuple[float, float]] = []

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            results.append(await one_request(client, url, stream))

    gc.collect()
    cpu0, client0, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    wall, cpu, own = time.perf_counter() - t0, cpu_seconds(pid) - cpu0, time.process_time() - client0
    if into is not None:
        into.latency += [r[0] for r in results]
        into.ttfb += [r[1] for r in results]
        into.wall_s += wall
        into.cpu_s += cpu
        into.client_cpu_s += own


async def run_scenario(args: argparse.Namespace, stream: bool, concurrency: int, urls: dict[str, str],
                       pids: dict[str, int], bar: tqdm) -> list[dict[str, Samples]]:
    clients = {mode: make_client(args.client, concurrency) for mode in MODES}
    bar.set_postfix_str(f"{'stream' if stream else 'chat'} C={concurrency}")
    try:
        for mode in MODES:
            await run_chunk(clients[mode], urls[mode], args.warmup, concurrency, stream, pids[mode], None)
            bar.update()
        repeats = []
        per_chunk = max(1, args.requests // args.chunks)
        for r in range(args.repeats):
            samples = {mode: Samples() for mode in MODES}
            order = MODES if r % 2 == 0 else MODES[::-1]
            for _ in range(args.chunks):
                for mode in order:
                    await run_chunk(clients[mode], urls[mode], per_chunk, concurrency, stream, pids[mode],
                                    samples[mode])
                    bar.update()
            repeats.append(samples)
        return repeats
    finally:
        for client in clients.values():
            await client.aclose()


def summarize(name: str, concurrency: int, repeats: list[dict[str, Samples]], metric: str) -> dict[str, Any]:
    """One table row: medians over repeats of each target's p50/p99 (ms) and of the per-repeat differences."""
    row: dict[str, Any] = {"scenario": name, "concurrency": concurrency, "metric": metric}
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        per = {m: [nearest_rank(getattr(s[m], metric), q) * 1e3 for s in repeats] for m in MODES}
        for m in MODES:
            row[f"{m}_{label}_ms"] = statistics.median(per[m])
        added = [g - d for g, d in zip(per["gateway"], per["direct"], strict=True)]
        row[f"added_{label}_ms"] = statistics.median(added)
        row[f"added_{label}_ms_per_repeat"] = [round(a, 3) for a in added]
    for m in MODES:
        row[f"{m}_rps"] = statistics.median(len(s[m].latency) / s[m].wall_s for s in repeats)
        row[f"{m}_server_cpu_us_per_req"] = statistics.median(s[m].cpu_s / len(s[m].latency) * 1e6 for s in repeats)
        row[f"{m}_client_cpu_us_per_req"] = statistics.median(s[m].client_cpu_s / len(s[m].latency) * 1e6
                                                              for s in repeats)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| scenario | C | metric | direct p50 | direct p99 | gateway p50 | gateway p99 | added p50 | added p99 "
            "| direct req/s | gateway req/s | backend CPU µs/req | gateway CPU µs/req | client CPU µs/req |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ms = " | ".join(f"{r[k]:.3f}" for k in ("direct_p50_ms", "direct_p99_ms", "gateway_p50_ms", "gateway_p99_ms",
                                                 "added_p50_ms", "added_p99_ms"))
        lines.append(f"| {r['scenario']} | {r['concurrency']} | {r['metric']} | {ms} | {r['direct_rps']:.0f} | "
                     f"{r['gateway_rps']:.0f} | {r['direct_server_cpu_us_per_req']:.0f} | "
                     f"{r['gateway_server_cpu_us_per_req']:.0f} | {r['direct_client_cpu_us_per_req']:.0f} |")
    return "\n".join(lines) + ("\n\n(latencies in ms; added = gateway - direct per repeat, median over repeats; "
                               "CPU per request from /proc, 10 ms ticks; client = this load generator, direct)")


def goal_check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    chat = [r for r in rows if r["scenario"] == "chat"]
    if not chat:
        return {}
    base = min(chat, key=lambda r: r["concurrency"])
    out: dict[str, Any] = {"concurrency": base["concurrency"]}
    for label, limit in GOAL_MS.items():
        out[f"added_{label}_ms"] = round(base[f"added_{label}_ms"], 3)
        out[f"{label}_ok"] = base[f"added_{label}_ms"] <= limit
    return out


def start_servers(args: argparse.Namespace, tmp: Path) -> tuple[list[subprocess.Popen[bytes]], dict[str, str]]:
    backend_port, gateway_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    protocol = ["--protocol"] if args.replica_protocol else []
    procs.append(spawn([sys.executable, "-m", "bench.measure.fake_backend", "--port", str(backend_port), *protocol],
                       tmp / "backend.log"))
    wait_ready(f"http://127.0.0.1:{backend_port}/ready", procs[0], tmp / "backend.log")
    (tmp / "registry.yaml").write_text(REGISTRY.format(port=backend_port))
    prof = ["-m", "cProfile", "-o", str(Path(args.profile_gateway).resolve())] if args.profile_gateway else []
    if args.profile_gateway:
        Path(args.profile_gateway).parent.mkdir(parents=True, exist_ok=True)
    procs.append(spawn([sys.executable, *prof, "-m", "multiserve", "serve", "--config", str(tmp / "registry.yaml"),
                        "--port", str(gateway_port)], tmp / "gateway.log"))
    wait_ready(f"http://127.0.0.1:{gateway_port}/ready", procs[1], tmp / "gateway.log")
    return procs, {mode: f"http://127.0.0.1:{port}/v1/chat/completions"
                   for mode, port in zip(MODES, (backend_port, gateway_port), strict=True)}


async def run_all(args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int]) -> list[dict[str, Any]]:
    scenarios = [(False, c) for c in args.concurrency] + [(True, c) for c in args.stream_concurrency]
    rows = []
    with tqdm(total=len(scenarios) * (2 + 2 * args.repeats * args.chunks), unit="phase", desc="gateway") as bar:
        for stream, concurrency in scenarios:
            repeats = await run_scenario(args, stream, concurrency, urls, pids, bar)
            name = "stream" if stream else "chat"
            rows += [summarize(name, concurrency, repeats, m) for m in (("ttfb", "latency") if stream else
                                                                       ("latency",))]
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="timed requests per target per repeat")
    parser.add_argument("--warmup", type=int, default=200, help="untimed requests per target per scenario")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=4, help="direct/gateway alternations per repeat")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16], help="non-streaming scenarios")
    parser.add_argument("--client", choices=("httpx", "keepalive"), default="httpx",
                        help="the load generator's HTTP client (keepalive: gateway.httpclient, ~20x less CPU)")
    parser.add_argument("--stream-concurrency", type=int, nargs="*", default=[1], help="streaming scenarios")
    parser.add_argument("--replica-protocol", action="store_true",
                        help="the backend answers as a multiserve replica: token ids in streams, whole replies as "
                             "progress (what the gateway then parses and checks)")
    parser.add_argument("--out", default="bench/results/gateway_overhead.jsonl",
                        help="JSON line appended here ('' to skip)")
    parser.add_argument("--profile-gateway", nargs="?", const="bench/results/gateway_overhead.prof", default=None,
                        metavar="PROF", help="run the gateway under cProfile (stats saved to PROF) and print its "
                                             "top functions")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine_info(httpx=httpx.__version__)
    with tempfile.TemporaryDirectory(prefix="gateway-overhead-") as tmpdir:
        tmp = Path(tmpdir)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs, urls = start_servers(args, tmp)
            rows = asyncio.run(run_all(args, urls, {"direct": procs[0].pid, "gateway": procs[1].pid}))
        except Exception:
            log_path = tmp / "gateway.log"
            if log_path.exists():
                print("gateway log tail:\n" + log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
        finally:
            for proc in reversed(procs):
                stop(proc)
        if args.profile_gateway and Path(args.profile_gateway).exists():
            stats = pstats.Stats(args.profile_gateway, stream=sys.stdout)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(PROFILE_FILTER, 40)
    goal = goal_check(rows)
    print(table(rows))
    print(f"\ngoal (non-streaming, C={goal.get('concurrency')}): added p50 {goal.get('added_p50_ms')} ms "
          f"(<= {GOAL_MS['p50']}: {'ok' if goal.get('p50_ok') else 'MISSED'}), added p99 {goal.get('added_p99_ms')}"
          f" ms (<= {GOAL_MS['p99']}: {'ok' if goal.get('p99_ok') else 'MISSED'})")
    record = {"bench": "gateway_overhead", "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              **info, "loadavg_end": os.getloadavg(), "config": {k: v for k, v in vars(args).items() if k != "out"},
              "goal": goal, "results": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with Path(args.out).open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
