"""Built-in workloads: what each request asks (prompt text of a target length, max_tokens).

- `chat`: short prompts, medium answers (lognormal, median 128 / 128 tokens).
- `long-document`: long prompts (1,500–3,000 tokens), short answers (32–96).
- `mixed`: 80 % chat, 20 % long-document, interleaved at random.
- `shared-prefix`: RAG-style: each prompt is one of a few long documents (1,024 tokens) plus a short question
  (32 tokens); a server with prefix caching prefills each document once.
- `sweep`: the chat workload at several load levels (low/mid/high; see `bench.cli`).

Lengths can be overridden (`parse_length`: `fixed:256`, `uniform:20:120`, `lognormal:128:0.6`) or replayed from a
trace, whose arrival offsets then drive the schedule too.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.arrivals import TraceEntry
from bench.prompts import TokenFit, make_documents, with_question, words_text
from partitioner.simulate.workload import LengthDist

SHARED_PREFIX_DOCS = 4
SHARED_PREFIX_DOC_TOKENS = 1024


@dataclass(frozen=True)
class Component:
    """One kind of request in a workload, drawn with probability weight / total weight."""

    weight: float
    prompt_len: LengthDist
    output_len: LengthDist


@dataclass(frozen=True)
class Workload:
    name: str
    components: tuple[Component, ...]
    num_documents: int = 0  # > 0: shared-prefix (prompt_len is then the question's length)
    document_tokens: int = SHARED_PREFIX_DOC_TOKENS


@dataclass(frozen=True)
class PlannedRequest:
    prompt: str
    num_prompt_tokens_target: int
    max_tokens: int
    offset_s: float | None = None  # from a trace; None: the arrival process decides


_CHAT = Component(1.0, LengthDist("lognormal", median=128, low=16, high=1024, sigma=0.6),
                  LengthDist("lognormal", median=128, low=16, high=512, sigma=0.5))
_LONG = Component(1.0, LengthDist("uniform", low=1500, high=3000), LengthDist("uniform", low=32, high=96))
BUILTIN: dict[str, Workload] = {
    "chat": Workload("chat", (_CHAT,)),
    "long-document": Workload("long-document", (_LONG,)),
    "mixed": Workload("mixed", (replace(_CHAT, weight=0.8), replace(_LONG, weight=0.2))),
    "shared-prefix": Workload("shared-prefix", (Component(1.0, LengthDist("fixed", value=32),
                                                          LengthDist("fixed", value=64)),),
                              num_documents=SHARED_PREFIX_DOCS),
    "sweep": Workload("sweep", (_CHAT,)),
}


def parse_length(text: str) -> LengthDist:
    """`fixed:N`, `uniform:LOW:HIGH` or `lognormal:MEDIAN:SIGMA[:LOW:HIGH]` (tokens; a lognormal is given by its
    median, bounded by 1..2^20 unless LOW:HIGH say otherwise). Raises ValueError with the format."""
    kind, *args = text.split(":")
    try:
        numbers = [float(a) for a in args]
        if kind == "fixed" and len(numbers) == 1:
            return LengthDist("fixed", value=int(numbers[0]))
        if kind == "uniform" and len(numbers) == 2:
            return LengthDist("uniform", low=int(numbers[0]), high=int(numbers[1]))
        if kind == "lognormal" and len(numbers) in (2, 4):
            low, high = (int(numbers[2]), int(numbers[3])) if len(numbers) == 4 else (1, 1 << 20)
            return LengthDist("lognormal", median=int(numbers[0]), sigma=numbers[1], low=low, high=high)
    except ValueError as err:
        raise ValueError(f"length {text!r}: {err}") from None
    raise ValueError(f"length {text!r}: expected fixed:N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA[:LOW:HIGH]")


def with_lengths(workload: Workload, prompt_len: LengthDist | None, output_len: LengthDist | None) -> Workload:
    """The workload with every component's prompt and/or output lengths replaced."""
    components = tuple(replace(c, prompt_len=prompt_len or c.prompt_len, output_len=output_len or c.output_len)
                       for c in workload.components)
    return replace(workload, components=components)


def plan_requests(workload: Workload, count: int, fit: TokenFit, rng: random.Random,
                  documents_seed: int = 0) -> list[PlannedRequest]:
    """`count` requests of `workload`, their texts and lengths drawn from `rng` (documents from `documents_seed`)."""
    weights = [c.weight for c in workload.components]
    docs = make_documents(workload.num_documents, workload.document_tokens, fit, documents_seed)
    planned = []
    for _ in range(count):
        component = rng.choices(workload.components, weights)[0]
        num_prompt = component.prompt_len.sample(rng)
        max_tokens = component.output_len.sample(rng)
        if docs:
            prompt = with_question(rng.choice(docs), num_prompt, fit, rng)
            num_prompt += workload.document_tokens
        else:
            prompt = words_text(fit.words_for(num_prompt), rng)
        planned.append(PlannedRequest(prompt, num_prompt, max_tokens))
    return planned


def plan_from_trace(entries: Sequence[TraceEntry], fit: TokenFit, rng: random.Random) -> list[PlannedRequest]:
    """One request per trace line: its prompt length, output length and arrival offset."""
    return [PlannedRequest(words_text(fit.words_for(e.num_prompt_tokens), rng), e.num_prompt_tokens,
                           e.num_output_tokens, e.offset_s) for e in entries]
