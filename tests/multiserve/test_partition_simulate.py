"""`multiserve partition simulate` and `partition plan --objective goodput`, on the shipped H200 example."""

from __future__ import annotations

import json

from foundation.config_files import config_path
from multiserve.cli import main
from tests.partitioner.conftest import INVENTORIES

EXAMPLE = config_path("examples", "h200-three-models")
ARGV = ["--config", str(EXAMPLE / "registry.yaml"), "--inventory", str(INVENTORIES / "h200-141gb.json"),
        "--shapes", str(EXAMPLE / "shapes.json"), "--traffic", str(EXAMPLE / "traffic.yaml"), "--duration-s", "5",
        "--drain-s", "5"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["partition", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_ranks_candidates_by_goodput_and_lists_the_infeasible_with_reasons(capsys):
    code, out, err = run(capsys, "simulate", *ARGV)
    assert code == 0, err
    assert out.startswith("#   GOODPUT/S")
    assert "static MIG: mig llama-3b/0=1g.18gb llama-8b/0=1g.35gb qwen-14b/0=3g.71gb (memory-sized)" in out
    assert "best / static MIG goodput: " in out
    assert "not simulated:" in out and "does not fit: GPU 0 (NVIDIA H200): no free slots" in out
    code, out, _ = run(capsys, "simulate", *ARGV, "--json")
    data = json.loads(out)
    ran = [c for c in data if c["error"] is None]
    assert ran and all(set(c["models"]) == {"llama-3b", "llama-8b", "qwen-14b"} for c in ran)
    for c in ran:
        for m in c["models"].values():
            assert m["arrived"] == m["finished"] + m["in_flight"] + m["rejected"]
            assert m["good"] <= m["finished"]


def test_plan_for_goodput_prints_the_best_candidate_and_the_default_objective_is_unchanged(capsys):
    code, out, err = run(capsys, "simulate", *ARGV, "--json")
    ranked = max((c for c in json.loads(out) if c["error"] is None),
                 key=lambda c: (c["goodput_per_s"], c["throughput_per_s"]))
    code, out, err = run(capsys, "plan", *ARGV, "--objective", "goodput")
    assert code == 0, err
    assert out.startswith(f"objective goodput: {ranked['candidate']}: {ranked['goodput_per_s']:.2f} requests/s")
    assert "tree:" in out
    code, default, _ = run(capsys, "plan", *ARGV[:6])
    code, configured, _ = run(capsys, "plan", *ARGV[:6], "--objective", "configured")
    assert default == configured and "MIG 1g.18gb" in default and "objective" not in default


def test_a_bad_traffic_file_exits_2_naming_the_field(capsys, tmp_path):
    bad = tmp_path / "traffic.yaml"
    bad.write_text("models: {llama-3b: {rate_per_s: -1}}\n")
    code, _, err = run(capsys, "simulate", *ARGV[:6], "--traffic", str(bad))
    assert code == 2 and "models.llama-3b.rate_per_s: expected a non-negative number, got -1" in err
    bad.write_text("models: {llama-3b: {rate: 1}}\n")
    code, _, err = run(capsys, "simulate", *ARGV[:6], "--traffic", str(bad))
    assert code == 2 and "unknown field(s) ['models.llama-3b.rate']" in err
