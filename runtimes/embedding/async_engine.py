"""Async face of the embedding engine: `await embed(...)` while one thread runs the batches.

Same shape as runtimes/llm/async_engine.py: the engine core is synchronous and owned by one thread; the
event loop talks to it only through a command queue (add / abort) and gets each result back through
`call_soon_threadsafe`. The loop's wait is the batching window: idle, it blocks for a command; with inputs
waiting, it keeps taking commands until the batcher says a batch is due, then steps.

On CPU the driving thread should be the process's main thread (PyTorch's OpenMP pool is only warm there;
see the LLM async engine), so a worker calls `run_forever()` on its main thread; tests may let the engine
start its own thread (`start_thread=True`).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Sequence
from dataclasses import dataclass

from foundation.request_errors import InvalidRequestError, record_failure, request_failed
from runtimes.embedding.engine import EmbeddingEngine, EmbeddingOutput
from runtimes.engine_driver import EngineDriver, StepGate


@dataclass
class _Add:
    request_id: str
    token_ids: Sequence[Sequence[int]]
    arrival_time: float
    result: asyncio.Future[EmbeddingOutput]
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


def _settle(future: asyncio.Future[EmbeddingOutput], value: EmbeddingOutput | BaseException) -> None:
    """Runs on the caller's loop; a caller that gave up (cancelled future) is skipped."""
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


class AsyncEmbeddingEngine(EngineDriver[_Add | _Abort]):
    def __init__(self, engine: EmbeddingEngine, start_thread: bool = True, step_gate: StepGate | None = None
                 ) -> None:
        self.engine = engine
        self._waiting: dict[str, tuple[asyncio.Future[EmbeddingOutput], asyncio.AbstractEventLoop]] = {}
        super().__init__("embedding-engine", start_thread, step_gate)

    async def embed(self, request_id: str, token_ids: Sequence[Sequence[int]]) -> EmbeddingOutput:
        """Embed prepared inputs (InputProcessor.prepare); cancelling the call aborts the request.

        An invalid request raises InvalidRequestError; one the engine failed to encode, RequestFailedError.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        result: asyncio.Future[EmbeddingOutput] = loop.create_future()
        # Stamped now, not when the engine thread picks the command up: the window counts from arrival.
        self._commands.put(_Add(request_id, token_ids, self.engine.clock(), result, loop))
        try:
            return await result
        finally:
            if not result.done() or result.cancelled():
                self._commands.put(_Abort(request_id))


    # ------------------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while self._take_commands():
                for out in self._gated(self.engine.step, self._batch_due):
                    self._deliver(out.request_id, out if out.error_id is None else request_failed(out.error_id))
        except BaseException as exc:  # the thread must not die silently: fail every waiting caller
            dead = self._die(exc)
            for request_id in list(self._waiting):
                self._deliver(request_id, dead)
            raise

    def _take_commands(self) -> bool:
        """Apply commands until a batch is due: block while idle, wait out the window while inputs wait.

        False on shutdown.
        """
        while True:
            wait_s = self.engine.batch_wait_s()
            try:
                command = self._next_command(wait_s)  # wait_s <= 0: a batch is due: take what is queued, step
            except queue.Empty:
                return True
            if command is None:
                return False
            self._apply(command)

    def _batch_due(self) -> bool:
        """Another batch is due now: the loop will step again without waiting (the gate keeps our place)."""
        wait_s = self.engine.batch_wait_s()
        return wait_s is not None and wait_s <= 0

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            self._waiting.pop(command.request_id, None)
            return
        try:
            self.engine.add_request(command.request_id, command.token_ids, command.arrival_time)
        except Exception as exc:  # refused, or a bug this request ran into: report to its caller only
            if not isinstance(exc, InvalidRequestError):
                exc = request_failed(record_failure("request failed at submission", command.request_id, exc))
            with contextlib.suppress(RuntimeError):  # that caller's loop is already closed
                command.loop.call_soon_threadsafe(_settle, command.result, exc)
            return
        self._waiting[command.request_id] = (command.result, command.loop)

    def _deliver(self, request_id: str, value: EmbeddingOutput | BaseException) -> None:
        target = self._waiting.pop(request_id, None)
        if target is None:
            return
        future, loop = target
        with contextlib.suppress(RuntimeError):  # the caller's event loop has closed: nobody is listening
            loop.call_soon_threadsafe(_settle, future, value)
