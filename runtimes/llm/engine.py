"""The synchronous engine core: submit requests, `step()` until done. One thread drives it.

Three stages, each in its own module: the input processor (validation, tokenization, `n` fan-out, resume), the step
loop (which kind of step runs next, run: runtimes/llm/step_loop.py) and the output processor (detokenizing, stop
strings, logprobs, usage). Beside the loop: request faults and the engine's self-check (request_faults.py).
`step()` reads as its job: run the next step, apply its results, turn them into outputs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

from foundation.request_errors import InvalidRequestError, OverloadedError
from policies.admission import RateMeter, retry_after_s
from registry.engine import WeightsChoice
from runtimes.fault_isolation import PROBE_TEXT
from runtimes.llm.attention import select_attention
from runtimes.llm.config import EngineConfig, resolve_kv_dtype
from runtimes.llm.cuda_graphs import Graph
from runtimes.llm.draft import DraftModelProposer, check_same_tokenizer
from runtimes.llm.engine_setup import build_parts, queue_policy
from runtimes.llm.grammar import CompiledGrammar
from runtimes.llm.input_processor import InputProcessor
from runtimes.llm.loader import LoadedModel, load_model
from runtimes.llm.logits_processors import LogitsProcessor
from runtimes.llm.output_processor import OutputProcessor
from runtimes.llm.outputs import RequestOutput
from runtimes.llm.queue_policy import QueuePolicy
from runtimes.llm.request import RequestStatus
from runtimes.llm.request_faults import RequestFaults
from runtimes.llm.sampling_params import SamplingParams
from runtimes.llm.scheduler import Scheduler
from runtimes.llm.sequences import SequenceTable
from runtimes.llm.speculative import Speculation
from runtimes.llm.step_loop import StepLoop
from runtimes.llm.steps import Ran


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, policy: QueuePolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, new_graph: Callable[[], Graph] | None = None,
                 logits_processors: Sequence[LogitsProcessor] = (), draft: LoadedModel | None = None) -> None:
        """`new_graph` makes the decode graphs (default: CUDA graphs on a CUDA device when `config.cuda_graphs`;
        tests pass a CPU stand-in). `logits_processors` edit the logits after the built-in ones. `draft`: with
        `config.speculative`, a smaller model of the same tokenizer that proposes instead of prompt lookup
        (runtimes/llm/draft.py), run by an engine of its own beside this one."""
        self.config = config = config or EngineConfig()
        self.model_config, self.tokenizer, self.model_name = loaded.config, loaded.tokenizer, loaded.name
        self.clock = clock
        parts = build_parts(loaded, config, new_graph, logits_processors)
        self.kv, self.runner, self.max_model_len = parts.kv, parts.runner, parts.max_model_len
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   policy if policy is not None else queue_policy(config, clock))
        self.sequences = SequenceTable()
        self.inputs = InputProcessor(self.tokenizer, loaded.config, self.max_model_len, self.kv,
                                     self.model_name if config.enable_prefix_caching else None, self.model_name)
        self.outputs = OutputProcessor(self.scheduler, clock)
        self.faults = RequestFaults(self.sequences, self.outputs, self.abort_request, self._start_self_check)
        speculative = config.speculative
        if (speculative is not None and speculative.method == "draft") != (draft is not None):
            raise ValueError("speculative.draft_model: a draft model is loaded exactly when speculative.method is "
                             f"'draft' (method {None if speculative is None else speculative.method!r}, draft "
                             f"{'given' if draft is not None else 'none'})")
        self.speculation = None if speculative is None else Speculation(
            speculative, self.scheduler, source=None if draft is None else self._draft_proposer(draft))
        self.loop = StepLoop(self.scheduler, self.runner, self.kv, self.max_model_len, config.overlap_steps,
                             quiet=lambda: not self.sequences.has_staged and self.faults.self_check_id is None,
                             speculation=self.speculation)
        self._limits = config.admission_limits()
        self._finishes = RateMeter()  # finished sequences per second, for Retry-After estimates
        self.num_steps = 0

    @classmethod
    def from_source(cls, source: str, config: EngineConfig | None = None, draft_source: str = "",
                    draft_weights: WeightsChoice = "auto", **kwargs: object) -> LLMEngine:
        """Load a model (GGUF file, HF directory or `package:file`) and build an engine for it; `draft_source`: its
        draft model's (with `speculative.method: draft`), in this model's dtype, its projections kept in block
        formats or not as its own `draft_weights` says (a float choice: all in this model's dtype)."""
        config = config or EngineConfig()
        device = config.resolve_device()
        attention_fn = select_attention(config.attention_backend, device)
        load = functools.partial(load_model, device=device, dtype=config.resolve_dtype(device),
                                 attention_fn=attention_fn)
        loaded = load(source, weights=config.weights)
        draft = load(draft_source, weights=draft_weights) if draft_source else None
        return cls(loaded, config, draft=draft, **kwargs)  # type: ignore[arg-type]

    def _draft_proposer(self, draft: LoadedModel) -> DraftModelProposer:
        """The draft model's proposer: an engine of its own over `draft`, on this engine's device, with a KV cache of
        as many tokens as this one's (its prefix cache keeps each sequence's computed tokens between proposals)."""
        check_same_tokenizer(self.tokenizer, draft.tokenizer, draft.config.vocab_size)
        config = self.config
        weight = next(draft.model.parameters())
        device = weight.device
        kv_dtype = resolve_kv_dtype(config.kv_dtype, weight.dtype, device)
        draft_config = EngineConfig(
            device=str(device), kv_dtype=config.kv_dtype, block_size=config.block_size,
            kv_cache_bytes=self.kv.num_blocks * self.kv.block_size * draft.config.kv_bytes_per_token(kv_dtype),
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            cuda_graphs=config.cuda_graphs, overlap_steps=False, deterministic=config.deterministic)
        assert config.speculative is not None
        return DraftModelProposer(LLMEngine(draft, draft_config), config.speculative.k)

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, resume_token_ids: Sequence[int] = (),
                    grammar: CompiledGrammar | None = None) -> None:
        """Validate and queue a request; raises InvalidRequestError naming the field and limit, OverloadedError
        when its queue is full. `resume_token_ids`, `grammar`: see `InputProcessor.process`."""
        if request_id in self.sequences:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        arrival = self.clock() if arrival_time is None else arrival_time
        sequences = self.inputs.process(request_id, prompt, params or SamplingParams(), priority, arrival,
                                        resume_token_ids, grammar)
        num_ahead = self.scheduler.waiting.num_ahead(priority)  # with multilevel scheduling: its lane and above
        if self._limits.queue_full(num_ahead):
            raise OverloadedError(
                f"the replica is overloaded: {num_ahead} requests are waiting ahead of this one, at its limit "
                f"max_queue_len={self._limits.max_queue_len}", self.retry_after_s())
        self.scheduler.add_request(self.sequences.add(request_id, sequences))

    def request_yield(self, priority: int) -> None:
        """A request of `priority` is on its way (safe from any thread): see `StoppedSteps.request`."""
        self.loop.stopped.request(priority)

    def clear_yield(self) -> None:
        """Queued arrivals are about to be taken in: a yield asked for them is no longer wanted."""
        self.loop.stopped.wanted.clear()

    def retry_after_s(self) -> float:
        """When a refused client should come back: the waiting queue at the recent finish rate."""
        return retry_after_s(len(self.scheduler.waiting), self._finishes.rate(self.clock()))

    def rejection_error(self, out: RequestOutput) -> OverloadedError:
        """What to tell the client of a request refused for waiting too long (finish_reason "rejected")."""
        return OverloadedError(
            f"the replica is overloaded: the request waited {out.time - out.arrival_time:.1f} s without starting, "
            f"over its limit max_queue_wait_s={self.config.max_queue_wait_s:g}", self.retry_after_s())

    def abort_request(self, request_id: str,
                      status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[RequestOutput]:
        """Stop a request (all its samples) and free its blocks at once; `status` says why."""
        outputs = []
        for seq in list(self.sequences.pop(request_id)):
            if not seq.request.status.finished:  # (staged samples never reached the queue: that is fine)
                self.scheduler.finish_request(seq.request, status)
            if seq.request.status == status:
                outputs.append(self.outputs.output(seq, [], "", None))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences)

    def is_finished(self, request_id: str) -> bool:
        """True once every sample of the request has finished (or it was never known)."""
        return request_id not in self.sequences

    def probe_prompt(self) -> list[int]:
        """A known-good prompt (the startup probe's and the self-check's)."""
        return self.tokenizer.encode(PROBE_TEXT) or [0]

    def step(self) -> list[RequestOutput]:
        """Refuse requests that waited too long, run the next step, apply its results."""
        outputs = self._expire_waiting()
        ran = self.loop.next()
        if ran is not None:
            outputs += self._apply(ran)
            self.loop.after(ran)
        return outputs

    def _apply(self, ran: Ran) -> list[RequestOutput]:
        """A step's results applied: failed requests ended, progress and tokens recorded, outputs made."""
        outputs: list[RequestOutput] = []
        for item, error in ran.faults:
            outputs += self.faults.fail(item.request.request_id, error)
        advanced = self.scheduler.update(ran.plan, ran.result.sampled)
        self.num_steps += 1
        now = self.clock()
        for request, tokens in advanced:
            seq = self.sequences.get(request.request_id)
            if seq is None:  # a sibling's fault ended it earlier in this loop
                continue
            try:
                outputs.append(self.outputs.on_tokens(seq, tokens, ran.result.logprobs, now))
            except Exception as error:  # detokenizing or stop strings: this request's fault only
                outputs += self.faults.fail(request.request_id, error)
                continue
            if request.status.finished:
                self.sequences.forget(seq)
        self._finishes.record(now, sum(1 for r, _ in advanced if r.status.finished))
        for request in self.sequences.release_staged():
            self.scheduler.add_request(request)
        self.faults.after_step()
        return outputs

    def _expire_waiting(self) -> list[RequestOutput]:
        """Refuse (finish_reason "rejected") requests that waited past `max_queue_wait_s` without starting."""
        cutoff = self._limits.wait_cutoff(self.clock())
        if cutoff is None:
            return []
        outputs: list[RequestOutput] = []
        for request in self.scheduler.expire_waiting(cutoff):
            seq = self.sequences.get(request.request_id)
            assert seq is not None, request.request_id
            outputs += self.abort_request(seq.parent_id, RequestStatus.FINISHED_REJECTED)
        return outputs

    def _start_self_check(self, request_id: str) -> None:
        """Queue a 1-token greedy request of the engine's own (no caller; outputs go nowhere)."""
        params = SamplingParams(temperature=0.0, max_tokens=1)
        sequences = self.inputs.sequences(request_id, self.probe_prompt(), params, 1, 0, self.clock())
        self.scheduler.add_request(self.sequences.add(request_id, sequences))

    # Counters, read by /metrics and tests.
    num_request_faults = property(lambda self: self.faults.num_request_faults)
    num_interrupted_steps = property(lambda self: self.loop.stopped.num_interrupted)
    num_dropped_steps = property(lambda self: self.loop.stopped.num_dropped)
    num_launched_steps = property(lambda self: self.loop.ahead.num_launched)
    num_graph_steps = property(lambda self: 0 if self.runner.graphs is None else self.runner.graphs.replays,
                               doc="Decode steps replayed from a captured graph.")

    @property
    def overlap_steps(self) -> bool:
        """Whether decode steps are launched ahead (runtimes/llm/steps/ahead.py); set False under a time-slice gate."""
        return self.loop.ahead.enabled

    @overlap_steps.setter
    def overlap_steps(self, enabled: bool) -> None:
        self.loop.ahead.enabled = enabled and self.runner.graphs is not None
