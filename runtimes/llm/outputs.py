"""What the engine hands back after each step, per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

TokenLogprobs = tuple[float, list[tuple[int, float]] | None]  # a sampled token's logprob, and its top alternatives


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely alternatives, best first


@dataclass
class RequestOutput:
    """An incremental update for one sequence (`index` among a request's `n` samples)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    text: str  # text delta, safe to stream
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "rejected" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    time: float = 0.0  # when this update was produced
    metrics: dict[str, float] = field(default_factory=dict)
    error_id: str | None = None  # finish_reason "error": the engine failed serving this request; see its log
