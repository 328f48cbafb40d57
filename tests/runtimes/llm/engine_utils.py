"""Drive an LLMEngine synchronously in tests and collect per-sequence results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from runtimes.llm.engine import LLMEngine
from runtimes.llm.sampling_params import SamplingParams


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: object = None
    num_cached_tokens: int = 0
    logprobs: list = field(default_factory=list)
    num_outputs: int = 0


def run_to_completion(
    engine: LLMEngine,
    requests: Mapping[str, tuple[str | Sequence[int], SamplingParams]],
    max_steps: int = 10_000,
) -> dict[str, Collected]:
    """Submit all requests, step until done; results keyed by request id (`id#i` for n > 1 samples).

    Requests submitted earlier to the same engine are driven to completion and collected too.
    """
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, Collected] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            n = requests[out.request_id][1].n if out.request_id in requests else 1
            key = out.request_id if n == 1 else f"{out.request_id}#{out.index}"
            got = results.setdefault(key, Collected())
            got.token_ids += out.new_token_ids
            got.text += out.text
            got.num_outputs += 1
            got.num_cached_tokens = out.num_cached_tokens
            if out.logprobs:
                got.logprobs += out.logprobs
            if out.finished:
                got.finish_reason, got.stop_reason = out.finish_reason, out.stop_reason
    else:
        raise AssertionError(f"engine did not finish within {max_steps} steps")
    return results
