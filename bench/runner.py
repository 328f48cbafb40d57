"""One `multiserve bench` invocation: calibrate prompt lengths, run each load level, summarize, append to history."""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import history
from bench.arrivals import TraceEntry
from bench.client import Target, prompt_tokens_of
from bench.loadgen import LoadGenerator, LoadSpec, http_sender
from bench.prompts import PROBE_WORDS, TokenFit, words_text
from bench.stats import summarize
from bench.workloads import PlannedRequest, Workload, plan_from_trace, plan_requests
from partitioner.simulate.workload import Slo


@dataclass(frozen=True)
class BenchConfig:
    target: Target
    workload: Workload
    loads: Sequence[LoadSpec]
    num_requests: int  # measured requests per load level (a trace: its length)
    seed: int = 0
    slo: Slo = field(default_factory=Slo)
    history_path: Path | None = history.DEFAULT_HISTORY
    tag: str | None = None  # a free label kept in the record (e.g. "prefix-caching-on")
    trace: Sequence[TraceEntry] | None = None
    request_timeout_s: float = 600.0
    progress: bool = True


class BenchError(Exception):
    """The benchmark cannot run (the server is unreachable or refuses the probe); the message says why."""


async def calibrate(http: httpx.AsyncClient, target: Target, rng: random.Random) -> TokenFit:
    """Measure the server's tokens per word with two probe prompts; the default fit when it reports no usage."""
    probes = []
    for num_words in PROBE_WORDS:
        try:
            tokens = await prompt_tokens_of(http, target, words_text(num_words, rng))
        except httpx.HTTPStatusError as err:
            raise BenchError(f"{target.request_url} refused the {num_words}-word calibration probe with "
                             f"{err.response.status_code}: {err.response.text[:300]}") from err
        except httpx.HTTPError as err:
            raise BenchError(f"cannot reach {target.request_url}: {err!r}") from err
        if tokens is None:
            return TokenFit()
        probes.append((num_words, tokens))
    try:
        return TokenFit.from_probes(probes)
    except ValueError:  # a server whose usage does not track the prompt (a fake): lengths are then approximate
        return TokenFit()


def plan_level(config: BenchConfig, load: LoadSpec, fit: TokenFit) -> list[PlannedRequest]:
    """Warm-up plus measured requests; the same seed at every level, so levels differ only in load."""
    rng = random.Random(config.seed)
    if config.trace is not None:
        warm = plan_requests(config.workload, load.num_warmup, fit, rng, config.seed)
        return warm + plan_from_trace(config.trace, fit, rng)
    return plan_requests(config.workload, load.num_warmup + config.num_requests, fit, rng, config.seed)


def record_config(config: BenchConfig, load: LoadSpec, fit: TokenFit, sweep_id: str) -> dict[str, Any]:
    target = config.target
    return {
        "target": {"url": target.url, "model": target.model, "endpoint": target.endpoint,
                   "ignore_eos": target.ignore_eos},
        "workload": config.workload.name,
        "lengths": [{"weight": c.weight, "prompt": c.prompt_len.parameters(), "output": c.output_len.parameters()}
                    for c in config.workload.components]
        if config.trace is None else "trace",
        "num_documents": config.workload.num_documents,
        "load": {**dataclasses.asdict(load), "label": load.label},
        "num_requests": config.num_requests,
        "slo": {"ttft_ms": _ms(config.slo.ttft_s), "tpot_ms": _ms(config.slo.tpot_s)},
        "seed": config.seed, "tag": config.tag, "sweep_id": sweep_id,
        "token_fit": dataclasses.asdict(fit),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


async def run_bench(config: BenchConfig, clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    """Run every load level in order; returns the history records (also appended to `config.history_path`)."""
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    records = []
    sweep_id = uuid.uuid4().hex[:8]
    # trust_env off: a proxy from the environment must not sit between the benchmark and a loopback server
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as http:
        fit = await calibrate(http, config.target, random.Random(config.seed))
        for load in config.loads:
            generator = LoadGenerator(http_sender(http, config.target, clock), clock=clock, progress=config.progress)
            outcome = await generator.run(plan_level(config, load, fit), load,
                                          random.Random(f"{config.seed}/arrivals"))
            summary = summarize(outcome.results, outcome.duration_s, config.slo)
            samples = history.latency_samples(outcome.results, random.Random(config.seed))
            record = history.make_record(record_config(config, load, fit, sweep_id), summary, samples)
            if config.history_path is not None:
                history.append(config.history_path, record)
            records.append(record)
    return records


def format_record(record: dict[str, Any]) -> str:
    """A few lines a person reads after a run."""
    res = record["results"]
    ttft, tpot, itl, e2e = res["ttft_ms"], res["tpot_ms"], res["itl_ms"], res["e2e_ms"]
    lines = [
        f"run {record['run_id']}  {record['workload']}  {record['load']['label']}  tag={record.get('tag')}",
        f"  requests {res['num_ok']}/{res['num_requests']} ok in {res['duration_s']:.1f} s: "
        f"{res['request_per_s']:.2f} req/s, {res['output_tok_per_s']:.1f} output tok/s, "
        f"goodput {res['goodput_req_per_s']:.2f} req/s ({res['slo_attainment']:.0%} within SLO)",
        "  ms        p50      p90      p99     mean",
    ]
    for name, stats in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("e2e", e2e)):
        lines.append(f"  {name:6}" + "".join(f"{stats[k]:9.1f}" for k in ("p50", "p90", "p99", "mean")))
    if res["errors"]:
        lines.append(f"  errors by status: {res['errors']}")
    if not record["token_fit"]["measured"]:
        lines.append("  note: prompt lengths approximate (the server's usage did not measure tokens per word)")
    if not res["usage_reported"]:
        lines.append("  note: the server sent no usage; output tokens counted as content chunks")
    return "\n".join(lines)
