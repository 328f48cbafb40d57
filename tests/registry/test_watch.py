"""RegistryWatcher: picks up real edits (in place or by rename), ignores non-edits, reports a bad edit once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from registry import store as store_module
from registry import watch
from registry.errors import RegistryError
from registry.store import RegistryDiff
from registry.watch import RegistryWatcher
from tests.registry.conftest import SAMPLE


class Recorder:
    def __init__(self) -> None:
        self.diffs: list[RegistryDiff] = []
        self.errors: list[RegistryError] = []


@pytest.fixture
def watched(make_store):
    store = make_store()
    seen = Recorder()
    watcher = RegistryWatcher(store, on_change=seen.diffs.append, on_reject=seen.errors.append)
    assert watcher.poll_once() is None  # the file it started from is not a change
    return store, watcher, seen


def write_via_rename(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".swp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_picks_up_an_edit_in_place(watched):
    store, watcher, seen = watched
    store.path.write_text(SAMPLE.replace("replicas: 2", "replicas: 3"))
    diff = watcher.poll_once()
    assert diff == RegistryDiff(resized=(("chat-b", 2, 3),)) and seen.diffs == [diff]
    assert store.version == 2 and watcher.poll_once() is None and len(seen.diffs) == 1


def test_picks_up_an_edit_written_via_rename(watched):
    store, watcher, seen = watched
    write_via_rename(store.path, SAMPLE.replace("replicas: 0", "replicas: 1"))
    assert watcher.poll_once() == RegistryDiff(resized=(("embed", 0, 1),))
    write_via_rename(store.path, SAMPLE.replace("replicas: 0", "replicas: 2"))
    assert watcher.poll_once() == RegistryDiff(resized=(("embed", 1, 2),))
    assert len(seen.diffs) == 2 and not seen.errors


def test_catches_a_same_size_same_mtime_edit(watched):
    store, watcher, _ = watched
    before = os.stat(store.path)
    store.path.write_text(SAMPLE.replace("replicas: 2", "replicas: 7"))
    os.utime(store.path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(store.path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert watcher.poll_once() == RegistryDiff(resized=(("chat-b", 2, 7),))


def test_touch_without_change_does_not_reload(watched, monkeypatch):
    store, watcher, seen = watched
    reloads = []
    monkeypatch.setattr(store, "reload_from_file", lambda data=None: reloads.append(1))
    os.utime(store.path, ns=(0, os.stat(store.path).st_mtime_ns + 5_000_000_000))
    write_via_rename(store.path, SAMPLE)  # same bytes, new inode
    assert watcher.poll_once() is None and watcher.poll_once() is None
    assert reloads == [] and seen.diffs == [] and store.version == 1


def test_an_old_unchanged_file_is_not_reread(watched, monkeypatch):
    store, watcher, _ = watched
    old_ns = os.stat(store.path).st_mtime_ns - 60_000_000_000
    os.utime(store.path, ns=(old_ns, old_ns))
    watcher.poll_once()  # the stat moved: read once
    reads = []
    real_read = watch.read_head
    monkeypatch.setattr(watch, "read_head", lambda path: reads.append(path) or real_read(path))
    assert watcher.poll_once() is None and reads == []
    os.utime(store.path, ns=(old_ns, old_ns + 1))
    watcher.poll_once()  # the stat moved: read (so this test would see a read)
    assert reads == [store.path]


def test_reports_a_rejected_edit_once_and_keeps_the_last_good_registry(watched):
    store, watcher, seen = watched
    good = store.registry
    store.path.write_text(SAMPLE.replace("replicas: 2", "replica: 2"))
    assert watcher.poll_once() is None and watcher.poll_once() is None
    assert len(seen.errors) == 1 and "models[1].replica: unknown field" in str(seen.errors[0])
    assert store.registry is good and store.last_rejected is not None and store.last_rejected.source == "file"
    store.path.write_text(SAMPLE.replace("replicas: 2", "replicas: 1"))
    assert watcher.poll_once() == RegistryDiff(resized=(("chat-b", 2, 1),)) and len(seen.errors) == 1


def test_a_missing_file_keeps_the_registry_until_it_returns(watched):
    store, watcher, seen = watched
    store.path.unlink()
    assert watcher.poll_once() is None and not seen.errors and store.registry.models
    store.path.write_text(SAMPLE.replace("replicas: 2", "replicas: 3"))
    assert watcher.poll_once() == RegistryDiff(resized=(("chat-b", 2, 3),))


def test_admin_writes_are_not_reported_as_file_changes(watched):
    store, watcher, seen = watched
    store.scale("chat-b", 5)
    assert watcher.poll_once() is None and seen.diffs == [] and store.version == 2


def test_run_polls_until_cancelled(make_store):
    store = make_store()
    seen = Recorder()
    sleeps: list[float] = []

    class Stop(Exception):
        pass

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 1:
            store.path.write_text(SAMPLE.replace("replicas: 2", "replicas: 4"))
        else:
            raise Stop

    watcher = RegistryWatcher(store, interval_s=0.25, sleep=sleep, on_change=seen.diffs.append)
    with pytest.raises(Stop):
        asyncio.run(watcher.run())
    assert sleeps == [0.25, 0.25] and seen.diffs == [RegistryDiff(resized=(("chat-b", 2, 4),))]


def test_interval_must_be_positive(make_store):
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        RegistryWatcher(make_store(), interval_s=0)



def test_run_reads_and_parses_off_the_event_loop_and_reports_on_it(make_store, monkeypatch):
    store = make_store()
    real_parse = store_module.parse_registry

    def slow_parse(text: str, path: object) -> object:  # a large edit: ruamel takes ~1 s per 100 KiB
        time.sleep(0.4)
        return real_parse(text, path)

    monkeypatch.setattr(store_module, "parse_registry", slow_parse)
    seen: list[tuple[RegistryDiff, int]] = []

    async def main() -> float:
        polled = asyncio.Event()

        async def park(seconds: float) -> None:  # one poll is enough
            polled.set()
            await asyncio.Event().wait()

        watcher = RegistryWatcher(store, sleep=park, on_change=lambda d: seen.append((d, threading.get_ident())))
        store.path.write_text(SAMPLE.replace("replicas: 2", "replicas: 3"))
        task = asyncio.create_task(watcher.run())
        longest, last = 0.0, time.monotonic()
        while not polled.is_set():  # a request being served meanwhile: how long does it wait for the loop?
            await asyncio.sleep(0.01)
            now = time.monotonic()
            longest, last = max(longest, now - last), now
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return longest

    longest_stall_s = asyncio.run(main())
    assert longest_stall_s < 0.2, f"the event loop stalled {longest_stall_s:.2f} s during a poll"
    assert seen == [(RegistryDiff(resized=(("chat-b", 2, 3),)), threading.get_ident())]  # on the loop's thread
