"""Async face of the engine: `generate()` yields incremental outputs while a background thread steps.

The engine core is synchronous and owned by one thread; the event loop talks to it only through a
command queue (add / abort) and receives outputs via `call_soon_threadsafe`, so a server on top
stays responsive while model steps run.

Which thread drives the engine matters on CPU: PyTorch's OpenMP pool is only kept warm for the
process's main thread, and small ops cost several times more from any other thread (measured: a
batch-1 SmolLM2 decode step takes 33 ms on the main thread, 58 ms on a secondary one). So a worker
process runs the engine loop on its main thread (`run_forever()`) and its HTTP server on another;
tests and embedders may let the engine start its own thread (`start_thread=True`).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import structlog

from runtimes.llm.engine import LLMEngine
from runtimes.llm.outputs import RequestOutput
from runtimes.llm.sampling_params import SamplingParams

log = structlog.get_logger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    sink: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, start_thread: bool = True) -> None:
        self.engine = engine
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self.dead_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
            self._thread.start()

    def run_forever(self) -> None:
        """Drive the engine on the calling thread (a worker's main thread) until `shutdown()`."""
        self._run()

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs (all `n` samples interleaved) until every one finishes.

        Invalid requests raise InvalidRequestError from the first iteration. Closing the iterator
        early (a client went away) aborts the request and frees its blocks.
        """
        if self.dead_error is not None:
            raise RuntimeError("the engine thread has died") from self.dead_error
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # Stamped now, not when the engine thread picks the command up, so TTFT includes that wait.
        self._commands.put(_Add(request_id, prompt, params, priority, self.engine.clock(), sink, loop))
        remaining = params.n
        try:
            while remaining:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            if remaining:
                self._commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine loop (whichever thread runs it); joins the engine's own thread if it has one."""
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain_commands(block):
                    return
                for out in self.engine.step():
                    self._deliver(out)
        except BaseException as exc:  # the thread must not die silently: fail every waiting stream
            self.dead_error = exc
            log.exception("engine thread died")
            for sink, loop in self._sinks.values():
                with contextlib.suppress(RuntimeError):  # that caller's loop is already closed
                    loop.call_soon_threadsafe(sink.put_nowait, exc)
            raise

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one if idle. False on shutdown."""
        while True:
            try:
                command = self._commands.get(block=block)
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
                                        arrival_time=command.arrival_time)
            except Exception as exc:  # invalid request: report to its caller only
                command.loop.call_soon_threadsafe(command.sink.put_nowait, exc)
                continue
            self._sinks[command.request_id] = (command.sink, command.loop)

    def _deliver(self, out: RequestOutput) -> None:
        target = self._sinks.get(out.request_id)
        if target is None:
            return
        sink, loop = target
        try:
            loop.call_soon_threadsafe(sink.put_nowait, out)
        except RuntimeError:  # the caller's event loop has closed: nobody is listening any more
            del self._sinks[out.request_id]
            self.engine.abort_request(out.request_id)
            return
        if out.finished and self.engine.is_finished(out.request_id):
            del self._sinks[out.request_id]
