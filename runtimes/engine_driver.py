"""What every async face of a synchronous engine shares: a command queue and the one thread that drives
the engine, either its own or the caller's (`run_forever()`).

On CPU the driving thread should be the process's main thread: PyTorch's OpenMP pool is only kept warm
there (a batch-1 SmolLM2 decode step measured 33 ms on the main thread, 58 ms on a secondary one). So a
worker runs `run_forever()` on its main thread and serves HTTP from another; tests and embedders may let
the driver start its own thread (`start_thread=True`).
"""

from __future__ import annotations

import queue
import threading
from typing import Generic, TypeVar

CommandT = TypeVar("CommandT")


class EngineDriver(Generic[CommandT]):
    def __init__(self, thread_name: str, start_thread: bool) -> None:
        """Subclasses set up their own state first: with `start_thread` the loop starts right here."""
        self._commands: queue.Queue[CommandT | None] = queue.Queue()  # None: shut down
        self.dead_error: BaseException | None = None
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

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise RuntimeError("the engine thread has died") from self.dead_error

    def _run(self) -> None:
        raise NotImplementedError
