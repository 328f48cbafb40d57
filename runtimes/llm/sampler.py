"""Vectorized next-token sampler for the continuous-batching engine.

One call samples one token for every row of a `[B, V]` logits batch, each row with its own
`SamplingParams`. The pipeline, in order:

0-2. the logits processors (runtimes/llm/logits_processors.py), each on the rows that want it, in one batched call:
   `logit_bias` (OpenAI semantics); penalties: repetition (prompt + output tokens, vLLM semantics), then presence /
   frequency (output tokens only, OpenAI semantics); `min_tokens`: EOS and `stop_token_ids` get logit -inf while the
   output is shorter than `min_tokens`; then any the engine adds (a grammar's mask);
3. logprobs: `log_softmax` of the logits at this point, i.e. AFTER penalties and suppression but BEFORE
   temperature / top-k / top-p / min-p. This is vLLM's default ("raw" model distribution as adjusted by
   the request's penalties), so reported logprobs do not depend on how the token was sampled;
4. greedy rows take the argmax; random rows divide by temperature, apply top-k, top-p and min-p masks,
   and sample with the exponential race: `argmax(probs / q)`, `q ~ Exp(1)` (equivalent to Gumbel-max).

Noise: unseeded rows draw `q` in one batched call from the engine-wide generator. A seeded row (request `seed`)
draws its `[V]` vector from a generator seeded with a hash of (seed, output position): its token at each position
is a pure function of the seed, the position and the logits, so it depends neither on the rest of the batch, nor on
its place in it, nor on what ran before on this replica. A request resumed elsewhere with its first k tokens given
(runtimes/llm/input_processor.py) samples token k + 1 exactly as the undisturbed run did, and a step rerun after a fault
draws the same noise again. Noise is drawn on the logits' device, by the engine's generator there and a keyed
generator per device, so a GPU step copies no `[R, V]` noise from the host; greedy rows draw none. Draws are
reproducible on one kind of device (a CUDA generator's stream differs from the CPU's, and may differ between GPU
models), so a seeded request resumed on another replica continues exactly where both run the same hardware.

Host to device: what the random rows need (their rows, temperatures, top-k, top-p, min-p, which are unseeded) goes
in one copy (`upload`: from page-locked memory, not waiting, on CUDA), so a step of greedy and plain sampled rows
waits for the device once, when its tokens are read back. The processors and logprobs still copy and read back on
their own (their rows never run ahead: `on_device`).
Exp(1) is drawn as -log(1 - U), U uniform in [0, 1): on the CPU torch's `exponential_` took 1.09 ms for SmolLM2's
49,152 values and this 0.24 ms, a tenth of a batch-1 decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtimes.llm.attention.metadata import to_device
from runtimes.llm.logits_processors import BUILTIN_PROCESSORS, LogitsProcessor, SamplingRow

_NEG_INF = float("-inf")
# Exp(1) draws can be exactly 0; clamping keeps probs / q finite (1 / tiny < float32 max).
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [B]
    # [B] logprob of each sampled token, for every row as soon as one row asks; None when no row asks.
    logprobs: list[float] | None
    # Per row: the top-`params.logprobs` (token id, logprob) pairs sorted by logprob desc, followed by the
    # sampled token when it is not among them (so N or N+1 entries); None when the row did not ask.
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Samples one token per row; `generator` serves every row that has no generator of its own. `processors` edit
    the logits first, in their order (runtimes/llm/logits_processors.py; default: the built-ins)."""

    def __init__(self, generator: torch.Generator | None = None,
                 processors: Sequence[LogitsProcessor] = BUILTIN_PROCESSORS) -> None:
        self.generator = generator
        self.processors = tuple(processors)
        self._keyed: dict[torch.device, torch.Generator] = {}  # per device; reseeded per seeded row and position

    def on_device(self, row: SamplingRow) -> bool:
        """Whether the row's next token needs nothing but its logits (and, when random, its parameters and noise): no
        processor wants it and it asks no logprobs. `device_tokens` samples such rows without reading anything back.
        Once true for a row it stays true at its later tokens (the processors' `wants` promise it)."""
        return row.params.logprobs is None and not any(p.wants(row) for p in self.processors)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """`logits` `[B, V]` (any float dtype, any device), one `SamplingRow` per batch row."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"expected logits [{len(rows)}, V], got {tuple(logits.shape)}")
        wanted = [[i for i, r in enumerate(rows) if p.wants(r)] for p in self.processors]
        params = [r.params for r in rows]
        want_logprobs = any(p.logprobs is not None for p in params)
        if not want_logprobs and not any(wanted) and all(p.greedy for p in params):  # no [B, V] work at all
            return SamplerOutput(logits.argmax(dim=-1).tolist(), None, [None] * len(rows))

        x = logits.to(torch.float32, copy=True)  # [B, V]; a copy, as the processors edit it in place
        for processor, at in zip(self.processors, wanted, strict=True):
            if at:
                processor.apply(x, at, rows)
        logprobs = torch.log_softmax(x, dim=-1) if want_logprobs else None  # [B, V]

        tokens = self._draw(x, rows)
        token_ids = tokens.tolist()
        if logprobs is None:
            return SamplerOutput(token_ids, None, [None] * len(rows))
        sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()  # [B]
        top = logprobs.topk(max(p.logprobs or 0 for p in params), dim=-1)  # [B, N_max]
        top_ids, top_vals = top.indices.tolist(), top.values.tolist()
        top_logprobs: list[list[tuple[int, float]] | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                top_logprobs.append(None)
                continue
            ids = top_ids[i][: p.logprobs]
            entries = list(zip(ids, top_vals[i][: p.logprobs], strict=True))
            if token_ids[i] not in ids:
                entries.append((token_ids[i], sampled[i]))  # OpenAI reports the sampled token too
            top_logprobs.append(entries)
        return SamplerOutput(token_ids, sampled, top_logprobs)

    def device_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The rows' tokens `[B]` on the logits' device, without waiting for it, where every row needs nothing but
        its fp32 logits (`on_device`): what `__call__` would return, before it reads them back."""
        return self._draw(logits, rows)

    def _draw(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Token ids `[B]` from the final fp32 logits `x`: the argmax for greedy rows, a draw for the others."""
        tokens = x.argmax(dim=-1)  # [B]; final for greedy rows, row-local so independent of the batch
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if rand:
            plan = _RandomRows.upload(rows, rand, x.shape[1], x.device)
            tokens[plan.rows] = self._sample(x[plan.rows], [rows[i] for i in rand], plan)
        return tokens

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingRow], plan: _RandomRows) -> torch.Tensor:
        """Random rows only: `x` [R, V] penalised logits -> sampled token ids [R]."""
        x = x / plan.temperature  # [R, V]
        if plan.filtered is not None:  # only these rows pay for the topk / sort
            x[plan.filtered] = _mask_top_k_top_p(x[plan.filtered], plan)
        probs = x.softmax(dim=-1)  # [R, V]
        if plan.min_p is not None:
            threshold = plan.min_p * probs.amax(dim=-1, keepdim=True)  # [R, 1]
            # No renormalisation needed: argmax(probs / q) is invariant to scaling a row.
            probs = probs.masked_fill(probs < threshold, 0.0)
        return (probs / self._exponential(rows, probs.shape, x.device, plan.unseeded)).argmax(dim=-1)

    def _exponential(self, rows: Sequence[SamplingRow], shape: torch.Size, device: torch.device,
                     unseeded: torch.Tensor | None) -> torch.Tensor:
        """Exp(1) noise `[R, V]`: one batched draw for the `unseeded` rows, one keyed `[V]` draw per seeded row."""
        q = torch.empty(shape, device=device)  # [R, V]
        if unseeded is not None:
            gen = self.generator
            q[unseeded] = _exp1((unseeded.numel(), shape[1]), gen, gen.device if gen is not None else device
                                ).to(device)
        keyed = None
        for i, r in enumerate(rows):
            if r.seed is not None:
                keyed = keyed or self._keyed.setdefault(device, torch.Generator(device=device))
                keyed.manual_seed(position_seed(r.seed, len(r.output_token_ids)))
                q[i] = _exp1((shape[1],), keyed, device)
        return q.clamp_min_(_TINY)


@dataclass
class _RandomRows:
    """What sampling the random rows needs from the host, on the logits' device, uploaded in one copy."""

    rows: torch.Tensor  # [R] long: the random rows of the batch
    temperature: torch.Tensor  # [R, 1]
    filtered: torch.Tensor | None  # [F] long: those of them that use top_k or top_p (None: none does)
    top_k: torch.Tensor  # [F, 1] long (the vocabulary size where a row does not use it)
    top_p: torch.Tensor  # [F, 1]
    max_top_k: int
    any_top_p: bool
    min_p: torch.Tensor | None  # [R, 1] (None: no row uses it)
    unseeded: torch.Tensor | None  # [U] long: those without a seed of their own (None: every row has one)

    @classmethod
    def upload(cls, batch: Sequence[SamplingRow], rand: list[int], vocab: int, device: torch.device) -> _RandomRows:
        rows = [batch[i] for i in rand]
        filtered = [i for i, r in enumerate(rows) if r.params.top_k_enabled or r.params.top_p < 1.0]
        ks = [min(rows[i].params.top_k, vocab) if rows[i].params.top_k_enabled else vocab for i in filtered]
        ps = [rows[i].params.top_p for i in filtered]
        min_p = [r.params.min_p for r in rows]
        unseeded = [i for i, r in enumerate(rows) if r.seed is None]
        up = upload([rand, [r.params.temperature for r in rows], filtered, ks, ps, min_p, unseeded], device)
        return cls(up[0].long(), up[1].float().unsqueeze(1), up[2].long() if filtered else None,
                   up[3].long().unsqueeze(1), up[4].float().unsqueeze(1), max(ks, default=0),
                   any(p < 1.0 for p in ps), up[5].float().unsqueeze(1) if any(min_p) else None,
                   up[6].long() if unseeded else None)


def upload(columns: Sequence[Sequence[float]], device: torch.device) -> list[torch.Tensor]:
    """Host numbers to `device` in one copy (float64: exact for every index and id; `to_device`: not waiting on
    CUDA, so the step's only wait stays the tokens' readback), split back into columns."""
    flat = to_device([v for column in columns for v in column], torch.float64, device)
    return list(flat.split([len(column) for column in columns]))


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64's output function: a bijection on 64-bit integers that mixes every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed for a seeded sequence's token at output `position` (0 for the first generated token):
    nearby seeds and positions give unrelated streams."""
    return _splitmix64((seed & _MASK64) ^ _splitmix64(position))


def _exp1(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Exp(1) draws: -log(1 - U) for U uniform in [0, 1)."""
    return torch.rand(shape, generator=generator, device=device).neg_().log1p_().neg_()


def _mask_top_k_top_p(x: torch.Tensor, plan: _RandomRows) -> torch.Tensor:
    """Rows that use top_k and/or top_p: logits `[F, V]` outside the kept set -> -inf.

    Uses torch.topk when no row has top_p < 1, else one sort. top-p applies to the distribution
    renormalised after top-k (vLLM order) and keeps the smallest prefix whose mass reaches top_p.
    On the topk path, tokens tied with the k-th logit are all kept.
    """
    vocab = x.shape[1]
    k = plan.top_k  # [F, 1]
    if not plan.any_top_p:
        kth = x.topk(plan.max_top_k, dim=-1).values.gather(1, k - 1)  # [F, 1]
        return x.masked_fill(x < kth, _NEG_INF)
    sorted_x, order = x.sort(dim=-1, descending=True)  # [F, V]
    sorted_x = sorted_x.masked_fill(torch.arange(vocab, device=x.device) >= k, _NEG_INF)
    probs = sorted_x.softmax(dim=-1)  # [F, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [F, V]: mass of strictly better tokens
    top_p = plan.top_p  # [F, 1]
    # `top_p < 1` guard: float cumsum can reach 1.0 before the tail, which must not be cut for top_p=1.
    sorted_x = sorted_x.masked_fill((mass_before >= top_p) & (top_p < 1.0), _NEG_INF)
    return torch.empty_like(x).scatter_(1, order, sorted_x)
