"""Async face of the engine: `generate()` yields incremental outputs while a background thread steps.

The engine core is synchronous and owned by one thread; the event loop talks to it only through a
command queue (add / abort) and receives outputs via `call_soon_threadsafe`, so a server on top
stays responsive while model steps run.

Which thread drives it (its own, or a worker's main thread through `run_forever()`) is the
EngineDriver's business: see runtimes/engine_driver.py for why that matters on CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from foundation.request_errors import InvalidRequestError, OverloadedError, record_failure, request_failed
from runtimes.engine_driver import EngineDriver, StepGate, return_freed_heap
from runtimes.llm.engine import LLMEngine
from runtimes.llm.grammar import CompiledGrammar
from runtimes.llm.outputs import RequestOutput
from runtimes.llm.sampling_params import SamplingParams


@dataclass
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    sink: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    resume_token_ids: Sequence[int] = ()
    grammar: CompiledGrammar | None = None


@dataclass
class _Sink:
    """Where a request's outputs go, and how many of its samples have not finished yet: several can finish in one
    step, whose outputs are delivered after the engine has already forgotten the request."""

    queue: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    num_unfinished: int


@dataclass
class _Abort:
    request_id: str


class AsyncLLMEngine(EngineDriver[_Add | _Abort]):
    def __init__(self, engine: LLMEngine, start_thread: bool = True, step_gate: StepGate | None = None) -> None:
        self.engine = engine
        if step_gate is not None:  # a step's device work must end within its lease: none may run ahead of it
            engine.overlap_steps = False
        self._sinks: dict[str, _Sink] = {}
        super().__init__("llm-engine", start_thread, step_gate)

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        resume_token_ids: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs (all `n` samples interleaved) until every one finishes.

        Invalid requests raise InvalidRequestError from the first iteration, and refused ones (queue full, or
        waited past `max_queue_wait_s` without starting) OverloadedError. A request the engine failed to serve
        (a fault it alone caused) raises RequestFailedError, at any point. Closing the iterator early (a client
        went away) aborts the request and frees its blocks. `resume_token_ids`: see `LLMEngine.add_request`.
        """
        self._check_alive()
        grammar = None
        if params.structured is not None:  # compiled here, in a worker thread: the engine's steps go on meanwhile
            grammar = await asyncio.to_thread(self.engine.inputs.compile_grammar, params.structured)
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # Stamped now, not when the engine thread picks the command up, so TTFT includes that wait.
        self._commands.put(_Add(request_id, prompt, params, priority, self.engine.clock(), sink, loop,
                                resume_token_ids, grammar))
        # After the put: a yield that finds the queue already drained costs a part-step, one before it a full wait.
        self.engine.request_yield(priority)
        remaining = params.n
        try:
            while remaining:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason == "rejected":  # every sample was let go along with this one
                    remaining = 0
                    raise self.engine.rejection_error(item)
                if item.error_id is not None:  # likewise: the engine stopped every sample
                    remaining = 0
                    raise request_failed(item.error_id)
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            if remaining:
                self._commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))


    # ------------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            busy = False
            while True:
                block = not self.engine.has_unfinished_requests()
                if block and busy:  # just gone idle: what the requests' steps freed goes back to the OS
                    return_freed_heap()
                busy = not block
                if not self._drain_commands(block):
                    return
                # `more`: with requests left, the next pass drains commands without blocking and steps again.
                for out in self._gated(self.engine.step, self.engine.has_unfinished_requests):
                    self._deliver(out)
        except BaseException as exc:  # the thread must not die silently: fail every waiting stream
            dead = self._die(exc)
            for sink in self._sinks.values():
                with contextlib.suppress(RuntimeError):  # that caller's loop is already closed
                    sink.loop.call_soon_threadsafe(sink.queue.put_nowait, dead)
            raise

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one if idle. False on shutdown."""
        while True:
            self.engine.clear_yield()  # whatever asked for a yield is in the queue: taken in now
            try:
                command = self._next_command(None if block else 0.0)
            except queue.Empty:
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, _Abort):
                for out in self.engine.abort_request(command.request_id):
                    self._deliver(out)
                self._sinks.pop(command.request_id, None)
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params, command.priority,
                                        arrival_time=command.arrival_time, resume_token_ids=command.resume_token_ids,
                                        grammar=command.grammar)
            except (InvalidRequestError, OverloadedError) as exc:  # refused: report to its caller only
                command.loop.call_soon_threadsafe(command.sink.put_nowait, exc)
                continue
            except Exception as exc:  # a bug this request ran into: its caller gets a 500 with an id, nobody else
                error_id = record_failure("request failed at submission", command.request_id, exc)
                command.loop.call_soon_threadsafe(command.sink.put_nowait, request_failed(error_id))
                continue
            self._sinks[command.request_id] = _Sink(command.sink, command.loop, command.params.n)

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, out)
        except RuntimeError:  # the caller's event loop has closed: nobody is listening any more
            del self._sinks[out.request_id]
            self.engine.abort_request(out.request_id)
            return
        if out.finished:
            sink.num_unfinished -= 1
            if sink.num_unfinished <= 0:
                del self._sinks[out.request_id]
