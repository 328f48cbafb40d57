"""Executes a scheduler plan: packs the batch, runs the model over the paged KV cache, samples."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from runtimes.llm.attention import AttentionMetadata
from runtimes.llm.attention.metadata import to_device
from runtimes.llm.config import ModelConfig
from runtimes.llm.cuda_graphs import DecodeGraphs
from runtimes.llm.logits_processors import SamplingRow
from runtimes.llm.model import LlamaForCausalLM, PartialForward, StepInterrupted
from runtimes.llm.outputs import TokenLogprobs
from runtimes.llm.request import Request
from runtimes.llm.sampler import Sampler
from runtimes.llm.scheduler import ScheduledRequest, SchedulerOutput
from runtimes.llm.speculative import accepted, verification_rows

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def num_blocks_for_budget(config: ModelConfig, kv_cache_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    return kv_cache_bytes // (block_size * config.kv_bytes_per_token(dtype))


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCaches:
    """Per layer, K and V block pools: 2 x [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]


def sampling_row(request: Request) -> SamplingRow:
    """What the sampler needs of a request for its next token."""
    return SamplingRow(request.params, request.prompt_token_ids, request.output_token_ids, request.seed,
                       request.eos_token_ids, request.grammar, request.max_tokens)


@dataclass
class StepResult:
    # request id -> its new tokens: one, or with a draft verified the accepted proposal and the token after it
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # for each new token, where asked


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        block_size: int,
        device: torch.device,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.graphs: DecodeGraphs | None = None  # decode steps by graph replay, where the engine captured them
        self._readback = _Readback(device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, block_tables: Mapping[str, list[int]],
                interrupt: Callable[[], bool] | None = None) -> StepResult:
        """Run the plan; `interrupt` (asked between layers) may stop it with StepInterrupted, whose `partial` is a
        `SuspendedStep` that `resume` finishes. A step of decode rows only (one new token per request, or a draft's
        rows) replays a captured decode graph when there are graphs (`self.graphs`) and its rows fit them; it cannot
        be interrupted."""
        self._flush_denormals()
        input_ids, positions, query_lens, seq_lens, tables, sampling = _pack(plan.scheduled, block_tables)
        if self.graphs is not None and len(input_ids) == len(tables):  # decode rows only (a draft's rows included)
            hidden = self.graphs.run(input_ids, positions, tables)
            if hidden is not None:
                return self._sample(hidden, sampling)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        ids_t = to_device(input_ids, torch.long, self.device)
        pos_t = to_device(positions, torch.long, self.device)
        try:
            hidden = self.model(ids_t, pos_t, self.kv_caches, meta, interrupt)  # [T, H]
        except StepInterrupted as stop:
            assert isinstance(stop.partial, PartialForward)
            raise StepInterrupted(SuspendedStep(plan, meta, stop.partial, sampling)) from None
        return self._sample(hidden, sampling)

    @torch.inference_mode()
    def copy_block_prefix(self, source: int, destination: int, num_tokens: int) -> None:
        """Copy the KV of block `source`'s first `num_tokens` slots into block `destination`, in every layer (a
        prefix-cache hit that ends inside a block). On CUDA it is queued on the current stream, so it lands after the
        steps before it and before the step that reads it."""
        for k_cache, v_cache in self.kv_caches:
            k_cache[destination, :num_tokens] = k_cache[source, :num_tokens]
            v_cache[destination, :num_tokens] = v_cache[source, :num_tokens]

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput, block_tables: Mapping[str, list[int]],
               device_ids: torch.Tensor | None = None) -> PendingStep | None:
        """Start a decode step of one new token per request, each sampled from its logits alone (`Sampler.on_device`),
        by graph replay, without waiting for it: its tokens come back through `PendingStep.collect`. `device_ids`: the
        rows' input tokens on the device (a step still in flight samples them), instead of `token_ids[start]`; each
        row then counts that token among its outputs (a seeded row's noise is keyed by its output position). None
        when no graph holds the batch."""
        if self.graphs is None:
            return None
        scheduled = plan.scheduled
        input_ids = [0] * len(scheduled) if device_ids is not None else [
            item.request.token_ids[item.start] for item in scheduled]
        hidden = self.graphs.run(input_ids, [item.start for item in scheduled],
                                 [block_tables[item.request.request_id] for item in scheduled], device_ids)
        if hidden is None:
            return None
        rows = []
        for item in scheduled:
            request = item.request
            # the outputs as of this step's input: with a token still on its way, one more than known (a placeholder)
            outputs = request.token_ids[request.num_prompt_tokens:item.start + 1]
            outputs += [-1] * (item.start + 1 - request.num_prompt_tokens - len(outputs))
            rows.append(SamplingRow(request.params, (), outputs, request.seed, request.eos_token_ids))
        tokens = self.sampler.device_tokens(self.model.compute_logits(hidden), rows)  # [B], on the device
        return self._readback.start(tokens, [item.request.request_id for item in scheduled])

    @torch.inference_mode()
    def resume(self, step: SuspendedStep, interrupt: Callable[[], bool] | None = None) -> StepResult:
        """Finish a step that StepInterrupted stopped (nothing its requests hold may have changed meanwhile); it may
        stop again, with a new SuspendedStep."""
        self._flush_denormals()
        try:
            hidden = self.model.resume(step.partial, self.kv_caches, step.meta, interrupt)
        except StepInterrupted as stop:
            assert isinstance(stop.partial, PartialForward)
            raise StepInterrupted(SuspendedStep(step.plan, step.meta, stop.partial, step.sampling)) from None
        return self._sample(hidden, step.sampling)

    def without(self, step: SuspendedStep, request_ids: set[str], block_tables: Mapping[str, list[int]]
                ) -> SuspendedStep | None:
        """The stopped step less the requests `request_ids` (preempted meanwhile): their tokens' rows taken out of
        its hidden state, its batch metadata rebuilt for the rest. Rows are independent (each sequence attends only
        to its own KV), so the rest finish as they would have. None when nobody is left."""
        kept: list[ScheduledRequest] = []
        rows: list[int] = []
        offset = 0
        for item in step.plan.scheduled:
            if item.request.request_id not in request_ids:
                kept.append(item)
                rows.extend(range(offset, offset + item.num_query_tokens))
            offset += item.num_query_tokens
        if not kept:
            return None
        index = to_device(rows, torch.long, self.device)
        partial = step.partial
        cos, sin = partial.rope
        pruned = PartialForward(partial.next_layer, partial.x[index],
                                None if partial.residual is None else partial.residual[index], (cos[index], sin[index]))
        # the kept requests are as the step left them (StoppedSteps._take), so their rows pack as before
        _, _, query_lens, seq_lens, tables, sampling = _pack(kept, block_tables)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        return SuspendedStep(SchedulerOutput(scheduled=kept, urgent=step.plan.urgent), meta, pruned, sampling)

    def _flush_denormals(self) -> None:
        if self.device.type == "cpu":
            # Denormal floats (tiny activations, some dequantized weights) are 10-100x slower on x86 unless
            # flushed to zero; measured here: a 512-token SmolLM2 prefill step 3.2 s -> 0.59 s. Values below
            # 1.2e-38 cannot move fp32 logits. The flag is per thread, so set it on the thread that steps.
            torch.set_flush_denormal(True)

    def _sample(self, hidden: torch.Tensor, sampling: _Sampling) -> StepResult:
        """Each sampled row's token; a request with a draft has a row per proposed position, and keeps its
        proposal up to the first difference from those samples, then the sample there (`speculative.accepted`)."""
        result = StepResult()
        if not sampling.rows:
            return result
        logits = self.model.compute_logits(hidden[to_device(sampling.index, torch.long, self.device)])  # [B, V]
        out = self.sampler(logits, sampling.rows)
        for i, request_id in enumerate(sampling.request_ids):
            result.sampled.setdefault(request_id, []).append(out.token_ids[i])
            if out.logprobs is not None and sampling.rows[i].params.logprobs is not None:
                result.logprobs.setdefault(request_id, []).append((out.logprobs[i], out.top_logprobs[i]))
        for request_id, draft in sampling.drafts.items():
            samples = result.sampled[request_id]
            kept = result.sampled[request_id] = accepted(draft, samples)
            if request_id in result.logprobs:  # an accepted token's logprob is its sample's: they are equal
                del result.logprobs[request_id][len(kept):]
        return result


def _pack(items: Sequence[ScheduledRequest], block_tables: Mapping[str, list[int]]
          ) -> tuple[list[int], list[int], list[int], list[int], list[list[int]], _Sampling]:
    """A step's rows: input tokens, positions, query and sequence lengths, block tables, and what to sample. A
    request's new tokens are one query; a decode with a draft is one decode row per verified position instead
    (its known token, then each proposed token), each attending to the cache up to its own position, so each is
    computed as plain decoding would compute it there (the same kernel: the same bits on a batch-invariant one)."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sampling = _Sampling()
    for item in items:
        request, start, count = item.request, item.start, item.num_new_tokens
        table = block_tables[request.request_id]
        if item.draft:
            verified = [request.token_ids[start], *item.draft]
            input_ids.extend(verified)
            positions.extend(range(start, start + len(verified)))
            query_lens.extend([1] * len(verified))
            seq_lens.extend(range(start + 1, start + len(verified) + 1))
            tables.extend([table] * len(verified))
            first = len(input_ids) - len(verified)
            for j, row in enumerate(verification_rows(sampling_row(request), item.draft, item.draft_masks)):
                sampling.add(first + j, row, request.request_id)
            sampling.drafts[request.request_id] = item.draft
            continue
        input_ids.extend(request.token_ids[start : start + count])
        positions.extend(range(start, start + count))
        query_lens.append(count)
        seq_lens.append(start + count)
        tables.append(table)
        if item.samples:
            sampling.add(len(input_ids) - 1, sampling_row(request), request.request_id)
    return input_ids, positions, query_lens, seq_lens, tables, sampling


@dataclass
class _Sampling:
    """Which of a step's rows are sampled (their index in the batch), for whom and how; a request with a draft has
    one row per verified position, in order."""

    index: list[int] = field(default_factory=list)
    rows: list[SamplingRow] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> its proposal, verified by its rows

    def add(self, index: int, row: SamplingRow, request_id: str) -> None:
        self.index.append(index)
        self.rows.append(row)
        self.request_ids.append(request_id)


@dataclass
class SuspendedStep:
    """A step stopped between layers: its plan, batch metadata, where the forward pass stands and what to sample."""

    plan: SchedulerOutput
    meta: AttentionMetadata
    partial: PartialForward
    sampling: _Sampling


class _Readback:
    """Launched steps' tokens copied to the host without a sync: into one of two host buffers in turn (page-locked on
    CUDA), so that the next step's copy never overwrites tokens not yet collected; an event marks each copy's end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    def start(self, tokens: torch.Tensor, request_ids: list[str]) -> PendingStep:
        if not self._buffers or self._buffers[0].numel() < tokens.numel():
            pinned = self.device.type == "cuda"
            self._buffers = [torch.empty(max(tokens.numel(), 64), dtype=torch.int64, pin_memory=pinned)
                             for _ in range(2)]
        host = self._buffers[self._turn][:tokens.numel()]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        event = None
        if tokens.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return PendingStep(request_ids, tokens, host, event)


@dataclass
class PendingStep:
    """A launched step: its rows' request ids, their sampled tokens on the device (a next step's input) and on
    their way to the host."""

    request_ids: list[str]
    tokens: torch.Tensor  # [B] on the device
    host: torch.Tensor  # [B] filled by an asynchronous copy
    event: torch.cuda.Event | None  # recorded after that copy (CUDA)

    def collect(self) -> StepResult:
        """Wait for this step (not for anything launched after it) and return its tokens."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.host.tolist()
        return StepResult(sampled={request_id: [tokens[i]] for i, request_id in enumerate(self.request_ids)})
