"""POST /v1/embeddings on an embedding replica: in process over the real all-MiniLM-L6-v2, then a real worker
process driven by the official openai client."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from registry.engine import EmbeddingEngineSpec
from registry.launch import replica_launch
from registry.schema import ModelSpec, validation_problems
from runtimes.embedding.async_engine import AsyncEmbeddingEngine
from runtimes.embedding.config import EmbeddingConfig
from runtimes.embedding.engine import EmbeddingEngine
from runtimes.server.embedding_app import build_embedding_app
from runtimes.server.worker import embedding_config
from tests.runtimes.embedding.conftest import MINILM_SOURCE, SENTENCES, long_text
from tests.runtimes.server.conftest import SERVED_NAME as LLM_NAME
from tests.runtimes.server.conftest import wait_until
from tests.runtimes.server.test_app import metric_samples
from tests.runtimes.server.test_worker import REPO_ROOT, worker_process

NAME, ALIAS = "minilm", "all-minilm-l6-v2"
EMBEDDINGS = "/v1/embeddings"


@pytest.fixture(scope="module")
def embedder() -> Iterator[AsyncEmbeddingEngine]:
    engine = AsyncEmbeddingEngine(EmbeddingEngine.from_source(MINILM_SOURCE, EmbeddingConfig(device="cpu")))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(embedder: AsyncEmbeddingEngine) -> EmbeddingEngine:
    """A synchronous engine over the same weights (its own queue), for the vectors the API must return."""
    return EmbeddingEngine(embedder.engine.loaded, EmbeddingConfig(device="cpu"))


@pytest.fixture
def api(embedder: AsyncEmbeddingEngine) -> Iterator[TestClient]:
    """A ready in-process embedding replica."""
    with TestClient(build_embedding_app(embedder, NAME, [ALIAS])) as client:
        wait_until(lambda: client.get("/ready").status_code == 200, what="/ready")
        yield client
    assert not embedder.engine.has_unfinished_requests()


def embed(client: TestClient, input: object, status: int = 200, **fields: object) -> dict:
    response = client.post(EMBEDDINGS, json={"model": NAME, "input": input, **fields})
    assert response.status_code == status, response.text
    return response.json()


def vectors(body: dict) -> np.ndarray:
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


def test_inputs_in_every_shape(api, reference):
    texts = SENTENCES[:3]
    token_ids = reference.inputs.prepare(texts).token_ids
    body = embed(api, texts)
    assert body["object"] == "list" and body["model"] == NAME
    assert all(d["object"] == "embedding" for d in body["data"])
    expected = reference.embed(token_ids)
    np.testing.assert_allclose(vectors(body), expected, atol=1e-5)
    n = sum(map(len, token_ids))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    np.testing.assert_allclose(vectors(embed(api, texts[0])), expected[:1], atol=1e-5)
    np.testing.assert_allclose(vectors(embed(api, token_ids[1])), expected[1:2], atol=1e-5)
    by_ids = embed(api, token_ids, model=ALIAS)
    np.testing.assert_allclose(vectors(by_ids), expected, atol=1e-5)
    assert by_ids["usage"]["prompt_tokens"] == n and by_ids["model"] == ALIAS


def test_base64_round_trip(api):
    floats = vectors(embed(api, SENTENCES[:2]))
    body = embed(api, SENTENCES[:2], encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]])
    assert decoded.shape == (2, 384)
    np.testing.assert_array_equal(decoded, floats)  # JSON floats carry float32 values exactly


def test_dimensions(api):
    assert len(embed(api, "x", dimensions=384)["data"][0]["embedding"]) == 384
    error = embed(api, "x", 400, dimensions=128)["error"]
    assert error["param"] == "dimensions" and "384-dimensional" in error["message"] and "cannot shorten" in error[
        "message"]


def test_long_inputs_refused_or_truncated_as_asked(api):
    error = embed(api, ["ok", long_text()], 400)["error"]
    assert error["param"] == "input" and "input[1] has" in error["message"] and "limit of 256" in error["message"]
    body = embed(api, ["ok", long_text()], truncate_prompt_tokens=-1)
    assert body["usage"]["prompt_tokens"] == 3 + 256 and len(body["data"]) == 2
    assert embed(api, long_text(), truncate_prompt_tokens=10)["usage"]["prompt_tokens"] == 10
    error = embed(api, "x", 400, truncate_prompt_tokens=1000)["error"]
    assert error["param"] == "truncate_prompt_tokens" and "[1, 256]" in error["message"]


@pytest.mark.parametrize(("bad_input", "message"), [
    ([], "must not be an empty list"),
    ("", "input[0] is an empty string"),
    ([[1, 2], []], "input[1] is an empty list of token ids"),
    (["a", [1, 2]], "(not a mix)"),
    ([True], "must be a string"),
    ({"text": "x"}, "must be a string"),
    ([[5, 30522]], "outside this model's vocabulary"),
    (["x"] * 2049, "over the limit of 2048"),
])
def test_bad_inputs_are_400_naming_input(api, bad_input, message):
    error = embed(api, bad_input, 400)["error"]
    assert message in error["message"] and error["param"] == "input", error


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"stream": True}, "stream", "embeddings are not streamed"),
    ({"dimensions": 2**40}, "dimensions", "less than or equal to"),
    ({"truncate_prompt_tokens": 2**40}, "truncate_prompt_tokens", "less than or equal to"),
])
def test_fields_out_of_range_or_unsupported_are_400_by_name(api, fields, param, message):
    error = embed(api, "hi", 400, **fields)["error"]
    assert message in error["message"] and error["param"] == param, error
    assert embed(api, "hi", stream=False)["data"]


def test_a_request_over_the_token_budget_is_a_400_naming_input_the_limit_and_its_count(embedder):
    budget = AsyncEmbeddingEngine(EmbeddingEngine(embedder.engine.loaded,
                                                  EmbeddingConfig(device="cpu", max_request_tokens=20)))
    try:
        with TestClient(build_embedding_app(budget, NAME)) as client:
            wait_until(lambda: client.get("/ready").status_code == 200, what="/ready")
            error = embed(client, [[7] * 8] * 3, 400)["error"]
            assert error == {"message": "input has 24 tokens in all (3 inputs), over this model's limit of 20 tokens "
                                        "per request; split it into several requests",
                             "type": "invalid_request_error", "param": "input", "code": "invalid_value"}
            assert len(embed(client, [[7] * 10] * 2)["data"]) == 2  # exactly the budget
    finally:
        budget.shutdown()


def test_other_errors(api):
    assert embed(api, "x", 404, model="gpt-4")["error"]["code"] == "model_not_found"
    assert embed(api, "x", 400, encoding_format="int8")["error"]["param"] == "encoding_format"
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = api.post(path, json={"model": NAME, "prompt": "x", "messages": []})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == f"model {NAME!r} is an embedding model; use /v1/embeddings"


def test_embeddings_on_an_llm_replica_name_the_fitting_endpoints(client):
    response = client.post(EMBEDDINGS, json={"model": LLM_NAME, "input": "x"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "wrong_endpoint" and "use /v1/chat/completions or /v1/completions" in error["message"]


def test_probes_models_metrics_and_draining(api):
    assert api.get("/health").json() == {"status": "ok"}
    assert api.get("/ready").json() == {"status": "ready", "model": NAME}
    models = api.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [NAME, ALIAS] and models[0]["max_model_len"] == 256
    before = metric_samples(api)
    body = embed(api, SENTENCES)
    after = metric_samples(api)
    label = (("model_name", NAME),)

    def delta(name: str) -> float:
        return after.get((name, label), 0.0) - before.get((name, label), 0.0)

    assert delta("multiserve_embedding_requests_total") == 1
    assert delta("multiserve_prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert delta("multiserve_embedding_batched_inputs_total") == len(SENTENCES)
    assert delta("multiserve_embedding_tokens_total") == body["usage"]["prompt_tokens"]
    assert delta("multiserve_embedding_padded_tokens_total") >= body["usage"]["prompt_tokens"]
    assert after[("multiserve_embedding_inputs_waiting", label)] == 0
    api.app.state.replica.draining = True
    try:
        assert api.get("/ready").status_code == 503
        response = api.post(EMBEDDINGS, json={"model": NAME, "input": "x"})
        assert response.status_code == 503 and "draining" in response.json()["error"]["message"]
    finally:
        api.app.state.replica.draining = False


# ---------------------------------------------------------------------------------------------- a real worker


def test_embedding_options_from_the_registry():
    spec = ModelSpec.model_validate({"name": "e", "type": "embedding", "source": {"path": "/m"}, "device": "cpu",
                                     "engine": {"max_num_seqs": 16, "max_model_len": 128}})
    assert embedding_config(replica_launch(spec, 0)) == EmbeddingConfig(device="cpu", max_batch_size=16,
                                                                         max_model_len=128)
    window = spec.model_copy(update={"engine": EmbeddingEngineSpec(batch_window_s=0.0)})
    assert embedding_config(replica_launch(window, 0)).batch_window_s == 0.0
    budget = spec.model_copy(update={"engine": EmbeddingEngineSpec(max_request_tokens=4096)})
    assert embedding_config(replica_launch(budget, 0)).max_request_tokens == 4096
    for engine, message in [({"window": 1}, "engine.window: unknown field"),
                            ({"block_size": 16}, "engine.block_size: not used by embedding models"),
                            ({"batch_window_s": 5}, "engine.batch_window_s: Input should be less than or equal to 1"),
                            ({"max_request_tokens": 0}, "engine.max_request_tokens: Input should be greater than or "
                                                        "equal to 1"),
                            ({"max_request_tokens": 1 << 25}, "engine.max_request_tokens: Input should be less than "
                                                              "or equal to 16777216")]:
        with pytest.raises(ValidationError) as info:
            ModelSpec.model_validate({"name": "e", "type": "embedding", "source": {"path": "/m"}, "engine": engine})
        assert message in "\n".join(str(p) for p in validation_problems(info.value)), info.value
    with pytest.raises(ValidationError, match="scheduling"):
        ModelSpec.model_validate({"name": "e", "type": "embedding", "source": {"path": "/m"},
                                  "policy": {"scheduling": "multilevel"}})


@pytest.fixture(scope="module")
def embedding_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`multiserve worker --type embedding` serving all-MiniLM-L6-v2 as `minilm`; yields its base URL.

    The engine options are the registry's for an embedding model."""
    args = ["--type", "embedding", "--source", MINILM_SOURCE, "--name", NAME, "--device", "cpu",
            "--engine-json", '{"max_num_seqs": 32}']
    with worker_process(args, tmp_path_factory.mktemp("embedding-worker") / "worker.log") as base_url:
        yield base_url


def test_openai_client_against_an_embedding_worker(embedding_worker, reference):
    with openai.OpenAI(base_url=f"{embedding_worker}/v1", api_key="x", max_retries=0, timeout=60) as client:
        assert [m.id for m in client.models.list()] == [NAME]
        result = client.embeddings.create(model=NAME, input=SENTENCES)  # the client asks for base64, decodes it
        got = np.array([d.embedding for d in result.data], dtype=np.float32)
        expected = reference.inputs.prepare(SENTENCES).token_ids
        np.testing.assert_allclose(got, reference.embed(expected), atol=1e-5)
        assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, expected))
        floats = client.embeddings.create(model=NAME, input="hi", encoding_format="float")
        assert len(floats.data[0].embedding) == 384
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model=NAME, input="hi", dimensions=64)
        with pytest.raises(openai.BadRequestError, match="use /v1/embeddings"):
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])


def test_an_embedding_replica_does_not_load_the_llm_runtime():
    """The embedding app shares the replica base (readiness, metrics, errors) with the LLM app, not its engine."""
    code = ("import sys, runtimes.server.embedding_app; "
            "print(sorted(m for m in sys.modules if m.startswith('runtimes.llm')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          cwd=REPO_ROOT)
    assert proc.stdout.strip() == "[]"
