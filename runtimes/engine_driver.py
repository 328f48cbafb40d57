"""What every async face of a synchronous engine shares: a command queue and the one thread that drives
the engine, either its own or the caller's (`run_forever()`).

On CPU the driving thread should be the process's main thread: PyTorch's OpenMP pool is only kept warm
there (a batch-1 SmolLM2 decode step measured 33 ms on the main thread, 58 ms on a secondary one). So a
worker runs `run_forever()` on its main thread and serves HTTP from another; tests and embedders may let
the driver start its own thread (`start_thread=True`).
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import structlog

from foundation.request_errors import EngineDeadError

CommandT = TypeVar("CommandT")
StepResultT = TypeVar("StepResultT")

log = structlog.get_logger(__name__)

# An idle loop waits for commands in slices this long. A worker's SIGTERM handler runs on the main thread, which
# is this loop's; when the kernel delivers the signal to another thread (HTTP, tqdm, OpenMP), a main thread
# blocked on a lock without a timeout never wakes to run the handler, and the worker ignores SIGTERM until a
# request happens to arrive. Seen in CI: 1 run in 6 under load.
IDLE_WAKE_S = 0.25


class StepGate(Protocol):
    """Taken around every engine step when replicas time-share a device (the partitioner's arbiter client).

    `acquire` blocks until this replica may use the device; `release(more)` ends the step, `more` saying that
    the engine will step again at once (so the gate keeps its place in line instead of re-queueing after a gap).
    """

    def acquire(self) -> None: ...

    def release(self, more: bool) -> None: ...


def _dead(exc: BaseException) -> EngineDeadError:
    return EngineDeadError(f"the engine loop has died: {exc!r}")


class EngineDriver(Generic[CommandT]):
    def __init__(self, thread_name: str, start_thread: bool, step_gate: StepGate | None = None) -> None:
        """Subclasses set up their own state first: with `start_thread` the loop starts right here.

        `step_gate`: taken around each step; None (a device of its own) costs nothing per step.
        """
        self._commands: queue.Queue[CommandT | None] = queue.Queue()  # None: shut down
        self._step_gate = step_gate
        self.dead_error: BaseException | None = None
        # When the loop last showed it is not stuck: a step returned, or it waited for commands. Read from other
        # threads (a float store is atomic under the GIL): a replica whose loop stops beating is not ready.
        self._beat_s = time.monotonic()
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
            self._thread.start()

    def run_forever(self) -> None:
        """Drive the engine on the calling thread (a worker's main thread) until `shutdown()`."""
        self._run()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine loop (whichever thread runs it); joins the driver's own thread if it has one."""
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def stalled_s(self) -> float:
        """Seconds since the engine loop last finished a step or waited for commands (0 for a loop that beats)."""
        return max(time.monotonic() - self._beat_s, 0.0)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise _dead(self.dead_error) from self.dead_error

    def _die(self, exc: BaseException) -> EngineDeadError:
        """Record that the loop ended on `exc` (callers from now on get EngineDeadError) and log it; returns the
        error each caller still waiting is to be given."""
        self.dead_error = exc
        log.exception("engine thread died")
        return _dead(exc)

    def _next_command(self, timeout_s: float | None) -> CommandT | None:
        """The next command; waits up to `timeout_s` (None: until one comes). Raises queue.Empty on timeout."""
        if timeout_s is not None and timeout_s <= 0:
            self._beat_s = time.monotonic()
            return self._commands.get_nowait()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._beat_s = time.monotonic()
            wait_s = IDLE_WAKE_S if deadline is None else min(IDLE_WAKE_S, deadline - time.monotonic())
            try:
                return self._commands.get(timeout=max(wait_s, 0.0))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            # back to the interpreter between slices: a pending signal handler runs here

    def _gated(self, step: Callable[[], StepResultT], more: Callable[[], bool]) -> StepResultT:
        """`step()` inside the gate; `more()` (asked after the step) tells the gate whether another follows."""
        gate = self._step_gate
        if gate is None:
            result = step()
            self._beat_s = time.monotonic()
            return result
        gate.acquire()
        stepped = False
        try:
            result = step()
            stepped = True
        finally:
            # After a failed step the loop dies: do not promise the gate another step.
            gate.release(more() if stepped else False)
        self._beat_s = time.monotonic()
        return result

    def _run(self) -> None:
        raise NotImplementedError


def return_freed_heap() -> None:
    """Hand memory the process freed back to the OS (glibc's `malloc_trim`): glibc keeps freed heap for reuse, in
    every thread's arena, so without this what a load or a burst of requests freed stays resident. A no-op off
    glibc."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)
