"""The synchronous engine core: submit requests, `step()` until done. One thread drives it.

`step()` reads as its job: schedule a plan, run it, apply the results, turn them into outputs.

A fault while serving one request fails that request only (finish_reason "error", with an id in the log): the
step is retried without it (runtimes/fault_isolation.py). After such a fault the engine runs a self-check,
a 1-token greedy request of its own; if that fails too, the engine itself is broken and `step()` raises
EngineFaultError, which ends the engine loop (the replica then reports itself dead and is restarted).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch

from foundation.request_errors import ContextLengthError, InvalidRequestError, OverloadedError, record_failure
from policies.admission import RateMeter, retry_after_s
from runtimes.cuda_memory import default_kv_bytes
from runtimes.fault_isolation import PROBE_TEXT, EngineFaultError, run_isolating
from runtimes.llm.attention import select_attention
from runtimes.llm.config import EngineConfig, resolve_kv_dtype
from runtimes.llm.cuda_graphs import DecodeGraphs, Graph, capture_sizes, cuda_graph_factory, graphs_apply
from runtimes.llm.detokenizer import IncrementalDetokenizer
from runtimes.llm.kv_cache_manager import KVCacheManager
from runtimes.llm.loader import LoadedModel, load_model
from runtimes.llm.model import StepInterrupted
from runtimes.llm.model_runner import (
    ModelRunner,
    PendingStep,
    StepResult,
    SuspendedStep,
    allocate_kv_caches,
    num_blocks_for_budget,
)
from runtimes.llm.outputs import RequestOutput, TokenLogprob
from runtimes.llm.queue_policy import FCFSPolicy, QueuePolicy
from runtimes.llm.request import Request, RequestStatus
from runtimes.llm.sampler import Sampler, on_device
from runtimes.llm.sampling_params import SamplingParams, check_token_ids
from runtimes.llm.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

_CPU_DEFAULT_KV_BYTES = 1 << 30

log = structlog.get_logger(__name__)

_Ran = tuple[StepResult, list[tuple[ScheduledRequest, Exception]]]  # a step's results, and the requests that failed


@dataclass
class _Sequence:
    """Engine-side state of one sequence: the detokenizer and where its outputs go."""

    request: Request
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    first_token_time: float | None = None


@dataclass
class _InFlight:
    """A decode step launched ahead (`LLMEngine._launch_ahead`): its plan and its tokens on their way."""

    plan: SchedulerOutput
    pending: PendingStep


class LLMEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        policy: QueuePolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        new_graph: Callable[[], Graph] | None = None,
    ) -> None:
        """`new_graph` makes the decode graphs (default: CUDA graphs on a CUDA device when `config.cuda_graphs`;
        tests pass a CPU stand-in)."""
        self.config = config = config or EngineConfig()
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.clock = clock
        if config.deterministic:
            from runtimes.llm import batch_invariant  # Triton: imported only when asked for

            batch_invariant.apply(loaded.model)
        device = next(loaded.model.parameters()).device
        dtype = next(loaded.model.parameters()).dtype
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        budget = config.kv_cache_bytes or _default_kv_bytes(device, config.kv_cache_memory_fraction)
        kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype, device)
        num_blocks = num_blocks_for_budget(loaded.config, budget, config.block_size, kv_dtype)
        if new_graph is None and config.cuda_graphs and device.type == "cuda":
            new_graph = cuda_graph_factory()
        if new_graph is not None and not graphs_apply(loaded.model, kv_dtype):
            log.warning("decode_graphs_off", reason="the attention backend reads host metadata",
                        attention_backend=config.attention_backend)
            new_graph = None
        reserved = 0 if new_graph is None else 1  # the decode graphs' pad block, out of the block pool
        if num_blocks < 1 + reserved:
            raise ValueError(f"kv_cache_bytes={budget} is too small for {1 + reserved} blocks of "
                             f"{config.block_size} tokens")
        self.kv = KVCacheManager(num_blocks - reserved, config.block_size)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            policy if policy is not None else _queue_policy(config, clock),
        )
        kv_caches = allocate_kv_caches(loaded.config, num_blocks, config.block_size, kv_dtype, device)
        sampler = Sampler(torch.Generator(device=device).manual_seed(config.seed))  # noise drawn where the logits are
        self.runner = ModelRunner(loaded.model, kv_caches, config.block_size, device, sampler)
        self.kv.copy_prefix = self.runner.copy_block_prefix  # prefix hits that end inside a block
        if new_graph is not None:
            started = time.perf_counter()
            self.runner.graphs = DecodeGraphs(loaded.model, kv_caches, config.block_size,
                                              -(-self.max_model_len // config.block_size), num_blocks - 1,
                                              capture_sizes(config.max_num_seqs), new_graph)
            log.info("decode_graphs_captured", sizes=self.runner.graphs.sizes,
                     seconds=round(time.perf_counter() - started, 2))
        self._sequences: dict[str, _Sequence] = {}  # internal (child) request id -> state
        self._children: dict[str, list[str]] = {}  # request id -> its sequences' ids
        self._staged: dict[str, list[Request]] = {}  # request id -> samples waiting for sample 0's prompt
        self._limits = config.admission_limits()
        self._finishes = RateMeter()  # finished sequences per second, for Retry-After estimates
        self._self_check_id: str | None = None  # the self-check in flight after a request fault
        self.num_steps = 0
        self.num_request_faults = 0
        # Set from other threads (`request_yield`): the step in flight stops at its next layer boundary.
        self._yield_wanted = threading.Event()
        self.num_interrupted_steps = 0  # steps stopped between layers for an arrival ...
        self.num_dropped_steps = 0  # ... and of those, the ones not finished later (their work is redone)
        self._suspended: SuspendedStep | None = None  # a stopped step, finished after the arrival's step
        # Decode steps launched before the previous one's tokens are read (`_launch_ahead`): with graphs only, and
        # off under a time-slice gate (the device's work would outlast the step's lease).
        self.overlap_steps = config.overlap_steps and self.runner.graphs is not None
        self._inflight: _InFlight | None = None  # a launched step, its results not yet applied
        self.num_launched_steps = 0

    @classmethod
    def from_source(cls, source: str, config: EngineConfig | None = None, **kwargs: object) -> LLMEngine:
        """Load a model (GGUF file, HF directory or `package:file`) and build an engine for it."""
        config = config or EngineConfig()
        device = config.resolve_device()
        dtype = config.resolve_dtype(device)
        attention_fn = select_attention(config.attention_backend, device)
        loaded = load_model(source, device, dtype, attention_fn, weights=config.weights)
        return cls(loaded, config, **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------------ intake

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> None:
        """Validate and queue a request; raises InvalidRequestError naming the field and limit.

        `resume_token_ids` continues a request another replica started (n = 1 only): the tokens it had generated
        count as this request's first outputs (for max_tokens, min_tokens, penalties, stop strings and the seeded
        noise's positions), are computed like a prompt, and are not output again; generation picks up after them.
        Greedy and seeded requests so produce what the undisturbed run would have.
        """
        params = params or SamplingParams()
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self._validate(prompt_ids, params)
        resumed = self._validate_resume(list(resume_token_ids), params, max_tokens)
        self._admit(priority)
        self._enqueue(request_id, prompt_ids, params, max_tokens, priority,
                      self.clock() if arrival_time is None else arrival_time, resumed)

    def request_yield(self, priority: int) -> None:
        """A request of `priority` is on its way (queued for the engine's thread; safe to call from any thread): if
        the queue policy gives such arrivals a step of their own (`QueuePolicy.yields_to`), the step in flight stops
        at its next layer boundary, its work to be redone, so that the arrival's prefill starts at once instead of
        after a step of other prompts' chunks."""
        if self.scheduler.waiting.yields_to(priority):
            self._yield_wanted.set()

    def clear_yield(self) -> None:
        """Queued arrivals are about to be taken in: a yield asked for them is no longer wanted."""
        self._yield_wanted.clear()

    def _validate_resume(self, resumed: list[int], params: SamplingParams, max_tokens: int) -> list[int]:
        if not resumed:
            return resumed
        param = "resume.token_ids"
        if params.n != 1:
            raise InvalidRequestError(f"a resumed request must have n = 1, got n = {params.n}", param=param)
        check_token_ids(resumed, self.model_config.vocab_size, param)
        if len(resumed) >= max_tokens:
            raise InvalidRequestError(f"{len(resumed)} tokens already generated leave nothing of max_tokens="
                                      f"{max_tokens} to resume", param=param)
        return resumed

    def _enqueue(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 priority: int, arrival: float, resumed: Sequence[int] = ()) -> None:
        """Queue a validated request: every sample is built before any state changes, so a failure leaves none."""
        namespace = self.model_name if self.config.enable_prefix_caching else None
        if namespace is None and params.n > 1:
            namespace = f"{self.model_name}/group/{request_id}"  # siblings still share the prompt's blocks
        sequences = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seed = None if params.seed is None else params.seed + index
            request = Request(child_id, prompt_ids, params, max_tokens, arrival, priority,
                              self.model_config.eos_token_ids, namespace, seed, resumed)
            # the text the resumed tokens made was sent already: only the detokenizer's state is wanted
            detok, _ = IncrementalDetokenizer.resumed(self.tokenizer, resumed,
                                                      skip_special_tokens=params.skip_special_tokens, stop=params.stop)
            if detok.finished:
                raise InvalidRequestError(f"the resumed tokens already end in the stop string {detok.stopped_by!r}",
                                          param="resume.token_ids")
            sequences.append(_Sequence(request, request_id, index, detok))
        for seq in sequences:
            self._sequences[seq.request.request_id] = seq
        self._children[request_id] = [seq.request.request_id for seq in sequences]
        self.scheduler.add_request(sequences[0].request)
        if len(sequences) > 1:
            # The other samples wait until sample 0 has computed the prompt, then reuse its cached blocks.
            self._staged[request_id] = [seq.request for seq in sequences[1:]]

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        check_token_ids(prompt_ids, vocab, "prompt")
        params.check_vocab(vocab)
        limit = self.max_model_len
        num_prompt = len(prompt_ids)
        if num_prompt >= limit:
            raise ContextLengthError(
                f"the prompt has {num_prompt} tokens; this model's maximum context length is {limit} tokens "
                "including at least one generated token", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens, but {num_prompt + max_tokens} were "
                f"requested ({num_prompt} in the prompt, {max_tokens} in max_tokens)", param="max_tokens")
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this "
                                      "request may generate", param="min_tokens")
        capacity = self.kv.num_blocks * self.kv.block_size
        if num_prompt + max_tokens > capacity:
            raise InvalidRequestError(
                f"prompt plus max_tokens is {num_prompt + max_tokens} tokens but the KV cache holds at most "
                f"{capacity} tokens ({self.kv.num_blocks} blocks of {self.kv.block_size})", param="max_tokens")
        return max_tokens

    def _admit(self, priority: int) -> None:
        """Raise OverloadedError when the queue this request would wait in is at its limit (with multilevel
        scheduling, only requests of its own or a more urgent lane count)."""
        num_ahead = self.scheduler.waiting.num_ahead(priority)
        if self._limits.queue_full(num_ahead):
            raise OverloadedError(
                f"the replica is overloaded: {num_ahead} requests are waiting ahead of this one, at its limit "
                f"max_queue_len={self._limits.max_queue_len}", self.retry_after_s())

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
        self._staged.pop(request_id, None)
        for child_id in self._children.pop(request_id, []):
            seq = self._sequences.pop(child_id, None)
            if seq is None:  # this sample had already finished
                continue
            if not seq.request.status.finished:  # (staged samples never reached the queue: that is fine)
                self.scheduler.finish_request(seq.request, status)
            if seq.request.status == status:
                outputs.append(self._output(seq, [], "", None))
        return outputs

    @property
    def num_graph_steps(self) -> int:
        """Decode steps replayed from a captured graph."""
        return 0 if self.runner.graphs is None else self.runner.graphs.replays

    def has_unfinished_requests(self) -> bool:
        return bool(self._children)

    def is_finished(self, request_id: str) -> bool:
        """True once every sample of the request has finished (or it was never known)."""
        return request_id not in self._children

    # ------------------------------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """One step: its plan run and its results applied. With a step in flight (`overlap_steps`), the step after it
        is launched first, then the one in flight is waited for and its results applied."""
        outputs = self._expire_waiting()
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._inflight = self._launch_ahead(inflight)
            return outputs + self._apply(inflight.plan, inflight.pending.collect(), [])
        chosen = self._choose_step()
        if chosen is None:
            return outputs
        plan, run = chosen
        try:
            ran = run()
        except StepInterrupted as stop:
            self._suspend(stop.partial, plan)
            return outputs
        if ran is None:  # a stopped step that failed when finished: dropped, its plan runs again
            return outputs
        outputs += self._apply(plan, *ran)
        self._inflight = self._launch_ahead(None)
        return outputs

    def _launch_ahead(self, inflight: _InFlight | None) -> _InFlight | None:
        """Start the next decode step without waiting for it, when its plan is certain: every running request takes
        one more token sampled from its logits alone (no penalty, bias, suppression or logprobs), nothing waits to be
        admitted, a graph holds the batch, and each has its slot (allocated here). After a step in flight
        (`inflight`), the same requests go on from its tokens, read on the device; those it finishes (a stop token)
        waste the token computed for them here. None: no step launched. Unseeded random rows draw from the engine's
        generator in the same order, but a wasted row's draw shifts the later ones: only greedy and seeded requests
        reproduce exactly (as everywhere: a batch's make-up changes unseeded draws)."""
        graphs = self.runner.graphs
        running = self.scheduler.running
        if (not self.overlap_steps or graphs is None or not running or len(running) > graphs.max_size
                or len(self.scheduler.waiting) or self._staged or self._suspended is not None
                or self._self_check_id is not None or self._yield_wanted.is_set()):
            return None
        ahead = 0 if inflight is None else 1
        if inflight is None:
            requests = list(running)
        else:
            requests = [item.request for item in inflight.plan.scheduled]
            if len(requests) != len(running) or any(r.status != RequestStatus.RUNNING for r in requests):
                return None
        for r in requests:
            # the step's input must exist and its output be wanted: not past max_tokens or the context
            if (r.num_tokens - r.num_computed_tokens != 1 or r.num_output_tokens + ahead >= r.max_tokens
                    or r.num_tokens + ahead >= self.max_model_len
                    or not on_device(r.params, r.num_output_tokens)):
                return None
        plan = self.scheduler.plan_ahead(requests, ahead)
        if plan is None:
            return None
        try:
            pending = self.runner.launch(plan, self.kv.block_tables,
                                         None if inflight is None else inflight.pending.tokens)
        except Exception as error:  # the ordinary steps take over: they plan these tokens again, isolating faults
            log.error("launch_ahead_failed", error=repr(error), batch=len(requests))
            self.overlap_steps = False
            return None
        if pending is None:
            return None
        self.num_launched_steps += 1
        return _InFlight(plan, pending)

    def _apply(self, plan: SchedulerOutput, result: StepResult,
               faults: list[tuple[ScheduledRequest, Exception]]) -> list[RequestOutput]:
        """A step's results applied: failed requests ended, progress and tokens recorded, outputs made."""
        outputs: list[RequestOutput] = []
        for item, error in faults:
            outputs += self._fail(item.request.request_id, error)
        advanced = self.scheduler.update(plan, result.sampled)
        self.num_steps += 1
        now = self.clock()
        for request in advanced:
            seq = self._sequences.get(request.request_id)
            if seq is None:  # a sibling's fault ended it earlier in this loop
                continue
            try:
                outputs.append(self._on_token(seq, result.logprobs, now))
            except Exception as error:  # detokenizing or stop strings: this request's fault only
                outputs += self._fail(request.request_id, error)
        self._finishes.record(now, sum(1 for r in advanced if r.status.finished))
        self._release_staged()
        if self._self_check_id is not None and self.is_finished(self._self_check_id):
            self._self_check_id = None  # it passed: the faults were the requests' own
        return outputs


    def _choose_step(self) -> tuple[SchedulerOutput, Callable[[], _Ran | None]] | None:
        """The step to run, and how: a stopped step is finished, unless an arrival due a step of its own fits first
        (the stopped one is then kept for after it); else the scheduler's plan. An arrival due a step of its own that
        does not fit in one gets into the scheduler's ordinary plan at once, as without a stopped step: the stopped
        one is dropped then (its requests run those tokens again). None: nothing to run."""
        suspended = self._take_suspended()
        if suspended is not None:
            due = self.scheduler.urgent_head() is not None
            urgent = self.scheduler.schedule_urgent()
            held = {item.request.request_id for item in suspended.plan.scheduled}
            if displaced := {r.request_id for r in urgent.preempted} & held:
                suspended = self._without(suspended, displaced)
            if suspended is not None and urgent.is_empty and not due:
                self.scheduler.waiting.on_step(False)  # a step like any other for the urgent steps' share
                return suspended.plan, functools.partial(self._resume, suspended, self._interrupt_for(suspended.plan))
            if not urgent.is_empty:
                self._suspended = suspended
                return urgent, functools.partial(self._execute, urgent, None)
            if suspended is not None:
                self.num_dropped_steps += 1
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        return plan, functools.partial(self._execute, plan, self._interrupt_for(plan))

    def _interrupt_for(self, plan: SchedulerOutput) -> Callable[[], bool] | None:
        """What may stop `plan` between layers: a yield asked for an arrival (`request_yield`), unless the policy
        spares the step (an urgent one, or one that starts an urgent request's prompt)."""
        chunks = [item.request for item in plan.scheduled if item.num_new_tokens > 1]
        if plan.urgent or not self.scheduler.waiting.step_yields(chunks):
            return None
        return self._yield_wanted.is_set

    def _suspend(self, partial: object, plan: SchedulerOutput) -> None:
        """Keep a step that stopped between layers to finish after the arrival's step; one stopped inside the fault
        isolation's reruns (a part of its batch) is dropped instead, to be planned again."""
        self._yield_wanted.clear()
        self.num_interrupted_steps += 1
        if isinstance(partial, SuspendedStep) and len(partial.plan.scheduled) == len(plan.scheduled):
            self._suspended = partial

    def _take_suspended(self) -> SuspendedStep | None:
        """The stopped step to finish, if its requests are as it left them (running, at the same progress); else it
        is dropped (an abort in between freed blocks it would write to), and its requests compute those tokens again
        in a later step. Their blocks cannot have changed otherwise: meanwhile only urgent steps run, which schedule
        none of them, and a request such a step displaces leaves the stopped step (`_without`)."""
        suspended, self._suspended = self._suspended, None
        if suspended is None:
            return None
        if any(item.request.status != RequestStatus.RUNNING or item.request.num_computed_tokens != item.start
               for item in suspended.plan.scheduled):
            self.num_dropped_steps += 1
            return None
        return suspended

    def _without(self, suspended: SuspendedStep, request_ids: set[str]) -> SuspendedStep | None:
        """The stopped step less requests the arrival displaced (their blocks are freed: the step must not write
        them); None, counted as dropped, if nobody is left."""
        pruned = self.runner.without(suspended, request_ids, self.kv.block_tables)
        if pruned is None:
            self.num_dropped_steps += 1
        return pruned

    def _resume(self, suspended: SuspendedStep, interrupt: Callable[[], bool] | None) -> _Ran | None:
        """Finish a stopped step; None when that fails. Such a fault is not isolated here: the step is dropped, and
        the next run of its requests (bisected as usual) finds whose it was."""
        try:
            return self.runner.resume(suspended, interrupt), []
        except Exception as error:
            log.warning("a stopped step failed when finished; its requests run it again", error=repr(error))
            self.num_dropped_steps += 1
            return None

    def _execute(self, plan: SchedulerOutput, interrupt: Callable[[], bool] | None) -> _Ran:
        """Run the plan; a request that makes it fail is left out (with its error) and the rest run without it.
        `interrupt`: see `ModelRunner.execute` (StepInterrupted passes through)."""
        # A rerun is harmless: progress is counted, and seeded noise is keyed by position (runtimes/llm/sampler.py).
        outcome = run_isolating(
            lambda part: self.runner.execute(SchedulerOutput(scheduled=list(part)), self.kv.block_tables, interrupt),
            plan.scheduled)
        if len(outcome.parts) == 1:
            return outcome.parts[0][1], outcome.faults
        result = StepResult()
        for _, part_result in outcome.parts:
            result.sampled.update(part_result.sampled)
            result.logprobs.update(part_result.logprobs)
        return result, outcome.faults

    def probe_prompt(self) -> list[int]:
        """A known-good prompt (the startup probe's and the self-check's)."""
        return self.tokenizer.encode(PROBE_TEXT) or [0]

    def _fail(self, child_id: str, error: Exception) -> list[RequestOutput]:
        """End the request that `child_id` belongs to (all its samples) with finish_reason "error", free its
        blocks, log the traceback under an error id, and start a self-check of the engine."""
        seq = self._sequences.get(child_id)
        parent_id = child_id if seq is None else seq.parent_id
        if parent_id == self._self_check_id:
            raise EngineFaultError(f"the engine failed its self-check after a request fault: {error!r}") from error
        error_id = record_failure("request failed in the engine; it alone is stopped", parent_id, error)
        self.num_request_faults += 1
        outputs = self.abort_request(parent_id, RequestStatus.FINISHED_ERROR)
        if not outputs and seq is not None:  # it had just finished when the fault came: still tell its caller
            outputs = [self._output(seq, [], "", None)]
        for out in outputs:
            out.finished, out.finish_reason, out.error_id = True, RequestStatus.FINISHED_ERROR.value, error_id
        self._start_self_check()
        return outputs

    def _start_self_check(self) -> None:
        """Queue a 1-token greedy request of the engine's own (no caller; outputs go nowhere) unless one runs."""
        if self._self_check_id is not None:
            return
        self._self_check_id = f"self-check-{self.num_request_faults}"
        self._enqueue(self._self_check_id, self.probe_prompt(), SamplingParams(temperature=0.0, max_tokens=1), 1,
                      0, self.clock())

    def _expire_waiting(self) -> list[RequestOutput]:
        """Refuse (finish_reason "rejected") requests that waited past `max_queue_wait_s` without starting."""
        cutoff = self._limits.wait_cutoff(self.clock())
        if cutoff is None:
            return []
        outputs: list[RequestOutput] = []
        for request in self.scheduler.expire_waiting(cutoff):
            parent_id = self._sequences[request.request_id].parent_id
            outputs += self.abort_request(parent_id, RequestStatus.FINISHED_REJECTED)
        return outputs

    def _on_token(self, seq: _Sequence, logprobs: dict, now: float) -> RequestOutput:
        request = seq.request
        token = request.token_ids[-1]
        if seq.first_token_time is None:
            seq.first_token_time = now
        text = seq.detokenizer.add(token)
        if seq.detokenizer.stopped_by is not None and not request.status.finished:
            request.stop_reason = seq.detokenizer.stopped_by
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        if request.status.finished and seq.detokenizer.stopped_by is None:
            text += seq.detokenizer.flush()
        entry = logprobs.get(request.request_id)
        lp = None if entry is None else [TokenLogprob(token, entry[0], tuple(entry[1] or ()))]
        out = self._output(seq, [token], text, lp, now)
        if request.status.finished:
            self._forget(seq)
        return out

    def _output(self, seq: _Sequence, tokens: list[int], text: str, logprobs: list[TokenLogprob] | None,
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

    def _forget(self, seq: _Sequence) -> None:
        self._sequences.pop(seq.request.request_id, None)
        siblings = self._children.get(seq.parent_id)
        if siblings is not None and all(s not in self._sequences for s in siblings):
            del self._children[seq.parent_id]

    def _release_staged(self) -> None:
        for parent_id in list(self._staged):
            leader = self._sequences.get(self._children[parent_id][0])
            if leader is None or leader.request.num_computed_tokens >= leader.request.num_prompt_tokens:
                for request in self._staged.pop(parent_id):
                    self.scheduler.add_request(request)


def _queue_policy(config: EngineConfig, clock: Callable[[], float]) -> QueuePolicy:
    if config.scheduling == "multilevel":
        options = config.multilevel_config()
        from policies.multilevel import MultiLevelPolicy

        return MultiLevelPolicy(options, clock=clock)  # type: ignore[return-value]  # structurally a QueuePolicy
    return FCFSPolicy()


def _default_kv_bytes(device: torch.device, fraction: float) -> int:
    if device.type == "cuda":
        return default_kv_bytes(device, fraction)
    return _CPU_DEFAULT_KV_BYTES
