"""A replica that speculates: the API's answers are the plain replica's (streamed or not: several tokens may come
in one step), /metrics counts proposals and accepted tokens, and inter-token latency counts every token."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from registry.engine import SpeculativeOptions
from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.config import EngineConfig
from runtimes.llm.engine import LLMEngine
from runtimes.server.app import build_app
from tests.runtimes.llm.tiny import loaded_tiny
from tests.runtimes.server.conftest import SERVED_NAME, all_blocks_free, wait_until
from tests.runtimes.server.test_app import COMPLETIONS, metric_samples, sample, sse_events

# a prompt whose greedy continuation on the tiny model falls into a loop, which prompt lookup then proposes
PROMPT = [3, 4, 5, 6, 7, 8]


def _client(speculative: SpeculativeOptions | None) -> Iterator[tuple[TestClient, AsyncLLMEngine]]:
    engine = AsyncLLMEngine(LLMEngine(loaded_tiny(), EngineConfig(kv_cache_bytes=1 << 20, block_size=4,
                                                                  speculative=speculative)))
    try:
        with TestClient(build_app(engine, SERVED_NAME, [])) as client:
            wait_until(lambda: client.get("/ready").status_code == 200, what="/ready")
            yield client, engine
        wait_until(lambda: all_blocks_free(engine), what="every KV block free")
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def plain() -> Iterator[tuple[TestClient, AsyncLLMEngine]]:
    yield from _client(None)


@pytest.fixture(scope="module")
def speculating() -> Iterator[tuple[TestClient, AsyncLLMEngine]]:
    yield from _client(SpeculativeOptions(k=4, prompt_lookup_min=1, adaptive=False))


BODY = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "logprobs": 1}


def test_answers_and_streams_are_the_plain_replicas(plain, speculating):
    want = plain[0].post(COMPLETIONS, json=BODY).json()
    got = speculating[0].post(COMPLETIONS, json=BODY).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["usage"] == want["usage"]
    assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
    events = sse_events(speculating[0].post(COMPLETIONS, json={**BODY, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]) == \
        want["choices"][0]["text"]


def test_a_structured_answer_is_the_plain_replicas(plain, speculating):
    """A JSON-schema request to a speculating replica: proposals under its grammar, the same JSON as plain decoding."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array",
                                                                              "items": {"type": "string"}}},
              "required": ["a", "b"], "additionalProperties": False}
    body = {**BODY, "max_tokens": 120, "ignore_eos": False, "structured_outputs": {"json": schema}}
    del body["logprobs"]
    want = plain[0].post(COMPLETIONS, json=body).json()
    before = speculating[1].engine.speculation.stats.num_accepted
    got = speculating[0].post(COMPLETIONS, json=body).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and got["usage"] == want["usage"]
    assert want["usage"]["completion_tokens"] > 70  # long enough to be proposed to (the closing window is 64)
    assert speculating[1].engine.speculation.stats.num_accepted > before  # and it was


def test_metrics_count_proposals_and_every_token(speculating):
    client, engine = speculating
    before = metric_samples(client)
    reply = client.post(COMPLETIONS, json=BODY).json()
    after = metric_samples(client)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    stats = engine.engine.speculation.stats
    assert delta("multiserve_spec_decode_num_draft_tokens_total", method="ngram") > 0
    assert 0 < delta("multiserve_spec_decode_num_accepted_tokens_total", method="ngram") <= \
        delta("multiserve_spec_decode_num_draft_tokens_total", method="ngram")
    assert sample(after, "multiserve_spec_decode_num_accepted_tokens_total", method="ngram") == stats.num_accepted
    assert delta("multiserve_generation_tokens_total") == reply["usage"]["completion_tokens"] == 40
    assert delta("multiserve_inter_token_latency_seconds_count") == 39  # every token after the first
