"""The BERT-family encoders teams deploy, as tiny random-weight checkpoints (tests/runtimes/embedding/tiny.py), against
sentence-transformers over the same directory: BGE's CLS pooling and Normalize, E5's and GTE's mean pooling, max
pooling, each activation BERT configs name, RoBERTa / XLM-RoBERTa position ids and checkpoint names, the input limit
and lowercasing sentence-transformers applies; and what the runtime refuses, by name, when it reads a directory."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from runtimes.embedding.config import EmbeddingConfig
from runtimes.embedding.engine import EmbeddingEngine, LoadedEncoder, load_encoder_dir
from runtimes.embedding.inputs import InputProcessor
from runtimes.embedding.model import pool
from runtimes.embedding.model_config import EncoderConfig, PoolingConfig, check_encoder_dir, max_seq_length
from tests.runtimes.embedding.conftest import SENTENCES, long_text
from tests.runtimes.embedding.tiny import TinyEncoder, build

pytestmark = pytest.mark.slow

# Mixed case and lengths from 3 tokens past every model's limit: one padded batch per model
TEXTS = [*SENTENCES, "Paris Is The Capital Of FRANCE", long_text(60)]
TOLERANCE = 1e-5  # max abs difference in fp32

MODELS = {
    # bge-small-en-v1.5: CLS pooling, Normalize, lowercasing asked of sentence-transformers
    "bge": TinyEncoder(pooling={"pooling_mode_cls_token": True}, normalize=True, max_seq_length=24, do_lower_case=True),
    # e5-small-v2: mean pooling, Normalize
    "e5": TinyEncoder(pooling={"pooling_mode_mean_tokens": True}, normalize=True, max_seq_length=32),
    # gte-small: mean pooling, no Normalize; the limit from the tokenizer's model_max_length (512) and positions (64)
    "gte": TinyEncoder(pooling={"pooling_mode_mean_tokens": True}, seed=1),
    # the config sentence-transformers 3+ writes: `pooling_mode` by name
    "max": TinyEncoder(pooling={"pooling_mode": "max"}, seed=2),
    "max-normalized": TinyEncoder(pooling={"pooling_mode": ["max"]}, normalize=True, seed=3),
    "gelu_new": TinyEncoder(hidden_act="gelu_new", seed=4),
    "gelu_pytorch_tanh": TinyEncoder(hidden_act="gelu_pytorch_tanh", seed=5),
    "relu": TinyEncoder(hidden_act="relu", normalize=True, seed=6),
    "roberta": TinyEncoder(model_type="roberta", seed=7),
    # multilingual-e5: XLM-RoBERTa, mean pooling, Normalize
    "multilingual-e5": TinyEncoder(model_type="xlm-roberta", normalize=True, max_seq_length=40, seed=8),
    # bge-m3's dense vectors: XLM-RoBERTa, CLS pooling, Normalize; here from a masked-LM checkpoint (`roberta.`)
    "bge-m3": TinyEncoder(model_type="xlm-roberta", pooling={"pooling_mode_cls_token": True}, normalize=True,
                          prefixed=True, seed=9),
    # a tokenizer that keeps case under do_lower_case: sentence-transformers lowercases, so must we
    "lowercased": TinyEncoder(model_type="xlm-roberta", cased_tokenizer=True, do_lower_case=True, seed=10),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {name: build(spec, root / name) for name, spec in MODELS.items()}


def reference(path: Path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():  # load reports and deprecation chatter are not ours to fix
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(str(path), device="cpu", local_files_only=True)


def load(path: Path) -> LoadedEncoder:
    return load_encoder_dir(path, torch.device("cpu"), torch.float32)


def ours(loaded: LoadedEncoder, texts: list[str]) -> np.ndarray:
    """One padded batch of all `texts`, truncated to the model's limit as sentence-transformers truncates."""
    token_ids = loaded.inputs.prepare(texts, truncate_prompt_tokens=-1).token_ids
    width = max(map(len, token_ids))
    ids = torch.tensor([t + [0] * (width - len(t)) for t in token_ids])  # [B, S]; 0: a placeholder under the mask
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in token_ids])  # [B, S]
    with torch.inference_mode():
        return pool(loaded.model(ids, mask), mask, loaded.pooling).numpy()


@pytest.mark.parametrize("name", list(MODELS))
def test_vectors_match_sentence_transformers(model_dirs, name):
    """In one padded batch and through the engine's length buckets alike; the input limit is sentence-transformers'
    (sentence_bert_config.json's max_seq_length, else the tokenizer's, capped by the position table)."""
    spec, path = MODELS[name], model_dirs[name]
    st = reference(path)
    expected = st.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)  # [N, 32]
    loaded = load(path)
    assert loaded.inputs.limit == st.max_seq_length
    if spec.max_seq_length is not None:
        assert loaded.inputs.limit == spec.max_seq_length
    assert max(len(ids) for ids in loaded.inputs.prepare(TEXTS, -1).token_ids) == loaded.inputs.limit  # truncated
    got = ours(loaded, TEXTS)
    assert got.shape == expected.shape == (len(TEXTS), 32)
    assert np.abs(got - expected).max() < TOLERANCE
    token_ids = loaded.inputs.prepare(TEXTS, -1).token_ids
    engine = EmbeddingEngine(loaded, EmbeddingConfig(device="cpu", min_bucket_len=8))
    assert np.abs(engine.embed(token_ids) - expected).max() < TOLERANCE
    norms = np.linalg.norm(got, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) == spec.normalize


def test_recipes_read_from_the_directories(model_dirs):
    """What each directory's files say, as read: the pooling mode (by flag or by name), Normalize, the limit, and
    RoBERTa's padding_idx and shorter input limit (its first two positions are never an input's)."""
    pooling = {name: PoolingConfig.from_sentence_transformers_dir(path) for name, path in model_dirs.items()}
    assert pooling["bge"] == PoolingConfig("cls", True, 24)
    assert pooling["e5"] == PoolingConfig("mean", True, 32)
    assert pooling["max"] == PoolingConfig("max", False, 512)  # MiniLM's tokenizer_config.json model_max_length
    assert pooling["max-normalized"] == PoolingConfig("max", True, 512)
    assert pooling["bge-m3"] == PoolingConfig("cls", True, 62)
    bert, roberta = EncoderConfig.from_hf_dir(model_dirs["gte"]), EncoderConfig.from_hf_dir(model_dirs["bge-m3"])
    assert (bert.padding_idx, bert.max_input_len, bert.type_vocab_size) == (None, 64, 2)
    assert (roberta.model_type, roberta.padding_idx, roberta.max_input_len, roberta.type_vocab_size) == (
        "xlm-roberta", 1, 62, 1)
    assert load(model_dirs["gte"]).inputs.limit == 64  # the tokenizer's 512, capped by the position table


def test_a_wrong_recipe_would_be_caught(model_dirs):
    """The comparison above has the power to fail: BERT's positions on a RoBERTa model, GELU in place of its tanh
    approximation, and no lowercasing each move the vectors far beyond the tolerance."""
    roberta = load(model_dirs["roberta"])
    expected = ours(roberta, TEXTS)
    roberta.model.embeddings.padding_idx = None  # positions 0, 1, 2, ...
    assert np.abs(ours(roberta, TEXTS) - expected).max() > 100 * TOLERANCE

    tanh = load(model_dirs["gelu_new"])
    expected = ours(tanh, TEXTS)
    for layer in tanh.model.layers:
        layer.act = F.gelu
    assert np.abs(ours(tanh, TEXTS) - expected).max() > 10 * TOLERANCE

    path, capitalised = model_dirs["lowercased"], ["Paris Is The Capital Of FRANCE"]
    as_is = InputProcessor.from_dir(path, 62).prepare(capitalised).token_ids
    assert load(path).inputs.prepare(capitalised).token_ids != as_is


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(("field", "value", "supported"), [
    ("model_type", "deberta-v2", "bert, roberta, xlm-roberta"),
    ("model_type", "nomic_bert", "bert, roberta, xlm-roberta"),
    ("position_embedding_type", "relative_key", "absolute"),
    ("position_embedding_type", "rotary", "absolute"),
    ("hidden_act", "silu", "gelu, gelu_new, gelu_pytorch_tanh, relu"),
    ("hidden_act", "gelu_fast", "gelu, gelu_new, gelu_pytorch_tanh, relu"),
])
def test_other_encoders_are_refused_by_name(model_dirs, field, value, supported):
    cfg = {**_config(model_dirs["gte"]), field: value}
    with pytest.raises(ValueError, match=f"unsupported .*{field} {value!r} \\(supported: {supported}\\)"):
        EncoderConfig.from_hf_config(cfg)


def _with_pooling(path: Path, pooling: dict) -> Path:
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    return path


@pytest.mark.parametrize("pooling", [
    {"pooling_mode": "weightedmean"},
    {"pooling_mode": "lasttoken"},
    {"pooling_mode": ["cls", "mean"]},
    {"pooling_mode_mean_sqrt_len_tokens": True},
    {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},
])
def test_other_pooling_is_refused_by_name(tmp_path, pooling):
    path = build(TinyEncoder(), tmp_path / "model")
    _with_pooling(path, pooling)
    with pytest.raises(ValueError, match=r"unsupported pooling mode .* \(supported: exactly one of cls, mean, max\)"):
        PoolingConfig.from_sentence_transformers_dir(path)
    with pytest.raises(ValueError, match="unsupported pooling mode"):  # before any weight is read
        load(path)


def test_legacy_pooling_with_no_flag_set_is_mean_as_sentence_transformers_reads_it(tmp_path):
    path = _with_pooling(build(TinyEncoder(), tmp_path / "model"), {"pooling_mode_cls_token": False})
    assert PoolingConfig.from_sentence_transformers_dir(path).mode == "mean"


def test_modules_the_runtime_does_not_run_are_refused(tmp_path):
    """A Dense projection after pooling (or any other module) would change the vectors: refused, naming it."""
    path = build(TinyEncoder(), tmp_path / "dense")
    modules = json.loads((path / "modules.json").read_text())
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    (path / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(ValueError, match=r"sentence_transformers.models.Dense \(supported: Transformer, Pooling, "
                                         r"Normalize\)"):
        check_encoder_dir(path)
    (path / "modules.json").write_text(json.dumps(modules[:1]))
    with pytest.raises(ValueError, match="no Pooling module"):
        check_encoder_dir(path)
    moved = [{**modules[0], "path": "0_BERT"}, modules[1]]
    (path / "modules.json").write_text(json.dumps(moved))
    with pytest.raises(ValueError, match="Transformer module's path must be the directory itself"):
        check_encoder_dir(path)


def test_max_seq_length_prefers_sentence_bert_config(tmp_path):
    path = build(TinyEncoder(max_seq_length=16), tmp_path / "model")
    assert max_seq_length(path) == 16  # over the tokenizer's 512
    (path / "sentence_bert_config.json").unlink()
    assert max_seq_length(path) == 512
    (path / "tokenizer_config.json").unlink()
    assert max_seq_length(path) is None
    assert load(path).inputs.limit == 64  # the position table


def test_checkpoint_names_with_a_task_prefix_and_an_lm_head_load(model_dirs):
    from safetensors import safe_open

    with safe_open(str(model_dirs["bge-m3"] / "model.safetensors"), "pt") as handle:
        names = list(handle.keys())
    assert "roberta.embeddings.word_embeddings.weight" in names and any(n.startswith("lm_head.") for n in names)
    assert load(model_dirs["bge-m3"]).model.config.model_type == "xlm-roberta"
