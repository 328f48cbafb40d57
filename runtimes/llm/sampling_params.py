"""Per-request sampling parameters, validated once at submission."""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_LOGPROBS = 20
_MAX_N = 16


class InvalidRequestError(ValueError):
    """A request that can never be served as asked; the message names the field and the limit."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt, or prompt plus max_tokens, does not fit the model's context window (OpenAI's
    `context_length_exceeded`: a gateway may send the request to a model with a longer one)."""


class OverloadedError(Exception):
    """The engine is too busy to take (or to start) this request now; try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class SamplingParams:
    """What to sample and when to stop. Field names and defaults follow vLLM / OpenAI.

    `max_tokens=None` means "up to the model's context length".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per sampled token; 0 = only the sampled one
    skip_special_tokens: bool = True
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # accept a single string as OpenAI does
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (1 <= self.n <= _MAX_N, "n", f"n must be in [1, {_MAX_N}], got {self.n}"),
            (self.temperature >= 0.0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, "top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= _MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
