"""registry/engine.py: the KV budget's precedence, decided in one function for the planner, the launch and the
engine (their own tests check each applies it: test_demand.py, test_schema.py, tests/runtimes/llm/test_config.py)."""

from __future__ import annotations

import pytest

from registry.engine import CPU_KV_CACHE_BYTES, kv_cache_budget
from registry.fields import GIB


def test_the_models_kv_size_wins_then_the_plans():
    assert kv_cache_budget(GIB, 2 * GIB) == GIB
    assert kv_cache_budget(GIB, 2 * GIB, device="cuda", free_bytes=lambda: 80 * GIB) == GIB
    assert kv_cache_budget(None, 2 * GIB, device="cpu") == 2 * GIB
    assert kv_cache_budget(None, None) is None  # no device yet: the engine decides when it starts


def test_the_engine_sizes_what_neither_sized_by_its_device():
    assert kv_cache_budget(None, device="cpu") == CPU_KV_CACHE_BYTES == GIB
    assert kv_cache_budget(None, device="mps") == GIB
    assert kv_cache_budget(None, device="cuda", free_bytes=lambda: 10 * GIB, memory_fraction=0.25) == 10 * GIB // 4
    assert kv_cache_budget(None, device="cuda", free_bytes=lambda: 10 * GIB) == 5 * GIB  # half, by default
    assert kv_cache_budget(None, device="cuda", free_bytes=lambda: -GIB) == 0  # over its cap: the engine refuses


def test_the_devices_free_memory_is_asked_only_when_it_decides():
    asked: list[int] = []

    def free() -> int:
        asked.append(1)
        return GIB

    assert kv_cache_budget(4096, device="cuda", free_bytes=free) == 4096
    assert kv_cache_budget(None, 4096, device="cuda", free_bytes=free) == 4096
    assert not asked
    with pytest.raises(ValueError, match="free_bytes"):
        kv_cache_budget(None, device="cuda")
