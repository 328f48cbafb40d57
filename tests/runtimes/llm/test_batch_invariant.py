"""`engine.deterministic` (runtimes/llm/batch_invariant.py): the fixed-tile dense matmul and the one-kernel Triton
attention give a row the same bits in any batch and at any place in it, decoded or prefilled; `apply` puts a model on
them or refuses, naming the setting; an engine on them gives a greedy request the same tokens alone, batched,
chunked and resumed.

Runs the Triton kernels under the interpreter (TRITON_INTERPRET=1) on CPU tensors: the same programs a GPU runs,
with numpy arithmetic. The interpreter's `tl.dot` is numpy's matmul, whose BLAS (OpenBLAS's sgemm) gives a row
different bits at a different place in the tile; a tensor core's MMA computes each result element from its own row
and column alone. So the interpreter's dot is computed here row by row (`rowwise_dot`), the MMA's property, and the
tests check what is ours: one tile shape whatever the batch, one K order, masks that add exact zeros, one kernel
for decode and prefill. What the tensor cores do is not exercised here."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtimes.llm import batch_invariant
from runtimes.llm.attention import paged_attention_ref, reads_only_device_metadata
from runtimes.llm.attention.cpu_paged import paged_attention_cpu
from runtimes.llm.attention.metadata import AttentionMetadata
from runtimes.llm.attention.triton_paged import paged_attention_triton, paged_attention_triton_invariant
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import run_to_completion
from tests.runtimes.llm.paged_case import paged_case
from tests.runtimes.llm.tiny import loaded_tiny

INTERPRET = os.environ["TRITON_INTERPRET"].lower() not in ("", "0", "false", "off", "no")
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="TRITON_INTERPRET=0 needs a CUDA device")


@pytest.fixture(autouse=True)
def rowwise_dot(monkeypatch):
    """Under the interpreter, `tl.dot` one row of the tile at a time (see the module docstring)."""
    if not INTERPRET:
        return
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    dot = InterpreterBuilder.create_dot

    def rowwise(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = []
        for i in range(a.data.shape[0]):
            one = TensorHandle(a.data[i:i + 1], a.dtype)
            rows.append(dot(self, one, b, TensorHandle(d.data[i:i + 1], d.dtype), input_precision,
                            max_num_imprecise_acc).data)
        return TensorHandle(np.concatenate(rows), d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", rowwise)


# --- the dense matmul -------------------------------------------------------------------------------


def test_dense_matmul_computes_x_times_w_transposed():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=gen).to(DEVICE)
    w = torch.randn(150, 96, generator=gen).to(DEVICE)  # N and K not multiples of the tile
    assert torch.allclose(batch_invariant.dense_matmul(x, w), x @ w.T, atol=1e-4, rtol=1e-5)
    assert batch_invariant.dense_matmul(x[:0], w).shape == (0, 150)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        batch_invariant.dense_matmul(x, w[:, :64])


@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 70), place=st.data())
def test_a_dense_row_has_the_same_bits_alone_and_anywhere_in_any_batch(batch, place):
    gen = torch.Generator().manual_seed(batch)
    w = torch.randn(80, 128, generator=gen).to(DEVICE)
    rows = torch.randn(batch, 128, generator=gen).to(DEVICE)
    at = place.draw(st.integers(0, batch - 1))
    together = batch_invariant.dense_matmul(rows, w)
    alone = batch_invariant.dense_matmul(rows[at:at + 1], w)
    assert torch.equal(together[at], alone[0])


# --- attention: one kernel for every row --------------------------------------------------------------


def _one_sequence(meta: AttentionMetadata, index: int, query_len: int) -> AttentionMetadata:
    """The metadata of sequence `index` alone, computing its last `query_len` tokens."""
    seq_len = meta.seq_lens_host[index]
    table = meta.block_tables[index].tolist()
    return AttentionMetadata.build([query_len], [seq_len], [table], 16, device=DEVICE)


def test_a_token_attends_with_the_same_bits_decoded_prefilled_alone_or_batched():
    """The last token of sequence 1, as the end of its prompt in a mixed batch, as a decode among other decodes, and
    alone: the same bits (the decode kernel is not used)."""
    query_lens, seq_lens = [1, 9, 1, 4], [13, 9, 30, 20]
    query, k_cache, v_cache, meta, valid = paged_case(query_lens, seq_lens, 16, 4, 2, 16, torch.float32,
                                                      device=DEVICE)
    scale = 0.25
    mixed = paged_attention_triton_invariant(query, k_cache, v_cache, meta, scale)
    last_of_prompt = mixed[sum(query_lens[:2]) - 1]
    decode_meta = AttentionMetadata.build([1, 1, 1, 1], seq_lens, [t.tolist() for t in meta.block_tables], 16,
                                          device=DEVICE)
    decodes = query[[0, sum(query_lens[:2]) - 1, 10, 13]]
    batched = paged_attention_triton_invariant(decodes, k_cache, v_cache, decode_meta, scale)
    alone = paged_attention_triton_invariant(decodes[1:2], k_cache, v_cache, _one_sequence(meta, 1, 1), scale)
    assert torch.equal(batched[1], last_of_prompt)
    assert torch.equal(alone[0], last_of_prompt)
    # the reference gathers whole blocks, so it must not see the NaN of slots nobody owns (the kernel never reads them)
    k_ref, v_ref = (torch.where(valid[:, :, None, None], c, 0) for c in (k_cache, v_cache))
    reference = paged_attention_ref(decodes, k_ref, v_ref, decode_meta, scale)
    assert torch.allclose(batched, reference, atol=1e-5)


def test_the_invariant_attention_may_be_captured_in_a_decode_graph():
    assert reads_only_device_metadata(paged_attention_triton_invariant)


# --- apply: what a model runs on -------------------------------------------------------------------


def _tiny(attention_fn):
    loaded = loaded_tiny()
    loaded.model.set_attention(attention_fn)
    return loaded


def test_apply_puts_the_triton_path_on_the_invariant_kernels():
    loaded = _tiny(paged_attention_triton)
    batch_invariant.apply(loaded.model)
    batch_invariant.apply(loaded.model)  # twice: harmless
    layer = loaded.model.layers[0]
    assert layer.self_attn.attention_fn is paged_attention_triton_invariant
    assert all(proj.matmul is batch_invariant.dense_matmul
               for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj))
    assert loaded.model.logits_matmul is batch_invariant.dense_matmul


def test_apply_refuses_dense_weights_on_the_cpu_kernel_and_the_reference_attention():
    with pytest.raises(ValueError, match=r"engine.deterministic: on the CPU .* 9 are dense \(layers.0.qkv_proj"):
        batch_invariant.apply(_tiny(paged_attention_cpu).model)
    loaded = _tiny(paged_attention_ref)
    with pytest.raises(ValueError, match="attention_backend cpu or triton"):
        batch_invariant.apply(loaded.model)
    assert loaded.model.layers[0].self_attn.attention_fn is paged_attention_ref  # unchanged
    with pytest.raises(ValueError, match=r"engine\.deterministic"):
        LLMEngine(_tiny(paged_attention_cpu), EngineConfig(kv_cache_bytes=1 << 22, deterministic=True))


# --- an engine on them ----------------------------------------------------------------------------------


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 9, 30, 7, 2, 11, 40, 3, 8, 21, 17, 6, 1, 33, 12, 19, 4, 27], [7, 8, 9], [60, 61, 62, 63, 64, 65, 66],
           [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]]


@pytest.fixture(scope="module")
def tiny_triton():
    return _tiny(paged_attention_triton)


def _engine(loaded, **overrides) -> LLMEngine:
    options = {"kv_cache_bytes": 1 << 22, "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64,
               "deterministic": True, **overrides}
    return LLMEngine(loaded, EngineConfig(**options))


def test_a_deterministic_engine_gives_the_same_tokens_alone_batched_chunked_and_resumed(tiny_triton):
    alone = {f"r{i}": run_to_completion(_engine(tiny_triton), {"r": (ids, GREEDY)})["r"].token_ids
             for i, ids in enumerate(PROMPTS)}
    batched = run_to_completion(_engine(tiny_triton), {f"r{i}": (ids, GREEDY) for i, ids in enumerate(PROMPTS)})
    assert {key: got.token_ids for key, got in batched.items()} == alone
    chunked = run_to_completion(_engine(tiny_triton, max_num_batched_tokens=5),
                                {f"r{i}": (ids, GREEDY) for i, ids in enumerate(PROMPTS)})
    assert {key: got.token_ids for key, got in chunked.items()} == alone
    rest = dataclasses.replace(GREEDY, max_tokens=3)
    resumed = run_to_completion(_engine(tiny_triton),
                                {f"r{i}": (ids + alone[f"r{i}"][:3], rest) for i, ids in enumerate(PROMPTS)})
    assert {key: got.token_ids for key, got in resumed.items()} == {key: t[3:] for key, t in alone.items()}
