"""Our BERT encoder and pooling against the references: sentence-transformers (vectors) and transformers (states)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from runtimes.embedding.engine import LoadedEncoder
from runtimes.embedding.model import pool
from runtimes.embedding.model_config import EncoderConfig, PoolingConfig
from tests.runtimes.embedding.conftest import SENTENCES, long_text, minilm_dir

pytestmark = pytest.mark.slow


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def ours(loaded: LoadedEncoder, texts: list[str], truncate: int | None = None) -> np.ndarray:
    token_ids = loaded.inputs.prepare(texts, truncate).token_ids
    width = max(map(len, token_ids))
    ids = torch.tensor([t + [0] * (width - len(t)) for t in token_ids])  # [B, S]
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in token_ids])  # [B, S]
    with torch.inference_mode():
        return pool(loaded.model(ids, mask), mask, loaded.pooling).numpy()


def test_pooling_recipe_read_from_the_model_directory(minilm_loaded):
    assert PoolingConfig.from_sentence_transformers_dir(minilm_dir()) == PoolingConfig("mean", True, 256)
    assert minilm_loaded.inputs.limit == 256 and minilm_loaded.model.config.hidden_size == 384


def test_embeddings_match_sentence_transformers(minilm_loaded, st_model):
    texts = [*SENTENCES, long_text()]  # the long one: both truncate to 256 tokens (we only when asked)
    expected = st_model.encode(texts, convert_to_numpy=True, batch_size=4)
    got = ours(minilm_loaded, texts, truncate=-1)
    assert got.shape == expected.shape == (len(texts), 384)
    assert cosine(got, expected).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the Normalize module


def test_hidden_states_match_transformers(minilm_loaded):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.BertModel.from_pretrained(str(minilm_dir()), local_files_only=True).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_dir()), local_files_only=True)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.inference_mode():
        expected = reference(**batch).last_hidden_state  # [B, S, H]
        got = minilm_loaded.model(batch["input_ids"], batch["attention_mask"])
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-4, rtol=1e-4)  # padded rows are never read


@pytest.mark.parametrize("mode", ["cls", "mean", "max"])
def test_pooling_modes_match_sentence_transformers(minilm_loaded, mode):
    from sentence_transformers.models import Normalize, Pooling

    token_ids = minilm_loaded.inputs.prepare(SENTENCES).token_ids
    width = max(map(len, token_ids))
    ids = torch.tensor([t + [0] * (width - len(t)) for t in token_ids])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in token_ids])
    with torch.inference_mode():
        hidden = minilm_loaded.model(ids, mask)
        features = {"token_embeddings": hidden, "attention_mask": mask}
        expected = Normalize()(Pooling(384, pooling_mode=mode)(features))["sentence_embedding"]
        got = pool(hidden, mask, PoolingConfig(mode, normalize=True))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def _write_pooling_dir(tmp_path, flags: dict[str, bool], normalize: bool = False):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **flags}))
    return tmp_path


def test_pooling_config_variants(tmp_path):
    assert PoolingConfig.from_sentence_transformers_dir(tmp_path) == PoolingConfig("mean", False, None)
    cls_dir, bad_dir = tmp_path / "cls", tmp_path / "bad"
    cls_dir.mkdir()
    bad_dir.mkdir()
    _write_pooling_dir(cls_dir, {"pooling_mode_cls_token": True}, normalize=True)
    assert PoolingConfig.from_sentence_transformers_dir(cls_dir) == PoolingConfig("cls", True, None)
    _write_pooling_dir(bad_dir, {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="exactly one of cls, mean, max"):
        PoolingConfig.from_sentence_transformers_dir(bad_dir)


def test_encoder_config_refuses_other_architectures():
    """More of the family, and what is refused, in tests/runtimes/embedding/test_families.py."""
    cfg = json.loads((minilm_dir() / "config.json").read_text())
    assert EncoderConfig.from_hf_config(cfg).head_dim == 32
    with pytest.raises(ValueError, match="model_type 'distilbert'"):
        EncoderConfig.from_hf_config({**cfg, "model_type": "distilbert"})
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key'"):
        EncoderConfig.from_hf_config({**cfg, "position_embedding_type": "relative_key"})
