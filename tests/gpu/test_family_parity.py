"""The model check's families part (tests/gpu/family_parity.py) as the CPU dry run runs it: Mistral's window and
Qwen3-MoE's stacked experts through the engine pass against transformers, and each verdict fails on what it exists to
catch (a model without the window, a grouped GEMM that is off)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported

from pathlib import Path

import pytest

from runtimes.llm import triton_experts
from tests.gpu import family_parity
from tests.gpu.common import Reporter
from tests.runtimes.llm.families import hf_family_model, save_family_dir


def results(out: Path) -> dict[str, dict]:
    lines = (out / "model.jsonl").read_text().splitlines()
    return {record["name"]: record for record in map(json.loads, lines)}


def test_mistral_with_its_window_passes_and_without_it_fails(tmp_path, monkeypatch):
    rep = Reporter("model", tmp_path)
    family_parity.check_family(rep, "mistral", "cpu", tmp_path)
    passed = results(tmp_path)["model.families.mistral"]
    assert passed["ok"] and passed["layer_windows"] == [7, 7] and passed["graph_replays"] >= 8
    assert all(row["equal"] and row["logprob_max_err"] <= family_parity.LOGPROB_TOL for row in passed["prompts"])
    # the engine's model loses the window (transformers keeps it): tokens or logprobs part, and no window is in force
    monkeypatch.setattr(family_parity, "save_family_dir", lambda ref, path: save_family_dir(
        hf_family_model("mistral", seed=1, sliding_window=None), path))
    rep = Reporter("model", tmp_path)
    family_parity.check_family(rep, "mistral", "cpu", tmp_path / "no-window")
    failed = results(tmp_path)["model.families.mistral"]
    assert not failed["ok"] and failed["layer_windows"] == []
    assert any(not row["equal"] or row["logprob_max_err"] > family_parity.LOGPROB_TOL for row in failed["prompts"])
    assert rep.failed == ["model.families.mistral"]


def test_the_mixture_runs_its_stacked_experts_through_the_grouped_gemm(tmp_path):
    rep = Reporter("model", tmp_path)
    family_parity.check_family(rep, "qwen3_moe", "cpu", tmp_path)
    record = results(tmp_path)["model.families.qwen3_moe"]
    assert record["ok"] and record["experts_stacked"] is True
    assert all(row["equal"] for row in record["prompts"])


@pytest.mark.parametrize(("scale", "ok"), [(1.0, True), (1.01, False)])
def test_a_grouped_gemm_off_by_one_percent_fails(tmp_path, monkeypatch, scale, ok):
    import torch

    grouped = triton_experts.grouped_experts
    monkeypatch.setattr(triton_experts, "grouped_experts", lambda *args, **kw: grouped(*args, **kw) * scale)
    rep = Reporter("model", tmp_path)
    rep.guarded("experts.fp32", lambda: family_parity.check_grouped_experts(rep, torch.float32, "cpu"))
    record = results(tmp_path)["model.experts.fp32"]
    assert record["ok"] is ok and set(record["tokens"]) == {"1", "9"}
