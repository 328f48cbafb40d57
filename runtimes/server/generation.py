"""One request's run on the engine: its outputs, per-choice state, usage and latency metrics.

`start()` waits for the first output, so a request the engine refuses raises (a 400) before any
response starts. `outputs()` then streams; leaving it early (client gone) closes the engine's
iterator, which aborts the request and frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import structlog

from foundation.request_errors import OverloadedError, RequestFailedError
from runtimes.llm.async_engine import AsyncLLMEngine
from runtimes.llm.outputs import RequestOutput, TokenLogprob
from runtimes.llm.sampling_params import SamplingParams
from runtimes.server.metrics import ServerMetrics

log = structlog.get_logger(__name__)


@dataclass
class Choice:
    """What one of the request's `n` sequences has produced so far."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_s: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Generation:
    """Drives `engine.generate()` for one request and records what comes out."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int,
        metrics: ServerMetrics,
        clock: Callable[[], float],
        resume_token_ids: Sequence[int] = (),
        resumed_text: str = "",
    ) -> None:
        """`resume_token_ids`: what another replica generated of this request (n = 1); they count in its usage, and
        generation goes on after them. `resumed_text`: where the choice's text starts (theirs, for a whole reply)."""
        self.request_id = request_id
        self.choices = [Choice(i) for i in range(params.n)]
        self.choices[0].token_ids.extend(resume_token_ids)
        if resumed_text:
            self.choices[0].text_parts.append(resumed_text)
        self.num_prompt_tokens = 0
        self._metrics = metrics
        self._clock = clock
        self._start_s = clock()
        self._first_token_seen = False
        self._pending: RequestOutput | None = None
        self._closed = False
        # generate() is an async generator (annotated as an iterator): aclose() is what aborts the request.
        self._stream = cast(AsyncGenerator[RequestOutput, None], engine.generate(request_id, prompt, params, priority,
                                                                                  resume_token_ids))

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def start(self) -> None:
        """Wait for the first output; raises the engine's InvalidRequestError or OverloadedError if it refuses
        the request, at submission or (queue-wait limit) before it started."""
        try:
            self._pending = await anext(self._stream)
            self.num_prompt_tokens = self._pending.num_prompt_tokens
        except OverloadedError:
            self._metrics.observe_finish("rejected")
            raise
        except RequestFailedError:
            self._end_unfinished("error")
            raise

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        """Every output after `start()`, recorded; closing this early aborts the request."""
        if self._pending is None:
            raise RuntimeError(f"{self.request_id}: outputs() before start()")
        try:
            out, self._pending = self._pending, None
            self._record(out)
            yield out
            async for out in self._stream:
                self._record(out)
                yield out
        except RequestFailedError:
            self._end_unfinished("error")
            raise
        finally:
            await self.aclose()

    async def collect(self) -> list[Choice]:
        """Run to completion (non-streaming requests)."""
        async for _ in self.outputs():
            pass
        return self.choices

    def _end_unfinished(self, reason: str) -> None:
        """Sequences still running end with `reason` ("abort": cut short; "error": the engine failed them)."""
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.finish_reason = reason
                self._metrics.observe_finish(reason)

    def _record(self, out: RequestOutput) -> None:
        now = self._clock()
        choice = self.choices[out.index]
        if not self._first_token_seen and out.new_token_ids:
            self._first_token_seen = True
            self.num_prompt_tokens = out.num_prompt_tokens
            self._metrics.observe_first_token(now - self._start_s, out.num_prompt_tokens)
        if out.new_token_ids:
            itl = None if choice.last_token_s is None else now - choice.last_token_s
            self._metrics.observe_tokens(len(out.new_token_ids), itl)
            choice.last_token_s = now
        choice.text_parts.append(out.text)
        choice.token_ids.extend(out.new_token_ids)
        choice.logprobs.extend(out.logprobs or ())
        if out.finished:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
            self._metrics.observe_finish(out.finish_reason or "unknown")
            if self.finished:
                self._metrics.observe_request_done(now - self._start_s)

    async def aclose(self) -> None:
        """Abort whatever is still running (idempotent); sequences cut short count as aborted."""
        if self._closed:
            return
        self._closed = True
        await self._stream.aclose()
        self._end_unfinished("abort")
        log.info("request done", request_id=self.request_id, prompt_tokens=self.num_prompt_tokens,
                 completion_tokens=self.num_completion_tokens, finish_reasons=[c.finish_reason for c in self.choices],
                 e2e_s=round(self._clock() - self._start_s, 6))
