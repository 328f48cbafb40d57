"""Sliding-window attention: each backend keeps a query at position p to the keys at (p - window, p] and reads no
block wholly before its window; a family's layer windows are read as transformers applies them. And Gemma 2's
soft-capped scores (softcap * tanh(s / softcap)) in every backend, with a window or without."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels' import (tests/conftest.py sets it too)

import pytest
import torch

from runtimes.llm.attention.cpu_paged import load_kernel, paged_attention_cpu
from runtimes.llm.attention.metadata import AttentionMetadata
from runtimes.llm.attention.reference import paged_attention_ref
from runtimes.llm.attention.triton_paged import paged_attention_triton, paged_attention_triton_invariant
from runtimes.llm.model_config import ModelConfig, gguf_model_config
from tests.runtimes.llm.paged_case import paged_case

SCENARIOS = {  # (query_lens, seq_lens)
    "decode": ([1, 1, 1, 1, 1], [40, 3, 17, 64, 90]),
    "prefill": ([30, 77], [30, 77]),
    "chunked": ([8, 17, 20], [20, 50, 75]),
    "mixed": ([1, 9, 1, 4], [13, 9, 30, 20]),
}


def _dense(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float, window: int, softcap: float = 0.0) -> torch.Tensor:
    """Row by row from the definition: softmax over the keys at (p - window, p] (scores capped with a `softcap`),
    in fp64."""
    out = torch.empty(query.shape, dtype=torch.float64)
    block_size, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        table = meta.block_tables[i].tolist()
        for r in range(q_len):
            p = s_len - q_len + r
            seen = range(max(0, p + 1 - window) if window else 0, p + 1)
            k = torch.stack([k_cache[table[t // block_size], t % block_size] for t in seen]).double()
            v = torch.stack([v_cache[table[t // block_size], t % block_size] for t in seen]).double()
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [t, H, D]
            scores = torch.einsum("hd,thd->ht", query[start + r].double(), k) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            weights = scores.softmax(-1)
            out[start + r] = torch.einsum("ht,thd->hd", weights, v)
        start += q_len
    return out


def _free_blocks_before_windows(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                                window: int) -> None:
    """NaN in each sequence's blocks that lie wholly before its first new token's window (as if handed back to the
    pool and reused): a backend that reads one returns NaN."""
    if not window:
        return
    block_size = k_cache.shape[1]
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        first = max(0, s_len - q_len + 1 - window)
        for b in meta.block_tables[i, : first // block_size].tolist():
            k_cache[b] = v_cache[b] = float("nan")


BACKENDS = {
    "reference": paged_attention_ref,
    "cpu": paged_attention_cpu,
    "triton": paged_attention_triton,
    "triton-invariant": paged_attention_triton_invariant,
}


# Triton's interpreter is slow: two windows there (one under a block, one over several); a cap with no window and
# with one
CASES = [(backend, window, scenario, 0.0) for backend in BACKENDS for window in (1, 5, 16, 37) for scenario in SCENARIOS
         if "triton" not in backend or window in (5, 37)]
CASES += [(backend, window, scenario, 0.7) for backend in BACKENDS for window in (0, 5) for scenario in SCENARIOS]


@pytest.mark.parametrize(("backend", "window", "scenario", "softcap"), CASES)
def test_every_backend_keeps_to_the_window(scenario: str, window: int, backend: str, softcap: float) -> None:
    if backend == "cpu":
        load_kernel()
    query_lens, seq_lens = SCENARIOS[scenario]
    # block_size 16 and head_dim 16: the Triton prefill kernel's tl.dot path
    query, k_cache, v_cache, meta, _ = paged_case(query_lens, seq_lens, 16 if "triton" in backend else 4, 4, 2,
                                                      16, torch.float32, seed=window)
    expected = _dense(query, k_cache, v_cache, meta, 0.25, window, softcap)
    if softcap:  # the cap changes the result: a backend that ignored it could not pass
        assert (expected - _dense(query, k_cache, v_cache, meta, 0.25, window)).abs().max() > 1e-2
    _free_blocks_before_windows(k_cache, v_cache, meta, window)
    if backend == "reference":  # its batched decodes read (and mask) padding blocks, so it must not see NaN
        k_cache, v_cache = (c.nan_to_num(0.0) for c in (k_cache, v_cache))
    got = BACKENDS[backend](query, k_cache, v_cache, meta, 0.25, window=window, softcap=softcap)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("window", [0, 5])
def test_a_capped_row_is_the_same_decoded_or_prefilled(window: int) -> None:
    """The C++ kernel with a softcap: each row of a 40-token prompt prefilled whole is the bits that row gets decoded
    (its query alone over the same cache)."""
    load_kernel()
    gen = torch.Generator().manual_seed(3)
    length, block_size = 40, 4
    query = torch.randn(length, 4, 16, generator=gen)
    k_cache, v_cache = (torch.randn(length // block_size, block_size, 2, 16, generator=gen) for _ in range(2))
    table = list(range(length // block_size))
    whole = paged_attention_cpu(query, k_cache, v_cache,
                                AttentionMetadata.build([length], [length], [table], block_size), 0.25, window, 0.7)
    for p in range(length):
        meta = AttentionMetadata.build([1], [p + 1], [table[: p // block_size + 1]], block_size)
        row = paged_attention_cpu(query[p : p + 1], k_cache, v_cache, meta, 0.25, window, 0.7)
        assert torch.equal(row[0], whole[p]), p


def test_a_window_as_long_as_the_context_is_no_window() -> None:
    load_kernel()
    query, k_cache, v_cache, meta, _ = paged_case(*SCENARIOS["mixed"], 4, 4, 2, 16, torch.float32)
    whole = paged_attention_cpu(query, k_cache, v_cache, meta, 0.25)
    assert torch.equal(paged_attention_cpu(query, k_cache, v_cache, meta, 0.25, window=max(meta.seq_lens_host)),
                       whole)


# ---- the layer windows a config gives ----

_BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


@pytest.mark.parametrize(("extra", "windows"), [
    ({"model_type": "mistral", "sliding_window": 64}, (64, 64, 64, 64)),
    ({"model_type": "mistral", "sliding_window": None}, ()),
    ({"model_type": "mistral", "sliding_window": 4096}, ()),  # no shorter than the context: no window
    ({"model_type": "phi3", "sliding_window": 100}, (100, 100, 100, 100)),
    ({"model_type": "qwen2", "sliding_window": 64}, ()),  # Qwen only with use_sliding_window
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2},
     (0, 0, 64, 64)),
    ({"model_type": "qwen3", "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"] * 2},
     (32, 0, 32, 0)),
])
def test_layer_windows_are_read_as_transformers_applies_them(extra: dict, windows: tuple[int, ...]) -> None:
    config = ModelConfig.from_hf_config({**_BASE, **extra})
    assert config.layer_windows == windows
    assert config.sliding_window == (min(windows) if windows and all(windows) else 0)


@pytest.mark.parametrize(("extra", "field"), [
    ({"sliding_window": -4}, "sliding_window"),
    ({"sliding_window": 8, "layer_types": ["sliding_attention"]}, "layer_types"),
    ({"sliding_window": 8, "layer_types": ["chunked_attention"] * 4}, "layer_types"),
])
def test_bad_windows_are_refused_by_name(extra: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config({**_BASE, "model_type": "mistral", **extra})


def test_a_gguf_window_applies_to_every_layer() -> None:
    meta = {"general.architecture": "phi3", "phi3.block_count": 3, "phi3.context_length": 4096,
            "phi3.embedding_length": 64, "phi3.feed_forward_length": 128, "phi3.attention.head_count": 4,
            "phi3.attention.sliding_window": 2047, "phi3.vocab_size": 100}
    assert gguf_model_config(meta, has_output=True).layer_windows == (2047, 2047, 2047)
    meta["phi3.attention.sliding_window"] = 4096
    assert gguf_model_config(meta, has_output=True).layer_windows == ()


# ---- the engine: blocks behind every layer's window go back to the pool ----


def _run(engine, request_id: str, prompt: list[int], params) -> tuple[list[int], list[int], int]:
    """(tokens, blocks held after each step, most prompt tokens served from the prefix cache) of one request."""
    engine.add_request(request_id, prompt, params)
    tokens, held, cached = [], [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
        held.append(engine.kv.num_blocks - engine.kv.num_free_blocks)
    return tokens, held, cached


def test_the_engine_frees_blocks_behind_the_window_and_stays_exact(tmp_path) -> None:
    """A Mistral-layout model with a 7-token window, a 23-token prompt prefilled in chunks of 8 and 20 tokens out:
    in a KV cache of 8 blocks of 4 tokens, which could not hold the 43-token request whole, it is accepted and its
    greedy tokens are transformers', holding only the blocks its window and a step span while it runs. In a larger
    cache its released blocks stay indexed: the prompt sent again hits them (the hits behind its window named, not
    taken) and gets the same tokens. Every block is back in the pool at the end."""
    from runtimes.llm.attention import select_attention
    from runtimes.llm.config import EngineConfig
    from runtimes.llm.engine import LLMEngine
    from runtimes.llm.loader import load_model
    from runtimes.llm.sampling_params import SamplingParams
    from tests.runtimes.llm.engine_utils import random_prompt
    from tests.runtimes.llm.families import hf_family_model, save_family_dir

    ref = hf_family_model("mistral", seed=4, sliding_window=7)
    ref.generation_config.eos_token_id = None
    loaded = load_model(save_family_dir(ref, tmp_path / "m"), torch.device("cpu"), torch.float32,
                        select_attention("cpu", torch.device("cpu")), progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = random_prompt(5, 23)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    # a block: 2 layers x K and V x 2 KV heads x 16 dims x 4 bytes x 4 tokens = 2 KiB
    small = LLMEngine(loaded, EngineConfig(kv_cache_bytes=16 << 10, block_size=4, max_num_batched_tokens=8))
    assert (small.kv.window, small.kv.num_blocks) == (7, 8)
    assert small.kv.blocks_at_most(43) == 5  # (7 - 1 + 8) tokens over 4-token blocks, one more for an offset
    tokens, held, _ = _run(small, "a", prompt, params)
    assert tokens == expected
    assert max(held) <= 5, held  # a whole request would hold up to 11 blocks
    assert small.kv.num_free_blocks == small.kv.num_blocks

    large = LLMEngine(loaded, EngineConfig(kv_cache_bytes=64 << 10, block_size=4, max_num_batched_tokens=8))
    first, _, _ = _run(large, "a", prompt, params)
    again, held, cached = _run(large, "b", prompt, params)
    assert cached >= 20  # the prompt's whole blocks, released behind the window as the first request ran
    assert max(held) <= 5, held
    assert first == again == expected
    assert large.kv.num_free_blocks == large.kv.num_blocks
