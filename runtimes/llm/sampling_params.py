"""Per-request sampling parameters, validated once at submission."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from foundation.request_errors import InvalidRequestError

_MAX_LOGPROBS = 20
_MAX_N = 16
_MAX_STOP = 16  # stop strings per request
_MAX_STOP_CHARS = 1024  # per stop string: the detokenizer scans its text tail for each one every token
_MAX_STOP_TOKEN_IDS = 256
_MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
_LOGIT_BIAS_RANGE = 100.0  # |bias| at most this, as OpenAI: -100 bans a token, +100 all but forces it
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a 64-bit signed seed; torch's generators take these and more


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's whole output (constrained decoding): exactly one of the forms is set. `param` is
    the request field it came from, which errors name (e.g. "response_format.json_schema")."""

    json_schema: str | None = None  # a JSON schema, as JSON text: the output is a JSON value it validates
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None  # the output matches this regular expression in full
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a context-free grammar (Lark syntax, or GBNF)
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        forms = [self.json_schema is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if sum(forms) != 1:
            raise InvalidRequestError(f"{self.param}: give exactly one of json, json_object, regex, choice, grammar",
                                      param=self.param)
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError(f"{self.param}: choice must be a non-empty list of non-empty strings",
                                          param=self.param)


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
    # (token id, bias) pairs added to the logits before penalties and sampling (OpenAI's `logit_bias`)
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # number of top alternatives per sampled token; 0 = only the sampled one
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # constrained decoding: the output follows this
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # accept a single string as OpenAI does
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((token, bias) for token, bias in bias))
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
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed",
             f"seed must be a 64-bit signed integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed}"),
            (self.logprobs is None or 0 <= self.logprobs <= _MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (len(self.stop) <= _MAX_STOP, "stop", f"at most {_MAX_STOP} stop strings, got {len(self.stop)}"),
            (all(len(s) <= _MAX_STOP_CHARS for s in self.stop), "stop",
             f"a stop string may have at most {_MAX_STOP_CHARS} characters"),
            (len(self.stop_token_ids) <= _MAX_STOP_TOKEN_IDS, "stop_token_ids",
             f"at most {_MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}"),
            (len(self.logit_bias) <= _MAX_LOGIT_BIAS, "logit_bias",
             f"at most {_MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias)}"),
            (all(-_LOGIT_BIAS_RANGE <= b <= _LOGIT_BIAS_RANGE for _, b in self.logit_bias), "logit_bias",
             f"logit_bias values must be in [-{_LOGIT_BIAS_RANGE:g}, {_LOGIT_BIAS_RANGE:g}]"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError unless every token id these parameters name is in [0, vocab_size)."""
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        check_token_ids([token for token, _ in self.logit_bias], vocab_size, "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Raise InvalidRequestError naming `param` for the first id outside [0, vocab_size)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)
