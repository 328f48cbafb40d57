"""Prompts of a target token length without the server's tokenizer (runs are offline; no hub download).

Text is drawn from a fixed word list. How many tokens a word costs on the server, and how many the request adds
around it (chat template, BOS), is measured once per run: two probe requests of different word counts, read back
through `usage.prompt_tokens`, give a line tokens = overhead + per_word × words (`TokenFit`). A server that reports
no usage gets the fallback fit (1.3 tokens per English word, the usual BPE ratio), and the record says so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORD_TEXT = """
the of and to in is was for on that with as by at from his her they we you it this are be have not or an but
which one all were when there can more been if will would their so about out up into time some could them
other than then now only its new years like two over also these first people any may after most made well
state way even many before must through back just where much between should because each those own under
work life while last might great little still public city world house school water large every during
system number part small place long hand high early come report local river field market morning light
engine memory cache block request server model token batch queue stream answer letter mountain weather garden
window table paper music story travel station bridge forest island harbor valley village kitchen winter
summer spring autumn doctor teacher student farmer writer painter builder sailor pilot driver
"""
WORDS = tuple(_WORD_TEXT.split())

PROBE_WORDS = (8, 48)  # far enough apart that rounding is small, short enough for models with small contexts


@dataclass(frozen=True)
class TokenFit:
    """Server tokens for a prompt of `w` words: `overhead_tokens + tokens_per_word * w`."""

    overhead_tokens: float = 0.0
    tokens_per_word: float = 1.3
    measured: bool = False

    @classmethod
    def from_probes(cls, probes: list[tuple[int, int]]) -> TokenFit:
        """The line through (words, prompt tokens) of two probes. Raises ValueError when it is not increasing."""
        (w1, t1), (w2, t2) = probes
        if w2 == w1 or t2 <= t1:
            raise ValueError(f"prompt tokens do not grow with words: probes {probes}")
        per_word = (t2 - t1) / (w2 - w1)
        return cls(overhead_tokens=t1 - per_word * w1, tokens_per_word=per_word, measured=True)

    def words_for(self, num_tokens: int) -> int:
        """Words that make about `num_tokens` prompt tokens (at least one)."""
        return max(1, round((num_tokens - self.overhead_tokens) / self.tokens_per_word))


def words_text(num_words: int, rng: random.Random) -> str:
    """`num_words` words drawn from the list, with a full stop every 12 so text looks like sentences."""
    words = [rng.choice(WORDS) for _ in range(num_words)]
    for i in range(11, num_words, 12):
        words[i] += "."
    return " ".join(words)


@dataclass(frozen=True)
class Document:
    """A long shared text (RAG-style context) that many requests start with."""

    doc_id: int
    text: str


def make_documents(count: int, num_tokens: int, fit: TokenFit, seed: int) -> list[Document]:
    """`count` distinct documents of about `num_tokens` prompt tokens each (deterministic in `seed`)."""
    rng = random.Random(seed)
    return [Document(i, f"Document {i}. " + words_text(fit.words_for(num_tokens), rng)) for i in range(count)]


def with_question(doc: Document, num_tokens: int, fit: TokenFit, rng: random.Random) -> str:
    """The document, then a question of about `num_tokens` tokens (only the suffix differs between requests)."""
    question = words_text(max(1, round(num_tokens / fit.tokens_per_word)), rng)
    return f"{doc.text}\n\nQuestion: {question}?"


# Plain English sentences for the measurement scripts' prompts and embedding inputs.
SENTENCES = """The river rose slowly through the night and by morning the lower fields were under water.
Engineers measure latency in milliseconds, but users remember only whether the page felt fast.
A paged cache splits memory into fixed blocks so that sequences of any length can share one pool.
Compilers turn loops into vector instructions when they can prove the iterations are independent.
The committee postponed its decision until the spring, citing the need for more public comment.
Photosynthesis converts light, water and carbon dioxide into sugar and releases oxygen as a by-product.
In the old market, merchants still weigh spices on brass scales and write receipts by hand.
Throughput grows with batch size until the arithmetic units, not the memory bus, become the limit.
Mountain weather changes quickly; a clear sky at noon can turn to hail within the hour.
Every request carries its own position, its own slots in the cache and its own stopping rule.
He translated the letter twice, once literally and once the way his grandmother would have said it.
A good benchmark fixes its inputs, repeats its runs and reports the median rather than the best.""".splitlines()
