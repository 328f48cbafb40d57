"""Logits of our packed, paged model equal transformers' LlamaForCausalLM on the same weights,
loaded from a safetensors directory and from GGUF files we write (F32 and quantized types)."""

from __future__ import annotations

import pytest
import torch

from runtimes.llm.attention import AttentionMetadata
from runtimes.llm.loader import load_model
from runtimes.llm.model_runner import allocate_kv_caches
from tests.runtimes.llm.tiny import TinySpec, hf_model, roundtrip_weights, save_hf_dir, write_gguf

SPECS = {
    "gqa-tied": TinySpec(num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    "mha-untied": TinySpec(num_heads=4, num_kv_heads=4, tie_word_embeddings=False, rope_theta=500000.0),
    "mqa-3layers": TinySpec(num_heads=4, num_kv_heads=1, num_layers=3, tie_word_embeddings=True),
}
BLOCK_SIZE = 4


def _our_logits(model, config, token_ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Run `token_ids` through our model in the given chunk sizes over a shuffled block table."""
    num_blocks = 64
    caches = allocate_kv_caches(config, num_blocks, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))[:32].tolist()
    logits, start = [], 0
    with torch.inference_mode():
        for size in chunks:
            meta = AttentionMetadata.build([size], [start + size], [table], BLOCK_SIZE)
            ids = torch.tensor(token_ids[start : start + size])
            hidden = model(ids, torch.arange(start, start + size), caches, meta)
            logits.append(model.compute_logits(hidden))
            start += size
    return torch.cat(logits)


def _reference_logits(ref, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([token_ids])).logits[0].float()


TOKENS = [5, 77, 200, 31, 9, 150, 3, 44, 250, 18, 61, 100, 7, 199, 23, 42, 11]


@pytest.mark.parametrize("spec_name", list(SPECS))
def test_safetensors_dir_logits_match(tmp_path, spec_name):
    ref = hf_model(SPECS[spec_name], seed=3)
    loaded = load_model(save_hf_dir(ref, tmp_path), torch.device("cpu"), torch.float32, progress=False)
    expected = _reference_logits(ref, TOKENS)
    # one prefill, chunked prefill, and prefill + token-by-token decode must all agree with the reference
    for chunks in ([len(TOKENS)], [5, 7, 5], [9] + [1] * 8):
        got = _our_logits(loaded.model, loaded.config, TOKENS, chunks)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("spec_name", ["gqa-tied", "mha-untied"])
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_logits_match(tmp_path, spec_name, qtype):
    ref = hf_model(SPECS[spec_name], seed=4)
    path = write_gguf(ref, tmp_path / f"tiny-{qtype}.gguf", qtype)
    loaded = load_model(path, torch.device("cpu"), torch.float32, progress=False)
    assert loaded.config.tie_word_embeddings == SPECS[spec_name].tie_word_embeddings
    assert loaded.config.num_kv_heads == SPECS[spec_name].num_kv_heads
    # The reference sees exactly the weights the file stores (quantization is lossy).
    expected = _reference_logits(roundtrip_weights(ref, qtype), TOKENS)
    got = _our_logits(loaded.model, loaded.config, TOKENS, [6, 1, 1, 9])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_gguf_without_unpermute_would_differ(tmp_path):
    """Guards the Q/K un-permutation: the test above must be able to fail."""
    from runtimes.llm import loader

    ref = hf_model(SPECS["gqa-tied"], seed=5)
    path = write_gguf(ref, tmp_path / "tiny.gguf")
    original = loader.unpermute_qk
    try:
        loader.unpermute_qk = lambda weight, num_heads: weight
        broken = load_model(path, torch.device("cpu"), torch.float32, progress=False)
    finally:
        loader.unpermute_qk = original
    got = _our_logits(broken.model, broken.config, TOKENS, [len(TOKENS)])
    assert not torch.allclose(got, _reference_logits(ref, TOKENS), atol=1e-3)


def test_missing_weight_is_named(tmp_path):
    from safetensors.torch import save_file

    ref = hf_model(SPECS["gqa-tied"], seed=6)
    path = save_hf_dir(ref, tmp_path)
    state = {k: v.contiguous() for k, v in ref.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    state.pop("lm_head.weight", None)
    (path / "model.safetensors").unlink()
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj"):
        load_model(path, torch.device("cpu"), torch.float32, progress=False)


def _random_k_blocks(array, qtype):
    """Random but valid K-quant blocks for a weight of `array`'s shape (gguf-py cannot quantize to K-quants)."""
    import gguf
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES

    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = array.shape
    rng = np.random.default_rng(rows * 7 + cols)
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    scale = np.array([0.004], dtype=np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin lead the block
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = np.array([0.002], dtype=np.float16).view(np.uint8)
    else:  # Q6_K: d ends the block
        blocks[..., -2:] = scale
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_gguf_k_quants_logits_match(tmp_path, qtype):
    from tests.runtimes.llm.tiny import weights_from_gguf

    spec = TinySpec(hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2)  # K-quant rows: 256
    ref = hf_model(spec, seed=8)
    path = write_gguf(ref, tmp_path / f"tiny-{qtype}.gguf", qtype, encode=_random_k_blocks)
    loaded = load_model(path, torch.device("cpu"), torch.float32, progress=False)
    expected = _reference_logits(weights_from_gguf(ref, path), TOKENS)
    got = _our_logits(loaded.model, loaded.config, TOKENS, [10, 7])
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("spec_name", ["gqa-tied", "mha-untied"])
def test_cpu_packed_weights_match_plain(spec_name):
    """On CPU in fp32 the loader gives gate|up and the LM head oneDNN pre-packed copies; batches of
    PACKED_MIN_ROWS rows or more use them, and the logits agree with the plain weights' at every size."""
    from runtimes.llm.model import PACKED_MIN_ROWS
    from tests.runtimes.llm.tiny import loaded_tiny

    loaded = loaded_tiny(SPECS[spec_name], seed=5)
    model = loaded.model
    assert model.packed_lm_head is not None
    assert all(layer.mlp.gate_up_proj.packed is not None for layer in model.layers)
    assert len(TOKENS) >= PACKED_MIN_ROWS
    chunks = [len(TOKENS)], [5, 7, 5], [PACKED_MIN_ROWS] + [1] * (len(TOKENS) - PACKED_MIN_ROWS)
    packed = [_our_logits(model, loaded.config, TOKENS, c) for c in chunks]
    model.packed_lm_head = None
    for layer in model.layers:
        layer.mlp.gate_up_proj.packed = None
    for c, got in zip(chunks, packed, strict=True):
        torch.testing.assert_close(got, _our_logits(model, loaded.config, TOKENS, c), atol=1e-5, rtol=1e-5)
