"""`multiserve bench` end to end: a short sweep against a real `multiserve serve` of a tiny model on loopback, then
the history record, `bench compare`, `bench plot` (valid PNGs), and the gateway's traffic log through `profile` and
`plan-capacity`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_pool.launcher import free_port
from multiserve.cli import main
from tests.e2e.conftest import running_gateway
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

pytestmark = pytest.mark.slow

REGISTRY = """\
gateway: {{host: 127.0.0.1, port: {port}, traffic: {{path: {traffic}}}}}
models:
  - name: tiny-chat
    type: chat
    source: {{path: {model}}}
    replicas: 1
    device: cpu
    engine: {{block_size: 16, kv_cache_gib: 0.02, max_model_len: 512, max_num_seqs: 16}}
"""
SPEC = TinySpec(max_position_embeddings=512)
NUM_REQUESTS = 6


def is_png(path: Path) -> bool:
    import matplotlib.image

    image = matplotlib.image.imread(path)
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[0] > 100 and image.shape[1] > 100


def test_bench_against_a_served_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_gguf(hf_model(SPEC, seed=3), tmp_path / "tiny.gguf")
    port, traffic, hist = free_port(), tmp_path / "traffic.jsonl", tmp_path / "history.jsonl"
    registry = REGISTRY.format(port=port, traffic=traffic, model=model)
    bench = ["bench", "--url", f"http://127.0.0.1:{port}/v1", "--model", "tiny-chat", "--workload", "sweep",
             "--concurrency", "1", "3", "--num-requests", str(NUM_REQUESTS), "--warmup", "1", "--prompt-len",
             "fixed:64", "--output-len", "fixed:8", "--ignore-eos", "--slo-ttft", "5000", "--slo-tpot", "1000",
             "--history", str(hist), "--no-progress", "--seed", "4"]
    with running_gateway(tmp_path, registry, port, model):
        assert main(bench) == 0
        assert main([*bench[:-2], "--seed", "5", "--concurrency", "3"]) == 0  # a later run of one configuration

    records = [json.loads(line) for line in hist.read_text().splitlines()]
    assert [r["load"]["label"] for r in records] == ["c=1", "c=3", "c=3"]
    first = records[0]
    assert first["commit"] and len(first["commit"]) == 40 and first["machine"]["cpu_count"]
    assert first["target"]["model"] == "tiny-chat" and first["workload"] == "sweep"
    results = first["results"]
    assert results["num_ok"] == NUM_REQUESTS and results["errors"] == {} and results["usage_reported"]
    assert results["mean_output_tokens"] == 8  # ignore_eos: exactly max_tokens, counted by the server
    assert 48 <= results["mean_prompt_tokens"] <= 80  # the word fit lands near 64 without the tokenizer
    assert 0 < results["ttft_ms"]["p50"] <= results["ttft_ms"]["p99"] < results["e2e_ms"]["p99"]
    assert results["goodput_req_per_s"] > 0 and len(first["samples"]["ttft_ms"]) == NUM_REQUESTS
    assert first["token_fit"]["measured"]

    assert main(["bench", "compare", "--history", str(hist)]) in (0, 1)  # 1 would be a flagged regression
    assert "vs median of 1 earlier run(s)" in capsys.readouterr().out
    assert main(["bench", "plot", "--history", str(hist), "--runs", first["run_id"], records[1]["run_id"],
                 "--out", str(tmp_path / "plots")]) == 0
    assert is_png(tmp_path / "plots" / "latency_cdf.png") and is_png(tmp_path / "plots" / "load_curves.png")

    rows = [json.loads(line) for line in traffic.read_text().splitlines()]
    measured = [r for r in rows if r["usage"] == "reported" and r["output_tokens"] == 8]
    assert len(measured) >= 3 * NUM_REQUESTS and all(r["model"] == "tiny-chat" for r in measured)
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"tiny-chat": {"num_layers": SPEC.num_layers, "num_kv_heads": SPEC.num_kv_heads,
                                                "head_dim": SPEC.hidden_size // SPEC.num_heads,
                                                "weights_bytes": 0, "kv_dtype_bytes": 4}}))
    assert main(["profile", "--traffic", str(traffic), "--model", "tiny-chat", "--shapes", str(shapes)]) == 0
    assert "implied KV cache (512 B/token)" in capsys.readouterr().out  # 2 × 2 layers × 2 heads × 16 × 4 B
    assert main(["plan-capacity", "--model", "tiny-chat", "--profile", str(traffic), "--history", str(hist),
                 "--shapes", str(shapes), "--slo-tpot", "1000"]) == 0
    assert "prefill:decode" in capsys.readouterr().out
