"""EngineConfig: the registry's engine and queue options (each defined once, in registry/engine.py: name, type,
bound, default, rule) and what only the runtime sets; refused by those rules, naming the field and the limit."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from partitioner.simulate.engine import EngineLimits
from registry.engine import EngineOptions, EngineSpec, QueueOptions
from registry.fields import GIB, MAX_NUM_SEQS
from runtimes.cuda_memory import default_kv_bytes, limit_process_memory
from runtimes.llm import config as config_module
from runtimes.llm.config import KV_DTYPES, EngineConfig
from runtimes.llm.quant.weights import BLOCK_WEIGHTS, FLOAT_WEIGHTS
from tests.runtimes.test_cuda_memory import StrictCuda


def test_the_runtime_the_registry_and_the_simulator_share_one_set_of_defaults():
    config, spec, limits = EngineConfig(), EngineSpec(), EngineLimits()
    assert set(EngineOptions.model_fields) | set(QueueOptions.model_fields) <= set(EngineConfig.model_fields)
    assert {name: getattr(config, name) for name in EngineOptions.model_fields} == \
        {name: getattr(spec, name) for name in EngineOptions.model_fields}
    assert (limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len, limits.block_size) == \
        (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len, config.block_size) == \
        (64, 512, None, 16)


@pytest.mark.parametrize("bad, message", [
    ({"max_num_seqs": 0}, "max_num_seqs\n  Input should be greater than or equal to 1"),
    ({"max_num_seqs": MAX_NUM_SEQS + 1}, f"max_num_seqs\n  Input should be less than or equal to {MAX_NUM_SEQS}"),
    ({"max_num_seqs": "4"}, "max_num_seqs\n  Input should be a valid integer"),
    ({"block_size": 3}, "block_size\n  Value error, must be a power of two, got 3"),
    ({"kv_cache_bytes": 0}, "kv_cache_bytes\n  Input should be greater than 0"),
    ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction\n  Input should be less than or equal to 1"),
    ({"attention_backend": "cuda"}, "attention_backend\n  Input should be 'auto', 'torch', 'cpu' or 'triton'"),
    ({"dtype": "fp32"}, "dtype\n  Input should be 'auto', 'float32', 'float16' or 'bfloat16'"),
    ({"max_num_seq": 4}, "max_num_seq\n  Extra inputs are not permitted"),
])
def test_a_setting_is_refused_by_the_registrys_rule_naming_the_field_and_the_limit(bad, message):
    with pytest.raises(ValidationError) as info:
        EngineConfig(**bad)
    assert message in str(info.value)


def test_a_launchs_options_are_taken_as_the_registry_validated_them():
    engine = EngineSpec(max_num_seqs=8, block_size=8, kv_cache_gib=0.5, weights="q8")
    queue = QueueOptions(scheduling="multilevel", multilevel={"aging_s": 2.0}, max_queue_len=3)
    config = EngineConfig.of(engine, queue, kv_cache_bytes=engine.kv_cache_bytes, device="cpu")
    assert (config.max_num_seqs, config.block_size, config.weights, config.kv_cache_bytes, config.device) == \
        (8, 8, "q8", GIB // 2, "cpu")
    assert config.multilevel_config().aging_s == 2.0 and config.admission_limits().max_queue_len == 3
    with pytest.raises(ValidationError, match="kv_cache_bytes"):  # the runtime's own fields are checked
        EngineConfig.of(engine, queue, kv_cache_bytes=0)


def test_the_registrys_choices_are_the_ones_the_runtime_resolves():
    assert set(get_args(EngineOptions.model_fields["weights"].annotation)) == {"auto", *FLOAT_WEIGHTS, *BLOCK_WEIGHTS}
    assert set(get_args(EngineOptions.model_fields["kv_dtype"].annotation)) == {"auto", *KV_DTYPES}


def test_the_engines_kv_budget_on_its_device(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert EngineConfig().kv_cache_budget(cpu) == GIB
    assert EngineConfig(kv_cache_bytes=1 << 20).kv_cache_budget(cpu) == 1 << 20
    device = StrictCuda(total=80 * GIB, free=70 * GIB, reserved=4 * GIB)
    asked: list[float] = []

    def left_on(on: torch.device, fraction: float) -> int:
        asked.append(fraction)
        return default_kv_bytes(on, fraction, device)

    monkeypatch.setattr(config_module, "default_kv_bytes", left_on)
    assert EngineConfig(kv_cache_bytes=1 << 20).kv_cache_budget(cuda) == 1 << 20 and not asked
    for cap in (None, 0.25, 0.05):  # none; 20 GiB, 4 of them the weights'; 4 GiB, over it already
        if cap is not None:
            limit_process_memory(cap, cuda, device)
        # the fraction of what the process may still take on the device (runtimes/cuda_memory.py)
        assert EngineConfig().kv_cache_budget(cuda) == default_kv_bytes(cuda, 0.5, device)
        assert EngineConfig(kv_cache_memory_fraction=0.25).kv_cache_budget(cuda) == \
            default_kv_bytes(cuda, 0.25, device)
    assert EngineConfig().kv_cache_budget(cuda) == 0 and set(asked) == {1.0}
