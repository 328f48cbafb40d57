"""Live reload: poll the registry file and hand each applied change to the pool.

Polling, not inotify: it works on every filesystem (bind mounts, NFS, Docker Desktop) and with editors that save by
writing a new file and renaming it over the old one, because the path is stat()ed afresh on every poll.

`run` does a poll's file work (stat, read, parse, validate) in a worker thread, so a large or slow edit never stalls
the event loop, and calls `on_change`/`on_reject` back on the loop.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

from registry.errors import RegistryError
from registry.registry_file import content_hash, read_head
from registry.store import RegistryDiff, RegistryStore

# Filesystem timestamps can be as coarse as 1-2 s: a file modified this recently may change again without its
# (mtime, size) changing, so it is re-read until it is older than this (git's "racily clean" rule).
RACY_WINDOW_S = 2.0

_Signature = tuple[int, int, int]  # (inode, size, mtime_ns)
_Outcome = RegistryDiff | RegistryError | None  # what one look at the file found: applied, rejected, nothing


class RegistryWatcher:
    """Polls `store.path` every `interval_s` and applies changes through `store.reload_from_file()`.

    A poll stats the file; it reads it only when (inode, size, mtime) moved or the mtime is racily recent, and asks
    the store to reload only when the content hash is one it has not handled yet: a `touch`, a rewrite with the same
    bytes or the store's own admin write cause no reload, and a rejected edit is reported once, not every poll.
    `on_change(diff)` gets every applied change, `on_reject(error)` every rejected edit; both are called
    synchronously on the event loop (`run`, `poll`) or the caller's thread (`poll_once`), never from the worker
    thread (hand async work to a task or queue). A missing file (mid-rename, deleted) keeps
    the last good registry and is looked at again next poll. `clock` must be comparable to file mtimes.
    """

    def __init__(
        self,
        store: RegistryStore,
        *,
        interval_s: float = 1.0,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[RegistryDiff], None] | None = None,
        on_reject: Callable[[RegistryError], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.store = store
        self.interval_s = interval_s
        self._sleep = sleep
        self._clock = clock
        self._on_change = on_change
        self._on_reject = on_reject
        self._signature: _Signature | None = None
        self._read_at = float("-inf")
        self._handled_hash = store.hash

    def poll_once(self) -> RegistryDiff | None:
        """Look at the file once, all on this thread; returns the applied diff, or None when nothing was applied."""
        return self._report(self._look())

    async def poll(self) -> RegistryDiff | None:
        """`poll_once` for the event loop: the file work runs in a worker thread, the callbacks here."""
        return self._report(await asyncio.to_thread(self._look))

    async def run(self) -> None:
        """Poll until cancelled. Meant for `asyncio.create_task(watcher.run())`. Cancelled mid-poll, the worker
        thread still finishes its reload; the store stays consistent, only that poll's callback is not made."""
        while True:
            await self.poll()
            await self._sleep(self.interval_s)

    def _look(self) -> _Outcome:
        """Stat the file, read it if it may have changed, and reload the store if its content is new to us."""
        now = self._clock()
        try:
            st = os.stat(self.store.path)
            signature = (st.st_ino, st.st_size, st.st_mtime_ns)
            if signature == self._signature and st.st_mtime_ns / 1e9 < self._read_at - RACY_WINDOW_S:
                return None
            self._signature, self._read_at = signature, now
            head = read_head(self.store.path)  # a file too large is the store's to report
            data, digest = head, content_hash(head)
        except FileNotFoundError:
            self._signature = None
            return None
        except OSError as exc:  # unreadable: let the store record and report it, once per distinct error
            data, digest = None, f"unreadable: {exc}"  # the store reads it again and says why
        if digest in (self._handled_hash, self.store.hash):  # seen, or the store's own admin write
            return None
        self._handled_hash = digest
        try:
            return self.store.reload_from_file(data)
        except RegistryError as exc:
            return exc

    def _report(self, outcome: _Outcome) -> RegistryDiff | None:
        if isinstance(outcome, RegistryError):
            if self._on_reject is not None:
                self._on_reject(outcome)
            return None
        if outcome is not None and self._on_change is not None:
            self._on_change(outcome)
        return outcome
