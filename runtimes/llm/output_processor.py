"""The engine's outputs: a step's new tokens turned into `RequestOutput`s.

Each token is detokenized incrementally; a stop string it completes finishes the request (the text up to it is
sent, not the stop string), as does the end of its grammar (constrained decoding: the grammar takes each token);
a finished request's held-back text is flushed; the sampled token's logprob and its
alternatives, the usage counts (prompt, output, cached tokens) and the request's times go along.
"""

from __future__ import annotations

from collections.abc import Callable

from runtimes.llm.outputs import RequestOutput, TokenLogprob
from runtimes.llm.request import RequestStatus
from runtimes.llm.scheduler import Scheduler
from runtimes.llm.sequences import SequenceState

Logprobs = dict[str, tuple[float, list[tuple[int, float]] | None]]  # request id -> (logprob, top alternatives)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, clock: Callable[[], float]) -> None:
        self.scheduler = scheduler
        self.clock = clock

    def on_token(self, seq: SequenceState, logprobs: Logprobs, now: float) -> RequestOutput:
        """The output for the sequence's newest token (finishing the request on a stop string)."""
        request = seq.request
        token = request.token_ids[-1]
        if seq.first_token_time is None:
            seq.first_token_time = now
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
        if request.status.finished and seq.detokenizer.stopped_by is None:
            text += seq.detokenizer.flush()
        entry = logprobs.get(request.request_id)
        lp = None if entry is None else [TokenLogprob(token, entry[0], tuple(entry[1] or ()))]
        return self.output(seq, [token], text, lp, now)

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
