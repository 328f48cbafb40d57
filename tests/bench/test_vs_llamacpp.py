"""bench.measure.vs_llamacpp without servers: arguments, per-run numbers, medians, ratios, flags and the table."""

import argparse
import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from bench.client import Target
from bench.measure.vs_llamacpp import (
    ENGINE,
    _finite,
    all_flags,
    build_parser,
    closed_loop,
    cpu_model,
    format_table,
    llama_command,
    order_of,
    parse_engine_json,
    parse_streams,
    prompt_token_note,
    run_flags,
    run_stats,
    summarize_level,
    worker_command,
)
from bench.stats import RequestResult


def result(num_output: int, gap_s: float = 0.01, ttft_s: float | None = 0.1, usage: bool = True,
           status: int = 200, error: str | None = None) -> RequestResult:
    return RequestResult(sent_s=0.0, status=status, num_prompt_tokens=31, num_output_tokens=num_output,
                         ttft_s=ttft_s, e2e_s=None if ttft_s is None else ttft_s + gap_s * (num_output - 1),
                         itl_s=[gap_s] * max(num_output - 1, 0),
                         error=error, usage_reported=usage)


def run(server: str, streams: int, repeat: int, tok_s: float, itl_ms: float = 10.0, **extra: object) -> dict:
    return {"server": server, "streams": streams, "repeat": repeat, "output_tok_per_s": tok_s, "itl_p50_ms": itl_ms,
            "ttft_p50_ms": 50.0, "num_requests": 4, "num_errors": 0, "errors": [], "off_length": 0,
            "output_tokens_per_request": {128: 4}, "usage_reported": True, "tokens_per_chunk": 1.0, "wall_s": 1.0,
            "prompt_tokens": [31], "server_cpu_s": {"multiserve": 0.0, "llama.cpp": 0.0, server: 0.9}, **extra}


def test_defaults_and_parsing():
    args = build_parser().parse_args(["--server", "bin/llama-server"])
    assert (args.streams, args.repeats, args.requests_per_stream, args.output_tokens, args.threads) == \
        ([1, 8, 32], 3, 2, 128, 2)
    assert args.engine_json == ENGINE and args.out is None and args.server == Path("bin/llama-server")
    args = build_parser().parse_args(["--server", "s", "--streams", "1,4", "--engine-json", '{"weights": "q8"}'])
    assert args.streams == [1, 4] and args.engine_json == {**ENGINE, "weights": "q8"}
    assert parse_engine_json('{"max_num_seqs": 8}')["max_num_seqs"] == 8
    for bad in ("", "0,1", "a", "1,1", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_streams(bad)
    for bad in ("[1]", "{"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_engine_json(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--streams", "1"])  # --server is required


def test_commands():
    cmd = llama_command(Path("ll"), Path("m.gguf"), 8091, 2, [1, 8, 32])
    assert cmd == ["ll", "-m", "m.gguf", "-c", "16384", "-np", "32", "-t", "2", "--host", "127.0.0.1",
                   "--port", "8091"]
    cmd = llama_command(Path("ll"), Path("m.gguf"), 8091, 4, [64])  # more streams than slots: 512 tokens per slot
    assert cmd[cmd.index("-np") + 1] == "64" and cmd[cmd.index("-c") + 1] == "32768" and cmd[cmd.index("-t") + 1] == "4"
    cmd = worker_command(Path("m.gguf"), 9000, {**ENGINE, "weights": "q8"})
    assert cmd[1:6] == ["-m", "multiserve", "worker", "--source", "m.gguf"]
    assert json.loads(cmd[cmd.index("--engine-json") + 1]) == {"max_num_seqs": 64, "kv_cache_gib": 1, "weights": "q8"}
    assert cmd[-4:] == ["--host", "127.0.0.1", "--port", "9000"]


def test_the_order_alternates_every_repeat():
    assert [order_of(rep) for rep in range(3)] == [("multiserve", "llama.cpp"), ("llama.cpp", "multiserve"),
                                                   ("multiserve", "llama.cpp")]


def test_run_stats_count_tokens_over_wall_time_and_spot_wrong_lengths():
    stats = run_stats([result(16, gap_s=0.01), result(16, gap_s=0.03), result(12)], wall_s=2.0, expected_tokens=16)
    assert stats["output_tokens"] == 44 and stats["output_tok_per_s"] == pytest.approx(22.0)
    assert stats["off_length"] == 1 and stats["output_tokens_per_request"] == {12: 1, 16: 2}
    assert stats["itl_p50_ms"] == pytest.approx(10.0) and stats["ttft_p50_ms"] == pytest.approx(100.0)
    assert stats["tokens_per_chunk"] == pytest.approx(1.0) and stats["usage_reported"]
    failed = run_stats([result(16), result(0, status=500, error="boom", ttft_s=None)], 1.0, 16)
    assert failed["num_errors"] == 1 and failed["errors"] == ["500: boom"] and failed["output_tokens"] == 16
    chunky = result(16)
    chunky.itl_s = chunky.itl_s[:7]  # 8 chunks for 16 tokens
    assert run_stats([chunky], 1.0, 16)["tokens_per_chunk"] == pytest.approx(2.0)


def test_medians_over_repeats_and_the_ratio_of_the_medians():
    runs = [run("multiserve", 8, 0, 100.0, 20.0), run("llama.cpp", 8, 0, 200.0, 10.0),
            run("llama.cpp", 8, 1, 100.0, 12.0), run("multiserve", 8, 1, 90.0, 22.0),
            run("multiserve", 8, 2, 120.0, 30.0), run("llama.cpp", 8, 2, 150.0, 11.0),
            run("multiserve", 1, 0, 1.0), run("llama.cpp", 1, 0, 1.0)]
    row = summarize_level(runs, 8)
    assert row["multiserve"]["output_tok_per_s"] == 100.0 and row["llama.cpp"]["output_tok_per_s"] == 150.0
    assert row["multiserve"]["itl_p50_ms"] == 22.0 and row["llama.cpp"]["itl_p50_ms"] == 11.0
    assert row["ratio"] == pytest.approx(100 / 150)  # of the medians, not the median of the ratios
    assert row["ratios"] == pytest.approx([0.5, 0.9, 0.8])  # paired by repeat
    assert (row["ratio_min"], row["ratio_max"]) == (pytest.approx(0.5), pytest.approx(0.9))
    assert not row["flagged"]
    even = summarize_level([run("multiserve", 4, 0, 10.0), run("llama.cpp", 4, 0, 10.0),
                            run("multiserve", 4, 1, 30.0), run("llama.cpp", 4, 1, 20.0)], 4)
    assert even["multiserve"]["output_tok_per_s"] == 20.0 and even["ratio"] == pytest.approx(20 / 15)


def test_flags():
    assert run_flags(run("multiserve", 1, 0, 10.0), 128) == []
    bad = run("llama.cpp", 4, 1, 10.0, num_errors=1, errors=["0: ReadTimeout"], off_length=2,
              output_tokens_per_request={100: 2, 128: 1}, usage_reported=False, tokens_per_chunk=1.5,
              server_cpu_s={"multiserve": 0.2, "llama.cpp": 1.9})
    flags = run_flags(bad, 128)
    assert len(flags) == 5
    assert "1/4 requests failed: 0: ReadTimeout" in flags[0]
    assert "2 requests did not return exactly 128 tokens" in flags[1] and "100 tokens x2" in flags[1]
    assert "no usage" in flags[2] and "ITL is per chunk" in flags[3]
    assert flags[4].startswith("multiserve, idle, used 0.20 CPU-s (20% of a core)")
    assert all_flags([bad], 128)[0].startswith("llama.cpp streams=4 repeat 1: ")
    row = summarize_level([run("multiserve", 4, 1, 10.0), bad, run("llama.cpp", 4, 0, 20.0)], 4)
    assert row["flagged"] and row["llama.cpp"]["output_tok_per_s"] == 20.0  # the failed run is left out
    assert row["ratios"] == [] and row["ratio"] == 0.5
    assert prompt_token_note([run("multiserve", 1, 0, 1.0), run("llama.cpp", 1, 0, 1.0)]) is None
    note = prompt_token_note([run("multiserve", 1, 0, 1.0), run("llama.cpp", 1, 0, 1.0, prompt_tokens=[32])])
    assert note == "prompt tokens differ: multiserve [31], llama.cpp [32]"


def test_table():
    rows = [summarize_level([run("multiserve", 1, 0, 60.0, 15.04), run("llama.cpp", 1, 0, 80.0, 12.5)], 1),
            summarize_level([run("multiserve", 32, 0, 300.0), run("llama.cpp", 32, 0, 200.0, off_length=1)], 32)]
    lines = format_table(rows).splitlines()
    assert lines[0].startswith("| streams | multiserve tok/s | multiserve ITL p50 ms | llama.cpp tok/s")
    assert lines[2] == "| 1 | 60.0 | 15.0 | 80.0 | 12.5 | **0.75** | 0.75–0.75 |"
    assert lines[3] == "| 32 ! | 300.0 | 10.0 | 200.0 | 10.0 | **1.50** | 1.50–1.50 |"
    missing = summarize_level([run("multiserve", 2, 0, 5.0)], 2)  # a level without llama.cpp runs
    assert format_table([missing]).splitlines()[2] == "| 2 | 5.0 | 10.0 | - | - | **-** | -–- |"


def test_json_helpers(tmp_path: Path):
    assert _finite({"a": [math.nan, 1.0], "b": (2, math.nan), "c": "x"}) == {"a": [None, 1.0], "b": [2, None],
                                                                           "c": "x"}
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t: avx2\n")
    assert cpu_model(info) == "AMD EPYC 7B13"
    assert cpu_model(tmp_path / "absent") is None


def test_the_closed_loop_keeps_exactly_streams_requests_in_flight():
    in_flight, peak, bodies = 0, 0, []

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        bodies.append(json.loads(request.content))
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        n = bodies[-1]["max_tokens"]
        events = [{"choices": [{"text": "x", "index": 0}]}] * n + [{"choices": [], "usage": {
            "prompt_tokens": 5, "completion_tokens": n}}]
        sse = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    target = Target("http://server", "smollm2", endpoint="completions", ignore_eos=True)
    cpu_reads = iter([{"a": 1.0}, {"a": 3.5}])
    results, wall_s, cpu_s = asyncio.run(closed_loop(target, 3, 7, 4, cpu=lambda: next(cpu_reads),
                                                     transport=httpx.MockTransport(handler)))
    assert len(bodies) == 8 and len(results) == 7 and peak == 3  # the warm-up, then 7 with 3 in flight
    assert all(r.ok and r.num_output_tokens == 4 and len(r.itl_s) == 3 for r in results)
    assert wall_s > 0 and cpu_s == {"a": 2.5}
    assert bodies[0]["ignore_eos"] and bodies[0]["stream_options"] == {"include_usage": True}
    assert (bodies[0]["temperature"], bodies[0]["max_tokens"], bodies[0]["stream"]) == (0.0, 4, True)


def test_the_cpu_math_libraries_are_recorded():
    """What torch's CPU math runs on, as its build and runtime report it (recorded with every result)."""
    import torch

    from bench.measure.timing import cpu_math_libraries

    math = cpu_math_libraries()
    assert math["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert math["threads"] == torch.get_num_threads() >= 1
    assert math["blas"] in {"mkl", "open", "openblas", "accelerate", "blis", "generic", "eigen"}  # torch's BLAS_INFO
    assert (math["mkl"] is not None) == torch.backends.mkl.is_available()
