"""The engine driver's idle wait: a signal caught by another thread still gets its handler run on the main thread."""

from __future__ import annotations

import queue
import signal
import threading
import time

import pytest

from runtimes.engine_driver import IDLE_WAKE_S, EngineDriver


class Idle(EngineDriver[str]):
    def __init__(self) -> None:
        super().__init__("idle", start_thread=False)

    def put(self, command: str) -> None:
        self._commands.put(command)


def test_a_signal_delivered_to_another_thread_is_handled_while_the_loop_idles():
    """The worker's SIGTERM handler must run even when the kernel picks a thread other than the idle main one."""
    assert threading.current_thread() is threading.main_thread()  # handlers only ever run on the main thread
    driver = Idle()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: driver.put("from the handler"))
    fallback = threading.Timer(5.0, driver.put, args=("fallback",))  # without the fix the wait below never ends

    def signal_from_another_thread() -> None:
        time.sleep(2 * IDLE_WAKE_S)  # let the main thread block first; sent earlier, the handler runs at once
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)

    other = threading.Thread(target=signal_from_another_thread)
    try:
        fallback.start()
        other.start()  # the signal lands on `other` while the main thread waits below
        assert driver._next_command(None) == "from the handler"
    finally:
        fallback.cancel()
        other.join()
        signal.signal(signal.SIGUSR1, previous)


def test_a_bounded_wait_times_out_and_a_zero_wait_does_not_block():
    driver = Idle()
    with pytest.raises(queue.Empty):
        driver._next_command(IDLE_WAKE_S * 1.5)  # spans two slices, then gives up
    with pytest.raises(queue.Empty):
        driver._next_command(0.0)
    driver.put("x")
    assert driver._next_command(0.0) == "x"
