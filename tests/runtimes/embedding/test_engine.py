"""The synchronous engine over the real model: batching invariance, requests spanning batches, window, abort."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from foundation.request_errors import InvalidRequestError
from runtimes.embedding.config import EmbeddingConfig
from runtimes.embedding.engine import EmbeddingEngine
from tests.runtimes.embedding.conftest import MINILM_SOURCE, SENTENCES, long_text


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def mixed_inputs(inputs, count: int = 64) -> list[list[int]]:
    """`count` inputs of many lengths (3 to 256 tokens)."""
    words = long_text().split()
    texts = [" ".join(words[: 1 + (i * 37) % 300]) for i in range(count)]
    return inputs.prepare(texts, truncate_prompt_tokens=-1).token_ids


def test_same_vector_alone_or_in_a_batch_of_64_mixed_lengths(make_engine):
    engine = make_engine(max_batch_size=64)
    batch = mixed_inputs(engine.inputs)
    probe = engine.inputs.prepare([SENTENCES[0]]).token_ids[0]
    batch[17] = probe
    alone = engine.embed([probe])[0]
    together = engine.embed(batch)
    assert engine.stats.num_batches > 2  # the 64 were cut into several length buckets
    np.testing.assert_allclose(together[17], alone, atol=1e-5, rtol=0)
    each = np.stack([engine.embed([ids])[0] for ids in batch[::8]])
    np.testing.assert_allclose(together[::8], each, atol=1e-5, rtol=0)


def test_padding_is_per_bucket(make_engine):
    engine = make_engine()
    batch = mixed_inputs(engine.inputs)
    engine.embed(batch)
    stats = engine.stats
    assert stats.num_inputs == 64 and stats.num_tokens == sum(map(len, batch))
    assert stats.num_padded_tokens < 0.8 * 64 * max(map(len, batch))  # padding all to the longest costs more


def test_window_and_cap_with_a_fake_clock(make_engine):
    clock = FakeClock()
    engine = make_engine(clock=clock, batch_window_s=0.005, max_batch_size=4)
    ids = engine.inputs.prepare(SENTENCES[:5]).token_ids
    engine.add_request("a", ids[:1])
    clock.now += 0.004
    engine.add_request("b", ids[1:2])
    assert engine.step() == [] and engine.batch_wait_s() == pytest.approx(0.001)
    clock.now += 0.001
    assert sorted(out.request_id for out in engine.step()) == ["a", "b"]
    engine.add_request("c", ids[:5])  # over the cap: 4 go at once, the last waits for its window
    assert engine.batch_wait_s() == 0 and engine.step() == []
    clock.now += 0.005
    [out] = engine.step()
    assert out.request_id == "c" and out.embeddings.shape == (5, 384)
    assert out.num_prompt_tokens == sum(map(len, ids))
    np.testing.assert_allclose(out.embeddings, engine.embed(ids), atol=1e-5)  # rows in input order
    assert not engine.has_unfinished_requests()


def test_abort_and_invalid_requests(make_engine):
    engine = make_engine(batch_window_s=0.0)
    ids = engine.inputs.prepare(SENTENCES[:2]).token_ids
    engine.add_request("gone", ids)
    engine.add_request("kept", ids[:1])
    engine.abort_request("gone")
    assert [out.request_id for out in engine.step()] == ["kept"]
    assert engine.stats.num_inputs == 1 and not engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="input must not be empty"):
        engine.add_request("empty", [])
    with pytest.raises(InvalidRequestError, match=r"input\[1\] has 257 tokens; this model takes 1 to 256"):
        engine.add_request("long", [[101], [7] * 257])
    engine.add_request("dup", ids)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", ids)
    with pytest.raises(RuntimeError, match="needs an idle engine"):
        engine.embed(ids)


def test_from_source_and_max_model_len_lowers_the_limit():
    engine = EmbeddingEngine.from_source(MINILM_SOURCE, EmbeddingConfig(device="cpu", max_model_len=64))
    assert engine.max_model_len == 64 and engine.hidden_size == 384
    with pytest.raises(InvalidRequestError, match="over this model's limit of 64"):
        engine.inputs.prepare([list(itertools.repeat(7, 65))])


def _poison(engine, bad_first_token: int):
    """Make encoding raise for any batch holding an input that starts with `bad_first_token`."""
    encode = engine._encode

    def faulty(bucket):
        if any(item.token_ids[1] == bad_first_token for item in bucket.items):  # [1]: after [CLS]
            raise RuntimeError("injected fault")
        return encode(bucket)

    engine._encode = faulty


def test_an_input_that_faults_fails_its_request_only(make_engine):
    engine = make_engine(max_batch_size=64)
    ids = engine.inputs.prepare(SENTENCES).token_ids
    expected = engine.embed(ids)
    bad = engine.inputs.prepare(["zebra crossing"]).token_ids[0]
    _poison(engine, bad[1])
    engine.add_request("good", ids, arrival_time=-1.0)
    engine.add_request("bad", [ids[0], bad], arrival_time=-1.0)
    outputs = {out.request_id: out for out in engine.step()}
    assert outputs["bad"].error_id is not None and outputs["bad"].error_id.startswith("err-")
    assert outputs["good"].error_id is None
    np.testing.assert_allclose(outputs["good"].embeddings, expected, atol=1e-5, rtol=0)
    assert not engine.has_unfinished_requests()


def test_an_engine_that_fails_everything_fails_its_self_check(make_engine):
    from runtimes.fault_isolation import EngineFaultError

    engine = make_engine()
    engine._encode = lambda bucket: (_ for _ in ()).throw(RuntimeError("the device is gone"))
    engine.add_request("r", engine.inputs.prepare(["hello"]).token_ids, arrival_time=-1.0)
    with pytest.raises(EngineFaultError, match="self-check"):
        engine.step()


def test_the_default_dtype_is_half_precision_on_cuda_only():
    import torch

    config = EmbeddingConfig()
    assert config.resolve_dtype(torch.device("cuda", 0)) == torch.float16
    assert config.resolve_dtype(torch.device("cpu")) == torch.float32
    assert EmbeddingConfig(dtype="bfloat16").resolve_dtype(torch.device("cuda", 0)) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be auto, float32"):
        EmbeddingConfig(dtype="int8")


def test_a_request_over_the_token_budget_is_refused_naming_input_the_limit_and_its_count(make_engine):
    engine = make_engine(max_request_tokens=100)
    with pytest.raises(InvalidRequestError, match=r"input has 120 tokens in all \(3 inputs\), over this model's "
                                                  r"limit of 100 tokens per request") as info:
        engine.add_request("big", [[7] * 40] * 3)
    assert info.value.param == "input" and not engine.has_unfinished_requests()
    engine.add_request("fits", [[7] * 50] * 2)  # exactly the budget
    assert EmbeddingConfig().max_request_tokens == 1 << 17
    with pytest.raises(ValueError, match="max_request_tokens must be >= 1"):
        EmbeddingConfig(max_request_tokens=0)


def test_a_request_alone_gets_the_vectors_of_first_come_first_served_chunks_bit_for_bit(make_engine):
    """Turns leave a lone request's cut as it was: chunks of max_batch_size inputs in input order, each cut into
    length buckets (plan_buckets). Same passes, same vectors, to the bit."""
    from runtimes.embedding.batching import BatchItem, plan_buckets

    engine = make_engine(max_batch_size=8)
    ids = mixed_inputs(engine.inputs, count=20)
    expected = np.empty((20, 384), dtype=np.float32)
    for start in range(0, 20, 8):
        chunk = [BatchItem("r", i, ids[i], 0.0) for i in range(start, min(start + 8, 20))]
        for bucket in plan_buckets(chunk, engine.config.max_batch_tokens, engine.config.min_bucket_len):
            expected[[it.index for it in bucket.items]] = engine._encode(bucket)
    np.testing.assert_array_equal(engine.embed(ids), expected)


def test_a_small_request_finishes_between_a_large_ones_chunks(make_engine):
    """A large request arrives first; a one-word request comes while its first chunk runs. The small one is
    encoded in the next chunk's first pass, long before the large one ends, and neither's vectors change."""
    engine = make_engine(max_batch_size=4, batch_window_s=0.0)
    large = engine.inputs.prepare([long_text(60 + i) for i in range(12)], truncate_prompt_tokens=-1).token_ids
    small = engine.inputs.prepare(["hi"]).token_ids
    large_alone, small_alone = engine.embed(large), engine.embed(small)
    passes: list[list[str]] = []
    encode = engine._encode

    def counting(bucket):
        passes.append([item.request_id for item in bucket.items])
        return encode(bucket)

    engine._encode = counting
    engine.add_request("large", large)
    finished: list[str] = []
    finished += [out.request_id for out in engine.step()]  # the large request's first chunk
    engine.add_request("small", small)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished.append(out.request_id)
            outputs[out.request_id] = out
    assert finished == ["small", "large"]
    assert passes.index(["small"]) == 1  # the pass right after the chunk it arrived during
    assert len(passes) > 3  # the large one took several chunks, and the small one ran before most of them
    np.testing.assert_array_equal(outputs["small"].embeddings, small_alone)  # its pass is its own, as alone
    np.testing.assert_allclose(outputs["large"].embeddings, large_alone, atol=1e-5, rtol=0)  # rows in input order
