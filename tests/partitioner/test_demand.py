"""Replica demands from the registry: memory = weights + KV budget (+ overhead), KV bytes from the model's shape."""

from __future__ import annotations

import json

import pytest

from partitioner.planning.demand import DRAFT_ENGINE_OVERHEAD_BYTES, ModelShape, load_shapes, replica_demands
from partitioner.planning.plan import InfeasiblePlan
from registry.fields import GIB, MIB
from registry.schema import Registry

# Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 weights (8.03 B parameters)
LLAMA3_8B = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, weights_bytes=16_060_000_000, context_len=8192)
OVERHEAD = 512 * MIB


def registry(*models: dict) -> Registry:
    base = {"type": "chat", "source": {"path": "/m.gguf"}}
    return Registry.model_validate({"models": [{**base, **m} for m in models]})


def test_kv_bytes_per_token_is_2_layers_kv_heads_head_dim_dtype():
    assert LLAMA3_8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert ModelShape(30, 3, 64, weights_bytes=0, kv_dtype_bytes=1).kv_bytes_per_token == 11520


def test_memory_is_weights_plus_kv_budget_plus_overhead():
    reg = registry({"name": "llama", "replicas": 2, "placement": {"isolation": "mps", "sm_percent": 40, "weight": 2},
                    "engine": {"kv_cache_gib": 4}})
    demands = replica_demands(reg, {"llama": LLAMA3_8B}, overhead_bytes=OVERHEAD)
    assert [d.replica_id for d in demands] == ["llama/0", "llama/1"]
    d = demands[0]
    assert d.kv_cache_bytes == 4 * GIB and d.memory_bytes == LLAMA3_8B.weights_bytes + 4 * GIB + OVERHEAD
    assert (d.isolation, d.sm_percent, d.weight, d.device) == ("mps", 40, 2.0, "auto")


def test_without_a_kv_budget_one_max_length_sequence_is_reserved():
    reg = registry({"name": "llama", "engine": {"max_model_len": 1000, "block_size": 16}})
    (d,) = replica_demands(reg, {"llama": LLAMA3_8B}, overhead_bytes=0)
    assert d.kv_cache_bytes == 1008 * 128 * 1024  # 1000 tokens rounded up to whole 16-token blocks
    assert d.memory_bytes == LLAMA3_8B.weights_bytes + d.kv_cache_bytes


def test_a_sliding_window_on_every_layer_reserves_the_window_and_one_step_not_the_whole_sequence():
    """Mistral-7B's shape with its 4096-token window in a 32768-token context: a sequence holds only the blocks that
    span its window and one step's new tokens (the engine hands back the ones behind it), so that is the reservation;
    a window longer than that span changes nothing."""
    mistral = ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, weights_bytes=14_480_000_000,
                         context_len=32768, sliding_window=4096)
    reg = registry({"name": "m", "engine": {"block_size": 16, "max_num_batched_tokens": 512}})
    (d,) = replica_demands(reg, {"m": mistral}, overhead_bytes=0)
    blocks = -(-(4096 - 1 + 512) // 16) + 1  # 289, where the whole sequence would take 2048
    assert d.kv_cache_bytes == blocks * 16 * mistral.kv_bytes_per_token
    (whole,) = replica_demands(reg, {"m": ModelShape(32, 8, 128, 14_480_000_000, context_len=32768)},
                               overhead_bytes=0)
    assert whole.kv_cache_bytes == 32768 * mistral.kv_bytes_per_token > 7 * d.kv_cache_bytes
    reg = registry({"name": "m", "engine": {"block_size": 16, "max_model_len": 1000}})
    (short,) = replica_demands(reg, {"m": mistral}, overhead_bytes=0)
    assert short.kv_cache_bytes == 1008 * mistral.kv_bytes_per_token


def test_memory_gib_is_the_whole_budget_and_leaves_the_rest_to_kv():
    reg = registry({"name": "llama", "placement": {"memory_gib": 24}})
    (d,) = replica_demands(reg, {"llama": LLAMA3_8B}, overhead_bytes=OVERHEAD)
    assert d.memory_bytes == 24 * GIB
    assert d.kv_cache_bytes == 24 * GIB - LLAMA3_8B.weights_bytes - OVERHEAD


def test_memory_gib_without_a_shape_is_taken_as_given_and_unknown_stays_unknown():
    reg = registry({"name": "a", "placement": {"memory_gib": 3}, "engine": {"kv_cache_gib": 1}},
                   {"name": "b", "engine": {"kv_cache_gib": 1}})
    a, b = replica_demands(reg)
    assert (a.memory_bytes, a.kv_cache_bytes) == (3 * GIB, GIB)
    assert (b.memory_bytes, b.kv_cache_bytes) == (None, GIB)


def test_embedding_models_have_no_kv_cache():
    reg = registry({"name": "e", "type": "embedding", "engine": {"max_num_seqs": 8}})  # an encoder takes no KV options
    (d,) = replica_demands(reg, {"e": ModelShape(6, 12, 32, weights_bytes=90 * MIB)}, overhead_bytes=OVERHEAD)
    assert d.kv_cache_bytes is None and d.memory_bytes == 90 * MIB + OVERHEAD


def test_disabled_scaled_to_zero_and_remote_models_ask_nothing():
    reg = registry({"name": "off", "enabled": False}, {"name": "zero", "replicas": 0},
                   {"name": "remote", "launcher": "url", "urls": ["http://h:1"], "source": None},
                   {"name": "on", "device": "cpu"})
    assert [(d.replica_id, d.device) for d in replica_demands(reg)] == [("on/0", "cpu")]


def test_contradicting_numbers_are_refused_by_how_much():
    reg = registry({"name": "small", "placement": {"memory_gib": 16}, "engine": {"kv_cache_gib": 4}},
                   {"name": "tiny-kv", "engine": {"kv_cache_gib": 0.5, "max_model_len": 8192}})
    with pytest.raises(InfeasiblePlan) as exc:
        replica_demands(reg, {"small": LLAMA3_8B, "tiny-kv": LLAMA3_8B}, overhead_bytes=OVERHEAD)
    first, second = exc.value.problems
    assert first.startswith("models[0] small: placement.memory_gib 16.00 GiB cannot hold weights 14.96 GiB")
    assert "short by 3.46 GiB" in first
    assert second.startswith("models[1] tiny-kv: a KV cache of 0.50 GiB holds less than one 8192-token sequence")
    assert "short by 0.50 GiB" in second


def test_shapes_file(tmp_path):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"llama": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
                                          "weights_bytes": 16_060_000_000, "context_len": 8192}}))
    assert load_shapes(path) == {"llama": LLAMA3_8B}
    path.write_text(json.dumps({"llama": {"layers": 32}}))
    with pytest.raises(ValueError, match=r"llama: unknown field\(s\) \['layers'\]"):
        load_shapes(path)


# Llama-3.2-1B as a draft of Llama-3-8B: 16 layers, 8 KV heads of 64, bf16 weights (1.24 B parameters)
LLAMA32_1B = ModelShape(num_layers=16, num_kv_heads=8, head_dim=64, weights_bytes=2_471_000_000, context_len=8192)


def drafting(**target: object) -> Registry:
    return registry({"name": "llama", "engine": {"speculative": {"method": "draft", "draft_model": "draft"},
                                                 **target.pop("engine", {})}, **target},  # type: ignore[dict-item]
                    {"name": "draft", "replicas": 0})


def test_a_draft_model_adds_its_weights_and_a_kv_cache_of_as_many_tokens():
    """The draft runs inside the model's replicas: its weights, its engine's overhead and a KV cache holding the same
    tokens as the model's (at the draft's bytes per token: 16 layers x 8 KV heads x 64 x 2 x 2 bytes, a quarter of
    the 8B's)."""
    (d,) = replica_demands(drafting(engine={"kv_cache_gib": 4}), {"llama": LLAMA3_8B, "draft": LLAMA32_1B},
                           overhead_bytes=OVERHEAD)
    tokens = 4 * GIB // LLAMA3_8B.kv_bytes_per_token
    assert LLAMA32_1B.kv_bytes_per_token * 4 == LLAMA3_8B.kv_bytes_per_token
    assert d.kv_cache_bytes == 4 * GIB  # the model's own budget, as the engine is given it
    assert d.memory_bytes == (LLAMA3_8B.weights_bytes + 4 * GIB + OVERHEAD + LLAMA32_1B.weights_bytes
                              + DRAFT_ENGINE_OVERHEAD_BYTES + tokens * LLAMA32_1B.kv_bytes_per_token)
    (plain,) = replica_demands(registry({"name": "llama", "engine": {"kv_cache_gib": 4}}), {"llama": LLAMA3_8B},
                               overhead_bytes=OVERHEAD)
    assert d.memory_bytes - plain.memory_bytes == LLAMA32_1B.weights_bytes + DRAFT_ENGINE_OVERHEAD_BYTES + GIB


def test_the_draft_kv_is_in_the_model_kv_dtype_and_whole_blocks_of_it():
    fp8 = ModelShape(32, 8, 128, LLAMA3_8B.weights_bytes, kv_dtype_bytes=1, context_len=8192)
    (d,) = replica_demands(drafting(engine={"max_model_len": 1000}), {"llama": fp8, "draft": LLAMA32_1B},
                           overhead_bytes=0)
    assert d.kv_cache_bytes == 1008 * fp8.kv_bytes_per_token  # one sequence, 63 blocks of 16
    assert d.memory_bytes == (fp8.weights_bytes + d.kv_cache_bytes + LLAMA32_1B.weights_bytes
                              + DRAFT_ENGINE_OVERHEAD_BYTES + 1008 * 16 * 8 * 64 * 2)


def test_memory_gib_is_shared_by_the_model_and_draft_caches_by_bytes_per_token():
    (d,) = replica_demands(drafting(placement={"memory_gib": 24}), {"llama": LLAMA3_8B, "draft": LLAMA32_1B},
                           overhead_bytes=OVERHEAD)
    rest = 24 * GIB - LLAMA3_8B.weights_bytes - LLAMA32_1B.weights_bytes - DRAFT_ENGINE_OVERHEAD_BYTES - OVERHEAD
    assert d.memory_bytes == 24 * GIB
    assert d.kv_cache_bytes == rest * 4 // 5  # the draft's tokens cost a quarter of the model's
    draft_kv = d.kv_cache_bytes // (16 * LLAMA3_8B.kv_bytes_per_token) * 16 * LLAMA32_1B.kv_bytes_per_token
    assert rest - 16 * LLAMA3_8B.kv_bytes_per_token < d.kv_cache_bytes + draft_kv <= rest


def test_a_draft_of_unknown_size_leaves_the_replica_unknown_and_a_memory_size_that_cannot_hold_it_is_refused():
    (unknown,) = replica_demands(drafting(engine={"kv_cache_gib": 4}), {"llama": LLAMA3_8B}, overhead_bytes=0)
    assert (unknown.memory_bytes, unknown.kv_cache_bytes) == (None, 4 * GIB)
    (given,) = replica_demands(drafting(placement={"memory_gib": 20}), {"llama": LLAMA3_8B}, overhead_bytes=0)
    assert given.memory_bytes == 20 * GIB  # taken as given, as for a model of unknown weights
    with pytest.raises(InfeasiblePlan) as exc:
        replica_demands(drafting(placement={"memory_gib": 16}), {"llama": LLAMA3_8B, "draft": LLAMA32_1B},
                        overhead_bytes=OVERHEAD)
    (problem,) = exc.value.problems
    assert problem == ("models[0] llama: placement.memory_gib 16.00 GiB cannot hold weights 14.96 GiB + draft model "
                       "2.55 GiB + overhead 0.50 GiB, before any KV cache: short by 2.01 GiB")
