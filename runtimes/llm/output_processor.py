"""The engine's outputs: a step's new tokens turned into `RequestOutput`s.

Each token is detokenized incrementally (a step may bring a request several: a verified draft); a stop string it
completes finishes the request (the text up to it is sent, not the stop string, nor the tokens after it), as does the
end of its grammar (constrained decoding: the grammar takes each token); a finished request's held-back text is
flushed; each token's logprob and its alternatives, the usage counts (prompt, output, cached tokens) and the
request's times go along.
"""

from __future__ import annotations

from collections.abc import Callable

from runtimes.llm.outputs import RequestOutput, TokenLogprob, TokenLogprobs
from runtimes.llm.request import RequestStatus
from runtimes.llm.scheduler import Scheduler
from runtimes.llm.sequences import SequenceState

Logprobs = dict[str, list[TokenLogprobs]]  # request id -> per new token: (logprob, top alternatives)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, clock: Callable[[], float]) -> None:
        self.scheduler = scheduler
        self.clock = clock

    def on_tokens(self, seq: SequenceState, tokens: list[int], logprobs: Logprobs, now: float) -> RequestOutput:
        """The output for the sequence's new tokens (one, or a verified draft's several), taken one at a time: a stop
        string one completes finishes the request there, and the tokens after it are dropped, as if never drawn."""
        request = seq.request
        if seq.first_token_time is None:
            seq.first_token_time = now
        text = ""
        ended = request.status.finished  # by the scheduler, at the last of `tokens` (a stop token, a length)
        for i, token in enumerate(tokens):
            text += self._take(seq, token)
            if i + 1 == len(tokens):
                break
            stopped = seq.detokenizer.stopped_by
            if stopped is not None and ended:  # a stop string before the scheduler's stop: it ends the output first
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stopped
            if request.status.finished and (stopped is not None or not ended):  # nothing after it was made
                self.scheduler.truncate(request, request.num_tokens - (len(tokens) - i - 1))
                tokens = tokens[:i + 1]
                break
        if request.status.finished and seq.detokenizer.stopped_by is None:
            text += seq.detokenizer.flush()
        entries = logprobs.get(request.request_id)
        lp = None if entries is None else [TokenLogprob(token, logprob, tuple(top or ()))
                                           for token, (logprob, top) in zip(tokens, entries, strict=False)]
        return self.output(seq, tokens, text, lp, now)

    def _take(self, seq: SequenceState, token: int) -> str:
        """One new token: through the request's grammar and the detokenizer (finishing the request at the grammar's
        end or a stop string); returns its text."""
        request = seq.request
        grammar = request.grammar
        if grammar is not None:  # the token was drawn under its mask: the grammar takes it
            if not grammar.accept(token):
                raise RuntimeError(f"the grammar refused token {token}, which its mask allowed")
            if grammar.is_terminated and not request.status.finished:  # nothing may follow: done
                # closed because its budget was nearly spent (grammar/closing.py): cut short, as at max_tokens
                self.scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH if grammar.closed_early
                                              else RequestStatus.FINISHED_STOPPED)
        text = seq.detokenizer.add(token)
        if seq.detokenizer.stopped_by is not None and not request.status.finished:
            request.stop_reason = seq.detokenizer.stopped_by
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        return text

    def output(self, seq: SequenceState, tokens: list[int], text: str, logprobs: list[TokenLogprob] | None,
               now: float | None = None) -> RequestOutput:
        request = seq.request
        finished = request.status.finished
        return RequestOutput(
            request_id=seq.parent_id, index=seq.index, new_token_ids=tokens, text=text, finished=finished,
            finish_reason=request.status.value if finished else None, stop_reason=request.stop_reason,
            logprobs=logprobs, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens, num_cached_tokens=request.num_cached_tokens,
            arrival_time=request.arrival_time, first_token_time=seq.first_token_time,
            time=self.clock() if now is None else now,
        )
