"""Engine behaviour on a tiny random model: invariance under batching, preemption, chunking and prefix
caching; no block leaks; n > 1; stop strings; refusals at submission."""

from __future__ import annotations

import pytest
import torch

from foundation.request_errors import InvalidRequestError
from runtimes.llm.config import EngineConfig, resolve_kv_dtype
from runtimes.llm.detokenizer import IncrementalDetokenizer
from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams
from tests.runtimes.llm.engine_utils import assert_no_leak, random_prompt, run_to_completion

KV_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K+V x layers x kv heads x head_dim x fp32 bytes (TinySpec defaults)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)


_prompt = random_prompt


def _mixed_requests(count: int) -> dict[str, tuple[list[int], SamplingParams]]:
    requests = {}
    for i in range(count):
        params = GREEDY if i % 2 else SamplingParams(temperature=0.8, seed=100 + i, max_tokens=5 + i % 13,
                                                     ignore_eos=True)
        requests[f"r{i}"] = (_prompt(i, 3 + (i * 7) % 60), params)
    return requests


@pytest.fixture
def engine_for(tiny_loaded):
    loaded = tiny_loaded(seed=0)

    def make(**overrides: object) -> LLMEngine:
        config = {"kv_cache_bytes": 2048 * KV_PER_TOKEN, "block_size": 4, "max_num_batched_tokens": 64,
                  "max_num_seqs": 32, **overrides}
        return LLMEngine(loaded, EngineConfig(**config))

    return make


def test_batch_invariance(engine_for):
    target = {"g": (_prompt(99, 17), GREEDY), "s": (_prompt(99, 17), SEEDED)}
    alone = run_to_completion(engine_for(), target)
    crowd_engine = engine_for()
    crowd = run_to_completion(crowd_engine, {**_mixed_requests(30), **target})
    assert crowd["g"].token_ids == alone["g"].token_ids
    assert crowd["s"].token_ids == alone["s"].token_ids
    assert len(alone["g"].token_ids) == 20
    assert_no_leak(crowd_engine)


def test_preemption_invariance(engine_for):
    requests = {f"p{i}": (_prompt(i, 20 + i), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
                for i in range(8)}
    requests["seeded"] = (_prompt(50, 12), SEEDED)
    roomy = run_to_completion(engine_for(), requests)
    tight_engine = engine_for(kv_cache_bytes=40 * 4 * KV_PER_TOKEN)  # 40 blocks of 4: far less than 8 x 60
    tight = run_to_completion(tight_engine, requests)
    assert tight_engine.scheduler.num_preemptions > 0
    for key in requests:
        assert tight[key].token_ids == roomy[key].token_ids, key
    assert_no_leak(tight_engine)


@pytest.mark.parametrize("budget", [1, 5, 16, 512])
def test_chunked_prefill_invariance(engine_for, budget):
    requests = {f"c{i}": (_prompt(i, 10 + 13 * i), GREEDY) for i in range(4)}
    reference = run_to_completion(engine_for(max_num_batched_tokens=4096), requests)
    engine = engine_for(max_num_batched_tokens=budget)
    chunked = run_to_completion(engine, requests)
    for key in requests:
        assert chunked[key].token_ids == reference[key].token_ids
    assert_no_leak(engine)


def test_prefix_cache_invariance_and_hits(engine_for):
    shared = _prompt(1234, 40)
    requests = {f"x{i}": (shared + _prompt(i, 1 + i), GREEDY) for i in range(6)}
    uncached = run_to_completion(engine_for(enable_prefix_caching=False), requests)
    engine = engine_for()
    first = run_to_completion(engine, {"x0": requests["x0"]})  # computes and caches the shared prefix
    rest = run_to_completion(engine, {k: v for k, v in requests.items() if k != "x0"})
    assert engine.kv.stats.hit_tokens >= 5 * 40 - 5 * 4  # every later request hit (nearly) all the prefix
    assert all(r.num_cached_tokens > 0 for r in rest.values())
    assert first["x0"].token_ids == uncached["x0"].token_ids
    for key, got in rest.items():
        assert got.token_ids == uncached[key].token_ids
    assert_no_leak(engine)


def test_abort_mid_prefill_and_mid_decode_frees_blocks(engine_for):
    engine = engine_for(max_num_batched_tokens=8)
    engine.add_request("long", _prompt(1, 60), GREEDY)  # needs 8 steps of prefill
    engine.add_request("short", _prompt(2, 4), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.add_request("keep", _prompt(3, 5), GREEDY)
    engine.step()
    engine.step()
    long_req = engine.scheduler.requests["long"]
    assert 0 < long_req.num_computed_tokens < 60  # mid-prefill
    outs = engine.abort_request("long")
    assert [o.finish_reason for o in outs] == ["abort"]
    assert "long" not in engine.kv.block_tables
    for _ in range(3):
        engine.step()
    assert engine.scheduler.requests["short"].num_output_tokens > 0  # mid-decode
    engine.abort_request("short")
    assert "short" not in engine.kv.block_tables
    rest = run_to_completion(engine, {})
    assert len(engine.scheduler.requests) == 0
    assert rest["keep"].finish_reason == "length"
    assert_no_leak(engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_share_prompt_blocks(engine_for, prefix_caching):
    engine = engine_for(enable_prefix_caching=prefix_caching)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    prompt = _prompt(5, 33)
    got = run_to_completion(engine, {"multi": (prompt, params)})
    assert sorted(got) == ["multi#0", "multi#1", "multi#2"]
    assert len({tuple(g.token_ids) for g in got.values()}) == 3  # different seeds, different samples
    # samples 1 and 2 reuse sample 0's full prompt blocks instead of recomputing them
    assert got["multi#1"].num_cached_tokens == got["multi#2"].num_cached_tokens == 32
    # sample i uses seed + i: reproducible on its own
    alone = run_to_completion(engine_for(), {"one": (prompt, SamplingParams(temperature=1.0, seed=12, max_tokens=12,
                                                                              ignore_eos=True))})
    assert alone["one"].token_ids == got["multi#1"].token_ids
    assert_no_leak(engine)


def test_stop_string_is_excluded_and_matched_across_tokens(engine_for):
    prompt = _prompt(8, 9)
    free = run_to_completion(engine_for(), {"a": (prompt, GREEDY)})["a"]
    text = free.text
    assert len(text) >= 6
    stop = text[3:6]  # spans several byte-level tokens
    stopped = run_to_completion(
        engine_for(),
        {"a": (prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=(stop,)))},
    )["a"]
    assert stopped.text == text[: text.index(stop)]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop


def test_stop_token_ids_and_logprobs(engine_for):
    prompt = _prompt(9, 7)
    free = run_to_completion(engine_for(), {"a": (prompt, GREEDY)})["a"]
    stop_token = free.token_ids[4]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(stop_token,), logprobs=3)
    got = run_to_completion(engine_for(), {"a": (prompt, params)})["a"]
    first = free.token_ids.index(stop_token)
    assert got.token_ids == free.token_ids[: first + 1]
    assert got.finish_reason == "stop" and got.stop_reason == stop_token
    assert len(got.logprobs) == len(got.token_ids)
    for entry, token in zip(got.logprobs, got.token_ids, strict=True):
        assert entry.token_id == token
        assert entry.top[0][0] == token  # greedy: the sampled token is the most likely one
        assert len(entry.top) == 3 and entry.logprob <= 0.0


def test_refusals_name_the_limit(engine_for):
    engine = engine_for(max_model_len=64)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64") as err:
        engine.add_request("too-long", _prompt(1, 60), SamplingParams(max_tokens=10))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        engine.add_request("prompt-too-long", _prompt(1, 64), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, 259\)"):
        engine.add_request("bad-token", [1, 2, 999], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    small = engine_for(kv_cache_bytes=8 * 4 * KV_PER_TOKEN)  # 8 blocks of 4 = 32 tokens
    with pytest.raises(InvalidRequestError, match="KV cache holds at most 32 tokens"):
        small.add_request("kv", _prompt(1, 20), SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequestError, match="n must be in"):
        SamplingParams(n=1000)
    # the engine still serves after refusals
    assert run_to_completion(engine, {"ok": (_prompt(1, 5), GREEDY)})["ok"].finish_reason == "length"
    assert_no_leak(engine)
    assert_no_leak(small)


def test_max_tokens_defaults_to_context_left(engine_for):
    engine = engine_for(max_model_len=32)
    got = run_to_completion(engine, {"a": (_prompt(1, 20), SamplingParams(temperature=0.0, max_tokens=None,
                                                                           ignore_eos=True))})["a"]
    assert len(got.token_ids) == 12 and got.finish_reason == "length"


def test_an_fp16_cache_holds_twice_the_tokens_and_decodes_alike(engine_for):
    """kv_dtype fp16 on an fp32 model: the same budget gives twice the blocks, the cache is fp16, and the batch's
    greedy outputs stay those of the fp32 cache (the tiny model's logits are far from ties)."""
    requests = {name: (prompt, GREEDY) for name, (prompt, _) in _mixed_requests(6).items()}
    wide, half = engine_for(), engine_for(kv_dtype="fp16")
    assert half.kv.num_blocks == 2 * wide.kv.num_blocks
    assert half.runner.kv_caches[0][0].dtype == torch.float16
    expected, got = run_to_completion(wide, requests), run_to_completion(half, requests)
    same = sum(got[name].token_ids == expected[name].token_ids for name in requests)
    assert same >= len(requests) - 1, (same, len(requests))
    assert_no_leak(half)


def test_kv_dtype_is_checked_where_it_is_chosen():
    with pytest.raises(ValueError, match=r"kv_dtype\n  Input should be 'auto', 'fp32', 'bf16', 'fp16' or 'fp8' "
                                         r"\[type=literal_error, input_value='fp4'"):
        EngineConfig(kv_dtype="fp4")
    cuda = torch.device("cuda", 0)
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match=r"kv_dtype 'fp16' on CUDA: the cache must be in the model's dtype"):
        resolve_kv_dtype("fp16", torch.bfloat16, cuda)
    assert resolve_kv_dtype("fp16", torch.float32, torch.device("cpu")) == torch.float16
    assert resolve_kv_dtype("fp8", torch.bfloat16, cuda) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"kv_dtype 'fp8' on cpu: only the CUDA attention reads an fp8 cache"):
        resolve_kv_dtype("fp8", torch.float32, torch.device("cpu"))


# --- resuming a request another replica started ------------------------------------------------------------


def _streamed(engine: LLMEngine, params: SamplingParams, tokens: list[int]) -> str:
    """The text a stream had shown after `tokens` (a character split over tokens shows once it is whole)."""
    detokenizer = IncrementalDetokenizer(engine.tokenizer, stop=params.stop)
    return "".join(detokenizer.add(t) for t in tokens)


def _resume(engine: LLMEngine, prompt: list[int], params: SamplingParams, done: list[int]):
    engine.add_request("resumed", prompt, params, resume_token_ids=done)
    return run_to_completion(engine, {})["resumed"]


@pytest.mark.parametrize("params", [
    GREEDY,
    SEEDED,
    SamplingParams(temperature=1.1, seed=3, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
                   min_tokens=15, max_tokens=18, stop_token_ids=(5, 6, 7)),
], ids=["greedy", "seeded", "penalties-min-tokens"])
def test_resumed_request_continues_exactly(engine_for, params):
    """Given the first k tokens as already generated, a request produces exactly the rest of the undisturbed run:
    its tokens, its text (and none of the first k's), its finish reason; the usage it reports counts all of them."""
    prompt = _prompt(7, 23)
    whole = run_to_completion(engine_for(), {"w": (prompt, params)})["w"]
    assert len(whole.token_ids) >= 10
    for k in (1, 6, len(whole.token_ids) - 1):
        engine = engine_for()
        rest = _resume(engine, prompt, params, whole.token_ids[:k])
        assert rest.token_ids == whole.token_ids[k:], k
        assert rest.finish_reason == whole.finish_reason
        assert _streamed(engine, params, whole.token_ids[:k]) + rest.text == whole.text
        assert_no_leak(engine)


def test_resume_keeps_a_stop_string_that_spans_the_break(engine_for):
    prompt = _prompt(14, 19)
    engine = engine_for()
    free = run_to_completion(engine, {"f": (prompt, GREEDY)})["f"]
    cut = 12
    shown = len(_streamed(engine, GREEDY, free.token_ids[:cut]))
    stop = free.text[shown - 2 : shown + 2]  # half before the break, half after
    assert free.text.index(stop) == shown - 2  # its first match is there
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=(stop,))
    whole = run_to_completion(engine_for(), {"w": (prompt, params)})["w"]
    assert whole.finish_reason == "stop" and whole.text == free.text[: shown - 2]
    rest = _resume(engine, prompt, params, free.token_ids[:cut])
    assert rest.finish_reason == "stop" and rest.stop_reason == stop
    # the first run had held back the stop string's possible start; the resumed one releases exactly the rest
    assert _streamed(engine, params, free.token_ids[:cut]) + rest.text == whole.text
    assert_no_leak(engine)


@pytest.mark.parametrize(("change", "message"), [
    ({"n": 2}, "n = 1"),
    ({"max_tokens": 3}, "leave nothing"),
])
def test_resume_refusals_name_the_field(engine_for, change, message):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 10, **change})  # type: ignore[arg-type]
    engine = engine_for()
    with pytest.raises(InvalidRequestError, match=message) as info:
        engine.add_request("x", _prompt(1, 5), params, resume_token_ids=[5, 6, 7])
    assert info.value.param == "resume.token_ids"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("y", _prompt(1, 5), GREEDY, resume_token_ids=[10**6])
    assert_no_leak(engine)
