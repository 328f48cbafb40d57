"""The synchronous embedding engine: requests in, one pooled vector per input out, encoded in dynamic batches.

`step()` reads like the LLM engine's: schedule (the batcher's next forward pass), run it, update (file vectors
under their requests; finished requests come out). One step is one forward pass, so the driver takes new requests
between any two, and the batcher's turns let them in before a long request's next chunk
(runtimes/embedding/batching.py). It knows nothing of HTTP; the async face (runtimes/embedding/async_engine.py)
drives it from one thread.

An input whose forward fails fails its request only (an output with an `error_id`): the rest of its bucket is
encoded without it (runtimes/fault_isolation.py). The engine then encodes a known-good text; if that fails
too, the engine itself is broken and `step()` raises EngineFaultError, which ends the engine loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from foundation.request_errors import InvalidRequestError, record_failure
from registry.sources import resolve_model_path
from runtimes.embedding.batching import BatchItem, Bucket, DynamicBatcher
from runtimes.embedding.config import EmbeddingConfig
from runtimes.embedding.inputs import InputProcessor
from runtimes.embedding.model import BertEncoder, load_encoder, pool
from runtimes.embedding.model_config import PoolingConfig, lowercases_inputs
from runtimes.fault_isolation import PROBE_TEXT, EngineFaultError, run_isolating


@dataclass(frozen=True)
class LoadedEncoder:
    model: BertEncoder
    pooling: PoolingConfig
    inputs: InputProcessor
    name: str


def load_encoder_dir(path: Path, device: torch.device, dtype: torch.dtype, max_model_len: int | None = None
                     ) -> LoadedEncoder:
    """Encoder, pooling recipe and tokenizer of a sentence-transformers (or plain HF BERT-family) directory.
    The pooling recipe is read first: a directory we cannot pool as its model does is refused before its weights
    are read."""
    pooling = PoolingConfig.from_sentence_transformers_dir(path)
    model = load_encoder(path, device, dtype)
    limit = min(pooling.max_seq_length or model.config.max_input_len, model.config.max_input_len)
    if max_model_len is not None:
        limit = min(limit, max_model_len)
    inputs = InputProcessor.from_dir(path, limit, lowercase=lowercases_inputs(path))
    return LoadedEncoder(model, pooling, inputs, path.name)


@dataclass(frozen=True)
class EmbeddingOutput:
    request_id: str
    embeddings: np.ndarray  # [N, H] float32, one row per input in request order
    num_prompt_tokens: int
    error_id: str | None = None  # the engine failed while encoding this request (see its log); no embeddings


@dataclass
class EngineStats:
    """Counters of the work done (read by /metrics; only the engine thread writes them)."""

    num_batches: int = 0  # forward passes
    num_inputs: int = 0
    num_tokens: int = 0  # real tokens encoded
    num_padded_tokens: int = 0  # tokens fed to the encoder, padding included


@dataclass
class _Request:
    embeddings: np.ndarray  # [N, H]
    num_prompt_tokens: int
    num_done: int = 0


@dataclass
class EmbeddingEngine:
    """Dynamic-batching embedding engine over one loaded encoder."""

    loaded: LoadedEncoder
    config: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        param = next(self.loaded.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.batcher = DynamicBatcher(self.config.max_batch_size, self.config.batch_window_s,
                                      self.config.max_batch_tokens, self.config.min_bucket_len)
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}

    @classmethod
    def from_source(cls, source: str | Path, config: EmbeddingConfig | None = None) -> EmbeddingEngine:
        """Load a model directory (a path, or `package:dir` inside an installed package)."""
        config = config or EmbeddingConfig()
        path = resolve_model_path(source)
        if not path.is_dir():
            raise ValueError(f"an embedding model is a directory (config.json, model.safetensors, "
                             f"tokenizer.json); got the file {path}")
        device = config.resolve_device()
        loaded = load_encoder_dir(path, device, config.resolve_dtype(device), config.max_model_len)
        return cls(loaded, config)

    # ------------------------------------------------------------------------------------------ facts

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def hidden_size(self) -> int:
        """Dimensions of every returned vector."""
        return self.loaded.model.config.hidden_size

    @property
    def max_model_len(self) -> int:
        """Input limit in tokens, special tokens included."""
        return self.loaded.inputs.limit

    @property
    def inputs(self) -> InputProcessor:
        return self.loaded.inputs

    # ------------------------------------------------------------------------------------------ requests

    def add_request(self, request_id: str, token_ids: Sequence[Sequence[int]],
                    arrival_time: float | None = None) -> None:
        """Queue prepared inputs (see InputProcessor.prepare); an invalid one raises InvalidRequestError."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not token_ids:
            raise InvalidRequestError("input must not be empty", param="input")
        for i, ids in enumerate(token_ids):
            if not 0 < len(ids) <= self.max_model_len:
                raise InvalidRequestError(f"input[{i}] has {len(ids)} tokens; this model takes 1 to "
                                          f"{self.max_model_len}", param="input")
        num_tokens = sum(len(ids) for ids in token_ids)
        if num_tokens > self.config.max_request_tokens:
            raise InvalidRequestError(
                f"input has {num_tokens} tokens in all ({len(token_ids)} inputs), over this model's limit of "
                f"{self.config.max_request_tokens} tokens per request; split it into several requests",
                param="input")
        arrival = self.clock() if arrival_time is None else arrival_time
        self.batcher.add([BatchItem(request_id, i, ids, arrival) for i, ids in enumerate(token_ids)])
        embeddings = np.empty((len(token_ids), self.hidden_size), dtype=np.float32)
        self._requests[request_id] = _Request(embeddings, num_tokens)

    def abort_request(self, request_id: str) -> None:
        """Drop a request: its waiting inputs are not encoded; vectors of a batch in flight are discarded."""
        if self._requests.pop(request_id, None) is not None:
            self.batcher.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def batch_wait_s(self) -> float | None:
        """None when idle; else seconds until the next batch is due (<= 0: step now)."""
        return self.batcher.wait_s(self.clock())

    # ------------------------------------------------------------------------------------------ step

    def step(self) -> list[EmbeddingOutput]:
        """Run the due forward pass, if any; outputs of the requests it finished."""
        bucket = self.batcher.schedule(self.clock())
        if bucket is None:
            return []
        outcome = run_isolating(lambda items: self._encode(Bucket(tuple(items), bucket.padded_len)), bucket.items)
        faults: dict[str, Exception] = {}
        for item, error in outcome.faults:
            faults.setdefault(item.request_id, error)
        outputs = [self._fail(request_id, error) for request_id, error in faults.items()]
        if faults:
            self._self_check()
        return outputs + self._update(outcome.parts)

    def _fail(self, request_id: str, error: Exception) -> EmbeddingOutput:
        """Drop a request whose input failed to encode (its other inputs too) and say so under an error id."""
        error_id = record_failure("request failed in the engine; it alone is stopped", request_id, error)
        request = self._requests.get(request_id)
        self.abort_request(request_id)
        num_tokens = 0 if request is None else request.num_prompt_tokens
        return EmbeddingOutput(request_id, np.empty((0, self.hidden_size), dtype=np.float32), num_tokens, error_id)

    def _self_check(self) -> None:
        """Encode a known-good text; raise EngineFaultError if the engine cannot (it is broken, not a request)."""
        ids = self.inputs.encode(PROBE_TEXT)
        try:
            self._encode(Bucket((BatchItem("self-check", 0, ids, self.clock()),), len(ids)))
        except Exception as error:
            raise EngineFaultError(f"the engine failed its self-check after a request fault: {error!r}") from error

    @torch.inference_mode()
    def _encode(self, bucket: Bucket) -> np.ndarray:
        """One forward pass: [n, padded_len] ids -> [n, H] float32 vectors."""
        num, seq_len = len(bucket.items), bucket.padded_len
        ids = torch.zeros(num, seq_len, dtype=torch.long)  # [n, S]; 0 is only a placeholder under the mask
        mask = torch.zeros(num, seq_len, dtype=torch.long)  # [n, S]
        for row, item in enumerate(bucket.items):
            ids[row, : len(item.token_ids)] = torch.as_tensor(item.token_ids)
            mask[row, : len(item.token_ids)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.loaded.model(ids, mask)  # [n, S, H]
        vectors = pool(hidden, mask, self.loaded.pooling)  # [n, H]
        self.stats.num_batches += 1
        self.stats.num_inputs += num
        self.stats.num_tokens += int(mask.sum())
        self.stats.num_padded_tokens += bucket.num_padded_tokens
        return vectors.float().cpu().numpy()

    def _update(self, done: Sequence[tuple[Sequence[BatchItem], np.ndarray]]) -> list[EmbeddingOutput]:
        """File each encoded input's vector ([n, H] per part) under its request; finished requests come out."""
        touched: dict[str, _Request] = {}
        for items, vectors in done:
            for item, vector in zip(items, vectors, strict=True):
                request = self._requests.get(item.request_id)
                if request is None:  # aborted while its batch ran
                    continue
                request.embeddings[item.index] = vector
                request.num_done += 1
                touched[item.request_id] = request
        outputs = []
        for request_id, request in touched.items():
            if request.num_done == len(request.embeddings):
                del self._requests[request_id]
                outputs.append(EmbeddingOutput(request_id, request.embeddings, request.num_prompt_tokens))
        return outputs

    def embed(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Encode inputs now, bypassing the window: [N, H] float32. For scripts and tests, on an engine that
        no async face drives (it would take the other requests' outputs)."""
        if self._requests:
            raise RuntimeError(f"embed() needs an idle engine; {len(self._requests)} request(s) are in flight")
        self.add_request("embed", token_ids, arrival_time=self.clock() - self.config.batch_window_s)
        outputs: list[EmbeddingOutput] = []
        while not outputs:  # one step per forward pass: a request of several length buckets takes several
            outputs = self.step()
        return outputs[0].embeddings
