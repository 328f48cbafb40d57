"""Speculative decoding's draft model: a smaller model that shares the target's tokenizer proposes its greedy
continuation, and the target verifies it as it verifies prompt lookup's (runtimes/llm/speculative.py).

The draft runs in an engine of its own, in the same process, with its own KV cache (`DraftModelProposer`). Each
proposal is one request to that engine: the sequence so far as its prompt, up to k greedy tokens. Its prefix cache
keeps what earlier proposals computed (whole blocks shared, a last partial block copied), so a proposal prefills only
the tokens since the last one (the accepted ones and the target's own token); a rejected proposal's KV is never
matched again, which is all the rollback a draft needs. A step's proposals run together, as one batch of that
engine's (`lookup_many`: k draft steps for the whole batch, not k per sequence), between the target's planning and
its step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import structlog

from foundation.request_errors import OverloadedError
from runtimes.llm.sampling_params import SamplingParams
from runtimes.llm.speculative import Lookup

if TYPE_CHECKING:
    from runtimes.llm.outputs import RequestOutput
    from runtimes.llm.tokenizer import Tokenizer


class DraftEngine(Protocol):
    """What the proposer asks of the draft's engine (an `LLMEngine`: runtimes/llm/engine.py builds it)."""

    max_model_len: int

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def is_finished(self, request_id: str) -> bool: ...

    def abort_request(self, request_id: str) -> list[RequestOutput]: ...


log = structlog.get_logger(__name__)

DRAFT_KEY = 0  # `Lookup.key` of a draft model's proposals (prompt lookup's keys are match lengths, from 1)
SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789 {\"a\": [1, 2]} héllo, 世界!"


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_rows: int) -> None:
    """Refuse a draft whose token ids mean other text than the target's (its proposals would be noise): the two
    tokenizers must have one vocabulary and give the same ids for a sample text, and the draft's embedding must cover
    that vocabulary (models of one tokenizer often pad their embeddings differently: that is fine)."""
    if (target.vocab_size != draft.vocab_size or target.encode(SAMPLE_TEXT) != draft.encode(SAMPLE_TEXT)
            or draft_rows < target.vocab_size):
        raise ValueError(f"speculative.draft_model: the draft model's tokenizer differs from the target's "
                         f"(vocabulary {draft.vocab_size} against {target.vocab_size} tokens, embedding rows "
                         f"{draft_rows}, or other ids for the same text); a draft must share the target's tokenizer")


class DraftModelProposer:
    """Proposes up to `k` tokens: the draft engine's greedy continuation of the sequence so far."""

    key = DRAFT_KEY  # known before a proposal is made: speculation decides its depth first

    def __init__(self, engine: DraftEngine, k: int) -> None:
        self.engine = engine
        self.k = k
        self._ids = itertools.count()

    def index(self) -> None:
        """A draft keeps no per-sequence index: its engine's prefix cache is its memory."""
        return None

    def lookup(self, token_ids: Sequence[int], index: object, limit: int | None = None) -> Lookup | None:
        return self.lookup_many([(token_ids, index, self.k if limit is None else limit)])[0]

    def lookup_many(self, wanted: Sequence[tuple[Sequence[int], object, int]]) -> list[Lookup | None]:
        """Each (sequence so far, index, limit)'s proposal, up to min(k, limit) tokens, all made in one batch of the
        draft engine: its requests are stepped together until every one has its tokens. A sequence the draft's
        engine refuses (its pool cannot hold it) gets none; a failure of a step leaves nothing of the batch in the
        engine (and raises)."""
        engine = self.engine
        ids = [f"draft-{next(self._ids)}" for _ in wanted]
        tokens: dict[str, list[int]] = {}  # of the requests the engine took
        try:
            for request_id, (token_ids, _, limit) in zip(ids, wanted, strict=True):
                count = min(self.k, limit, engine.max_model_len - len(token_ids))
                if count <= 0:
                    continue
                try:
                    engine.add_request(request_id, list(token_ids),
                                       SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True))
                except (ValueError, OverloadedError) as refused:  # e.g. longer than the draft's pool holds
                    log.warning("draft_proposal_refused", tokens=len(token_ids), error=str(refused))
                    continue
                tokens[request_id] = []
            while any(not engine.is_finished(i) for i in tokens):
                for out in engine.step():
                    tokens[out.request_id] += out.new_token_ids
        finally:
            for i in tokens:
                if not engine.is_finished(i):  # a failure part-way: nothing of it stays
                    engine.abort_request(i)
        return [Lookup(got, self.key) if (got := tokens.get(i)) else None for i in ids]
