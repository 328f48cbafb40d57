"""The planner's memory model of a replica (weights + KV budget + overhead) against the engine's own accounting.

A replica planned onto a GPU gets a KV budget and a memory cap from the plan. Here the same replica is built as its
worker builds it (`worker.engine_config` of its launch, weights loaded in the bf16 a GPU holds them in), on the
CPU, and its tensors are counted: the weights the planner estimated from the file's header are the bytes the loader
holds, the KV budget is the bytes the engine allocates and holds every token it promised, and what the cap leaves
beside them is the overhead the planner set aside. What a CUDA context and a step's activations take of that
overhead needs a GPU: `tests/gpu/check_partitioner.py` measures it there.
"""

from __future__ import annotations

import math

import pytest
import torch

from partitioner.planning.demand import DEFAULT_OVERHEAD_BYTES, DRAFT_ENGINE_OVERHEAD_BYTES
from partitioner.planning.placer import ReplicaPlacer
from partitioner.planning.shapes import estimate_shape
from registry.fields import GIB
from registry.launch import replica_launch
from registry.schema import Registry
from runtimes.llm.attention import select_attention
from runtimes.llm.engine import LLMEngine
from runtimes.llm.loader import load_model
from runtimes.server.worker import engine_config
from tests.partitioner.conftest import gpus
from tests.runtimes.llm.tiny import TinySpec, hf_model, write_gguf

BF16 = torch.bfloat16  # what the runtime holds weights and KV in on a GPU


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(hf_model(TinySpec(max_position_embeddings=512), seed=5),
                      tmp_path_factory.mktemp("memory") / "tiny.gguf")


def placed_engine(tmp_path, model: dict) -> tuple[LLMEngine, object, object]:
    """The engine of replica 0 of `model`, planned onto one H100 and built as its worker would build it (bf16, on
    the CPU), with the plan's entry for it."""
    registry = Registry.model_validate({"models": [{"name": "m", "type": "chat", "device": "cuda", **model}]})
    placer = ReplicaPlacer(lambda: registry, lambda: gpus("h100-80gb"), tmp_path)
    plan = placer.plan_for(registry)
    assert plan is not None
    launch = replica_launch(registry.models[0], 0, placer.place(registry.models[0], 0).placement)
    config = engine_config(launch).model_copy(update={"device": "cpu"})
    loaded = load_model(launch.source, torch.device("cpu"), BF16, select_attention("auto", torch.device("cpu")),
                        progress=False)
    return LLMEngine(loaded, config), plan.replica("m/0"), launch


def weight_bytes(engine: LLMEngine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def kv_bytes(engine: LLMEngine) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)


def test_a_replica_without_a_memory_size_holds_what_the_plan_reserved_for_it(tmp_path, tiny_gguf):
    engine, replica, launch = placed_engine(tmp_path, {
        "source": {"path": str(tiny_gguf)}, "placement": {"isolation": "mps"},
        "engine": {"max_model_len": 200, "block_size": 16}})
    shape = estimate_shape(str(tiny_gguf))
    # weights: the header's parameter count at 2 bytes is what the loader holds
    assert weight_bytes(engine) == shape.weights_bytes
    # KV: the plan's budget (one full-length sequence, in whole blocks) is what the engine allocates, exactly
    assert launch.kv_cache_bytes == replica.kv_cache_bytes == math.ceil(200 / 16) * 16 * shape.kv_bytes_per_token
    assert kv_bytes(engine) == replica.kv_cache_bytes
    assert engine.kv.num_blocks * engine.kv.block_size >= engine.max_model_len == 200
    # the cap: weights + KV + the overhead the planner set aside, as a fraction of the device
    device = gpus("h100-80gb").devices[0].memory_total_bytes
    assert replica.memory_bytes == weight_bytes(engine) + kv_bytes(engine) + DEFAULT_OVERHEAD_BYTES
    assert launch.placement.memory_fraction == pytest.approx(replica.memory_bytes / device, rel=1e-6)


def test_a_memory_size_is_the_cap_and_its_kv_budget_what_the_weights_and_overhead_leave(tmp_path, tiny_gguf):
    """With `placement.memory_gib` and the weights here, the plan checks the size against their header and hands the
    engine the rest after weights and overhead as its KV budget, which is what the engine allocates."""
    engine, replica, launch = placed_engine(tmp_path, {
        "source": {"path": str(tiny_gguf)}, "placement": {"isolation": "mps", "memory_gib": 1.25},
        "engine": {"max_model_len": 200, "block_size": 16}})
    device = gpus("h100-80gb").devices[0].memory_total_bytes
    budget = int(1.25 * GIB) - weight_bytes(engine) - DEFAULT_OVERHEAD_BYTES
    assert replica.memory_bytes == int(1.25 * GIB) and launch.kv_cache_bytes == replica.kv_cache_bytes == budget
    block = engine.kv.block_size * engine.model_config.kv_bytes_per_token(BF16)
    assert budget - block < kv_bytes(engine) <= budget
    assert launch.placement.memory_fraction == pytest.approx(1.25 * GIB / device, rel=1e-6)


def test_the_models_own_kv_cache_size_wins_and_is_what_the_engine_allocates(tmp_path, tiny_gguf):
    engine, replica, launch = placed_engine(tmp_path, {
        "source": {"path": str(tiny_gguf)}, "placement": {"isolation": "mps"},
        "engine": {"max_model_len": 200, "block_size": 16, "kv_cache_gib": 0.01}})
    assert launch.kv_cache_bytes == replica.kv_cache_bytes == int(0.01 * GIB)
    block = engine.kv.block_size * engine.model_config.kv_bytes_per_token(BF16)
    assert int(0.01 * GIB) - block < kv_bytes(engine) <= int(0.01 * GIB)
    assert replica.memory_bytes == weight_bytes(engine) + int(0.01 * GIB) + DEFAULT_OVERHEAD_BYTES


def test_a_replica_with_a_draft_model_holds_what_the_plan_reserved_for_both(tmp_path, tiny_gguf):
    """Speculative decoding with a draft model: the plan adds the draft's weights and a KV cache of as many blocks as
    the model's, and the replica's two engines hold exactly that."""
    draft_file = write_gguf(hf_model(TinySpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                              max_position_embeddings=512), seed=6), tmp_path / "draft.gguf")
    registry = Registry.model_validate({"models": [
        {"name": "m", "type": "chat", "device": "cuda", "source": {"path": str(tiny_gguf)},
         "placement": {"isolation": "mps"},
         "engine": {"max_model_len": 200, "block_size": 16,
                    "speculative": {"method": "draft", "draft_model": "d"}}},
        {"name": "d", "type": "chat", "replicas": 0, "source": {"path": str(draft_file)}}]})
    placer = ReplicaPlacer(lambda: registry, lambda: gpus("h100-80gb"), tmp_path)
    plan = placer.plan_for(registry)
    assert plan is not None and placer.problems(registry) == []
    replica = plan.replica("m/0")
    launch = replica_launch(registry.models[0], 0, placer.place(registry.models[0], 0).placement, registry)
    config = engine_config(launch).model_copy(update={"device": "cpu"})
    cpu = torch.device("cpu")
    loaded, draft = (load_model(source, cpu, BF16, select_attention("auto", cpu), progress=False)
                     for source in (launch.source, launch.draft_source))
    engine = LLMEngine(loaded, config, draft=draft)
    assert engine.speculation is not None
    draft_engine = engine.speculation.proposer.engine  # type: ignore[attr-defined]
    shape, draft_shape = estimate_shape(str(tiny_gguf)), estimate_shape(str(draft_file))
    assert weight_bytes(draft_engine) == draft_shape.weights_bytes
    assert draft_engine.kv.num_blocks == engine.kv.num_blocks  # as many tokens as the model's cache
    assert kv_bytes(draft_engine) == engine.kv.num_blocks * 16 * draft_shape.kv_bytes_per_token
    assert launch.kv_cache_bytes == replica.kv_cache_bytes == kv_bytes(engine) == 208 * shape.kv_bytes_per_token
    assert replica.memory_bytes == (weight_bytes(engine) + kv_bytes(engine) + weight_bytes(draft_engine)
                                    + kv_bytes(draft_engine) + DEFAULT_OVERHEAD_BYTES + DRAFT_ENGINE_OVERHEAD_BYTES)
