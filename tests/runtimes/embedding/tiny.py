"""Tiny random-weight BERT-family encoders saved as sentence-transformers directories, built with transformers
itself: the shapes of BGE, E5, GTE (BERT) and multilingual-e5 / bge-m3 (XLM-RoBERTa) at a size a CPU test loads in
milliseconds. Tokenizers come from the installed all-MiniLM-L6-v2: its own for BERT; for RoBERTa the same
WordPiece vocabulary with RoBERTa's special tokens (<s> 0, <pad> 1, </s> 2), so the pad id is RoBERTa's padding_idx.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.runtimes.embedding.conftest import minilm_dir

BERT_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
# MiniLM's ids 0-3 ([PAD], [unused0..2]) renamed: RoBERTa's special tokens at RoBERTa's ids
ROBERTA_SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
VOCAB_SIZE = 30522  # MiniLM's vocabulary


@dataclass(frozen=True)
class TinyEncoder:
    """One test model: the HF config overrides, and the sentence-transformers files around it."""

    model_type: str = "bert"  # bert | roberta | xlm-roberta
    hidden_act: str = "gelu"
    pooling: dict[str, Any] = field(default_factory=lambda: {"pooling_mode_mean_tokens": True})
    normalize: bool = False
    max_seq_length: int | None = None  # sentence_bert_config.json's; None: not written
    do_lower_case: bool = False
    cased_tokenizer: bool = False  # RoBERTa only: a tokenizer that keeps case, so do_lower_case changes its ids
    prefixed: bool = False  # weights saved from the masked-LM model: `bert.` / `roberta.` names and an LM head
    max_position_embeddings: int = 64
    seed: int = 0


def hf_config(spec: TinyEncoder) -> Any:
    import transformers

    # initializer_range well above BERT's 0.02: pre-activations of a few units, where the activations differ
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, hidden_act=spec.hidden_act, initializer_range=0.4,
                  max_position_embeddings=spec.max_position_embeddings)
    if spec.model_type == "bert":
        return transformers.BertConfig(**common)
    kind = transformers.RobertaConfig if spec.model_type == "roberta" else transformers.XLMRobertaConfig
    return kind(**common, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5)


def build(spec: TinyEncoder, path: Path) -> Path:
    """Write the model directory `path` (config.json, model.safetensors, tokenizer, modules) and return it."""
    import torch
    import transformers

    torch.manual_seed(spec.seed)
    config = hf_config(spec)
    base = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}[spec.model_type]
    kind = getattr(transformers, f"{base}ForMaskedLM" if spec.prefixed else f"{base}Model")
    model = kind(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if spec.model_type == "bert":
        for name in BERT_TOKENIZER_FILES:
            shutil.copy(minilm_dir() / name, path / name)
    else:
        write_roberta_tokenizer(path, spec.max_position_embeddings - 2, spec.cased_tokenizer)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **spec.pooling}))
    if spec.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    bert_cfg: dict[str, Any] = {"do_lower_case": spec.do_lower_case}
    if spec.max_seq_length is not None:
        bert_cfg["max_seq_length"] = spec.max_seq_length
    (path / "sentence_bert_config.json").write_text(json.dumps(bert_cfg))
    return path


def write_roberta_tokenizer(path: Path, model_max_length: int, cased: bool = False) -> None:
    """MiniLM's WordPiece vocabulary with RoBERTa's special tokens and post-processing (<s> text </s>); `cased`
    keeps the text's case (capitalised words then become word pieces or <unk>)."""
    from tokenizers import Tokenizer, models, normalizers, processors

    minilm = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    by_id = {i: token for token, i in minilm.get_vocab(with_added_tokens=False).items()}
    by_id.update({i: token for token, i in ROBERTA_SPECIALS.items()})
    tokenizer = Tokenizer(models.WordPiece({token: i for i, token in by_id.items()}, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=False) if cased else minilm.normalizer
    tokenizer.pre_tokenizer = minilm.pre_tokenizer
    tokenizer.decoder = minilm.decoder
    tokenizer.add_special_tokens(list(ROBERTA_SPECIALS))
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>",
        "sep_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": model_max_length}))
