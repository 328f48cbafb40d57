"""A request as the scheduler sees it: tokens, progress and status."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from runtimes.llm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtimes.llm.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"  # waited past the queue-wait limit without starting (never ran)
    FINISHED_ERROR = "error"  # the engine failed while serving it (only it: see runtimes/llm/fault_isolation.py)

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)


class Request:
    """One sequence. Progress is counted: the engine computes until `num_computed_tokens == num_tokens`,
    then samples one token, which makes `num_tokens` one larger. Chunked prefill, prefix-cache hits
    and recompute after preemption all just move `num_computed_tokens`.
    """

    __slots__ = (
        "arrival_time", "block_hashes", "cache_namespace", "eos_token_ids", "grammar", "max_tokens",
        "num_cached_tokens", "num_computed_tokens", "num_preemptions", "num_prompt_tokens", "params",
        "priority", "request_id", "seed", "status", "stop_reason", "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float,
        priority: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        cache_namespace: str | None = None,
        seed: int | None = None,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        self.request_id = request_id
        # prompt, then outputs; a resumed request starts with the outputs another replica already produced
        self.token_ids: list[int] = [*prompt_token_ids, *output_token_ids]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time
        self.priority = priority  # lower is more urgent (vLLM convention)
        self.eos_token_ids = eos_token_ids
        # Prefix-cache key space; None disables caching for this request.
        self.cache_namespace = cache_namespace
        self.seed = seed  # keys the sampling noise of each output position (runtimes/llm/sampler.py)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks, in order
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # constrained decoding (params.structured): where the output stands in its grammar, advanced per token
        self.grammar: GrammarMatcher | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
