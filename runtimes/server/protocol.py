"""OpenAI-compatible request bodies (pydantic v2), validated strictly at the edge.

Known fields are type-checked strictly (no "1" for 1) and range-checked, so the 400 names the field and its limit.
`to_sampling_params(vocab_size)` maps a request onto the engine's SamplingParams, whose own checks raise
InvalidRequestError naming the field, and checks every token id against the model's vocabulary, so nothing out of
range reaches the engine. It also refuses fields we know but cannot honour (`echo`, `best_of`, `suffix`, the
deprecated functions, audio...) rather than drop them silently, and so, like OpenAI, any top-level field it does not
know: an ignored field could be asking for something (a constraint, a template option) that the reply would silently
lack. A null value asks for nothing and is accepted, and so are the few fields of IGNORED_FIELDS, each of which cannot
change the output. Structured outputs (`response_format`, `structured_outputs`, `guided_*`) are read by
runtimes/server/structured_fields.py into SamplingParams.structured; `tools`, `tool_choice` and
`parallel_tool_calls` by runtimes/server/tool_calls.py (tool_choice "required" or named constrains the output too).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from foundation.http.wire import PRIORITY_MAX, PRIORITY_MIN
from foundation.request_errors import InvalidRequestError
from runtimes.llm.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, StructuredOutput, check_token_ids
from runtimes.server.structured_fields import STRUCTURED_FIELDS, structured_output
from runtimes.server.tool_calls import ToolRequest, tool_request

MAX_N = 16
MAX_LOGPROBS = 20
# Top-level fields accepted and ignored, each with why it cannot change the output. Any other field this server does
# not know is refused (a 400 naming it), as OpenAI does, unless its value is null.
IGNORED_FIELDS: dict[str, str] = {
    "metadata": "OpenAI's tags for a stored completion, for filtering it later; the model never sees them",
    "store": "whether OpenAI keeps the completion for evals and distillation; nothing is kept here",
    "service_tier": "OpenAI's processing tier (price, latency); the lane comes from priority and X-Priority",
    "safety_identifier": "a stable label of the end user for abuse monitoring, as user is",
    "prompt_cache_key": "a hint for routing to a warm prompt cache; the prefix cache here is automatic and exact, "
                        "so it could change only latency",
}
_MAX_NAMED_FIELDS = 8  # unknown fields a refusal lists


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResumeFields(_Strict):
    """A continuation (`multiserve_resume`, sent by the gateway): the request as first sent, plus what another replica
    had generated of it. Generation goes on after `token_ids` (runtimes/llm/input_processor.py); a stream keeps
    the first one's `id` and `created` (a whole reply, of which the client has seen nothing, gets its own when they
    are not given)."""

    token_ids: list[int] = Field(max_length=1 << 20)  # none yet: a chat stream had sent only its role
    id: str | None = Field(None, min_length=1, max_length=128)
    created: int | None = Field(None, ge=0, le=1 << 40)


class SamplingFields(_Strict):
    """Fields shared by both endpoints: OpenAI's sampling knobs plus vLLM's extras. Unknown fields are kept (in
    `model_extra`) to be refused by name in `to_sampling_params`, not dropped at parsing."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = Field(None, max_length=512)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int = Field(0, ge=-1, le=(1 << 31) - 1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False
    # lane: 0 interactive, 1 normal, 2 background; None: classified (policies/classify.py refuses other values)
    priority: int | None = Field(None, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    multiserve_resume: ResumeFields | None = None
    # Structured outputs, on both endpoints (as vLLM): typed loosely here and checked by structured_fields.py, so
    # that a 400 names the field inside the object at fault (`response_format.json_schema.schema`)
    response_format: Any = None  # OpenAI's
    structured_outputs: Any = None  # vLLM's
    guided_json: Any = None  # vLLM's older names for the same
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None  # a backend's name is accepted and has no effect; its options are refused
    guided_whitespace_pattern: Any = None  # refused: it changes the output

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("must be a string or a list of strings")

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI sends token ids as the object's keys: each must be a decimal integer."""
        for key in value or {}:
            if not key.lstrip("-").isdecimal() or len(key) > 20:
                raise ValueError(f"keys must be token ids (integers), got {key[:40]!r}")
        return value

    def _refuse_unsupported(self) -> None:
        """Unknown fields, cross-field rules and known fields we cannot honour: refused, never silently dropped."""
        self._refuse_unknown()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                f"best_of other than n is not supported (best_of={self.best_of}, n={self.n})", param="best_of")
        if self.multiserve_resume is not None and self.n != 1:
            raise InvalidRequestError(f"multiserve_resume continues a request of one choice: it needs n = 1, got "
                                      f"n = {self.n}", param="multiserve_resume")

    def _refuse_unknown(self) -> None:
        """A field this server does not know might ask for what it would then silently not do: refused, naming it,
        unless its value is null (which asks for nothing) or it is one of IGNORED_FIELDS."""
        unknown = [name for name, value in (self.model_extra or {}).items()
                   if value is not None and name not in IGNORED_FIELDS]
        if not unknown:
            return
        names = ", ".join(name if len(name) <= 64 else name[:64] + "..." for name in unknown[:_MAX_NAMED_FIELDS])
        if len(unknown) > _MAX_NAMED_FIELDS:
            names += f" and {len(unknown) - _MAX_NAMED_FIELDS} more"
        raise InvalidRequestError(
            f"unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: {names} (this server refuses "
            f"fields it does not know rather than ignore them)", param=unknown[0][:64])

    def _structured(self) -> StructuredOutput | None:
        """The constraint on the whole output, from whichever one field asks for it (none: free text)."""
        return structured_output({name: getattr(self, name) for name in STRUCTURED_FIELDS},
                                 self.guided_decoding_backend, self.guided_whitespace_pattern)

    def _constraint(self, tools: ToolRequest | None) -> StructuredOutput | None:
        """The structured-output fields' constraint, or the one tool_choice makes (never both)."""
        structured = self._structured()
        forced = tools.constraint() if tools is not None else None
        if forced is None or tools is None:
            return structured
        if structured is not None:
            other = next(name for name in STRUCTURED_FIELDS if getattr(self, name) is not None)
            what = "naming a function" if tools.mode == "named" else f'"{tools.mode}"'
            raise InvalidRequestError(f"tool_choice {what} and {other} each constrain the output; give one of them",
                                      param="tool_choice")
        return forced

    @property
    def resume_token_ids(self) -> list[int]:
        return [] if self.multiserve_resume is None else self.multiserve_resume.token_ids

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling(self, max_tokens: int | None, logprobs: int | None, vocab_size: int,
                  tools: ToolRequest | None = None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        bias = tuple((int(token), value) for token, value in (self.logit_bias or {}).items())
        params = SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logit_bias=bias, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, structured=self._constraint(tools),
        )
        params.check_vocab(vocab_size)
        return params


def _single_prompt(value: Any) -> str | list[int]:
    """One prompt: a string or token ids (a one-element batch of either is unwrapped)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, a list of token ids, or a one-element list of either")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise ValueError(f"this server takes one prompt per request; got a batch of {len(value)}")
    if len(value) == 1 and isinstance(value[0], (str, list)):
        return _single_prompt(value[0])
    raise ValueError("must be a string, a list of token ids, or a one-element list of either")


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> str | list[int]:
        return _single_prompt(value)

    def to_sampling_params(self, vocab_size: int) -> SamplingParams:
        """The engine's parameters; raises InvalidRequestError (a 400) naming the field. A prompt of token ids
        is checked against the vocabulary (`vocab_size`) here too."""
        self._refuse_unsupported()
        if self.echo:
            raise InvalidRequestError("echo is not supported by this server", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by this server", param="suffix")
        if isinstance(self.prompt, list):
            check_token_ids(self.prompt, vocab_size, "prompt")
        return self._sampling(self.max_tokens, self.logprobs, vocab_size)


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, tool_call_id...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(_is_text_part(p) for p in value):
            return value
        raise ValueError("must be a string or a list of text parts {'type': 'text', 'text': str}")


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # tools: typed loosely here and checked by tool_calls.py, so that a 400 names the field inside (tools[2].function)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # OpenAI fields this server cannot honour: typed loosely so that any value is refused by name, not by shape
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None

    def to_sampling_params(self, vocab_size: int) -> SamplingParams:
        """The engine's parameters; raises InvalidRequestError (a 400) naming the field.

        Without max_tokens the completion may use the rest of the context, as in OpenAI's chat API.
        """
        self._refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        self._refuse_unhonoured()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, vocab_size, self.tool_request())

    def tool_request(self) -> ToolRequest | None:
        """The request's tools and tool_choice, checked (None: no tools)."""
        return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def _refuse_unhonoured(self) -> None:
        """The deprecated function fields and multimodal ones: refused by name."""
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"{name} is deprecated and not supported by this server; use tools and "
                                          f"tool_choice", param=name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise InvalidRequestError("modalities: this server only produces text (['text'])", param="modalities")
        for name in ("audio", "prediction", "web_search_options"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"{name} is not supported by this server", param=name)

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template (None values dropped by the tokenizer)."""
        return [m.model_dump() for m in self.messages]
