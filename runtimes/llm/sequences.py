"""The engine's table of requests and their sequences: a request with `n > 1` fans out into n samples, each a
sequence of its own (`RequestOutput.index`); samples after the first wait ("staged") until the first has computed
the prompt, then reuse its cached blocks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from runtimes.llm.detokenizer import IncrementalDetokenizer
from runtimes.llm.request import Request


@dataclass
class SequenceState:
    """Engine-side state of one sequence: the detokenizer and where its outputs go."""

    request: Request
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    first_token_time: float | None = None


class SequenceTable:
    def __init__(self) -> None:
        self._sequences: dict[str, SequenceState] = {}  # internal (child) request id -> state
        self._children: dict[str, list[str]] = {}  # request id -> its sequences' ids
        self._staged: dict[str, list[Request]] = {}  # request id -> samples waiting for sample 0's prompt

    def __contains__(self, request_id: str) -> bool:
        """Whether the request has a sample not finished yet."""
        return request_id in self._children

    def __bool__(self) -> bool:
        return bool(self._children)

    @property
    def has_staged(self) -> bool:
        return bool(self._staged)

    def get(self, child_id: str) -> SequenceState | None:
        return self._sequences.get(child_id)

    def add(self, request_id: str, sequences: list[SequenceState]) -> Request:
        """Record a request's sequences; returns the one to schedule now (the others are staged)."""
        for seq in sequences:
            self._sequences[seq.request.request_id] = seq
        self._children[request_id] = [seq.request.request_id for seq in sequences]
        if len(sequences) > 1:
            self._staged[request_id] = [seq.request for seq in sequences[1:]]
        return sequences[0].request

    def pop(self, request_id: str) -> Iterator[SequenceState]:
        """Forget the request: its sequences not finished yet (staged samples included, never scheduled)."""
        self._staged.pop(request_id, None)
        for child_id in self._children.pop(request_id, []):
            seq = self._sequences.pop(child_id, None)
            if seq is not None:  # else this sample had already finished
                yield seq

    def forget(self, seq: SequenceState) -> None:
        """A finished sequence; the request goes once all its samples have finished."""
        self._sequences.pop(seq.request.request_id, None)
        siblings = self._children.get(seq.parent_id)
        if siblings is not None and all(s not in self._sequences for s in siblings):
            del self._children[seq.parent_id]

    def release_staged(self) -> list[Request]:
        """The staged samples whose first sample has computed its prompt (or finished): to schedule now."""
        released: list[Request] = []
        for parent_id in list(self._staged):
            leader = self._sequences.get(self._children[parent_id][0])
            if leader is None or leader.request.num_computed_tokens >= leader.request.num_prompt_tokens:
                released += self._staged.pop(parent_id)
        return released
