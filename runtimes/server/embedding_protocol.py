"""POST /v1/embeddings: the OpenAI-compatible request body and response, validated strictly at the edge.

`input` is a string, a list of strings, a list of token ids, or a list of lists of token ids; it is
normalised to a list of strings or a list of token-id lists. `truncate_prompt_tokens` is vLLM's extra
(see runtimes/embedding/inputs.py for the limit policy). Vectors go out as JSON floats or, with
`encoding_format: base64`, as OpenAI sends them: base64 of the little-endian float32 bytes.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    model: str = Field(min_length=1)
    input: list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=1 << 20)
    user: str | None = Field(None, max_length=512)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=(1 << 31) - 1)  # vLLM: -1 = the model's limit
    # not an embeddings field: typed loosely so that asking for a stream is refused by name, not ignored
    stream: Any = None

    @field_validator("stream")
    @classmethod
    def _not_streamed(cls, value: Any) -> Any:
        if value not in (None, False):
            raise ValueError("embeddings are not streamed; omit stream or set it to false")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> list[str] | list[list[int]]:
        return normalize_input(value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_input(value: Any) -> list[str] | list[list[int]]:
    """Any accepted `input` shape as a list of strings or a list of token-id lists; refuses empty inputs."""
    shape_error = "must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ValueError(shape_error)
    if not value:
        raise ValueError("must not be an empty list")
    if len(value) > MAX_INPUTS:
        raise ValueError(f"has {len(value)} inputs, over the limit of {MAX_INPUTS} per request")
    if all(_is_token_id(t) for t in value):
        value = [value]
    if all(isinstance(s, str) for s in value):
        empty = next((i for i, s in enumerate(value) if not s), None)
        if empty is not None:
            raise ValueError(f"input[{empty}] is an empty string")
        return value
    if all(isinstance(ids, list) and all(_is_token_id(t) for t in ids) for ids in value):
        empty = next((i for i, ids in enumerate(value) if not ids), None)
        if empty is not None:
            raise ValueError(f"input[{empty}] is an empty list of token ids")
        return value
    raise ValueError(shape_error + " (not a mix)")


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """One vector ([H] float32) as a list of floats or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def embedding_body(embeddings: np.ndarray, model: str, num_prompt_tokens: int, encoding_format: str
                   ) -> dict[str, Any]:
    """The whole response for `embeddings` ([N, H] float32, in input order)."""
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode_vector(row, encoding_format)}
                 for i, row in enumerate(embeddings)],
        "model": model,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }
