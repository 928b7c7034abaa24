"""StorageWorker: I/O off the main thread, completions released in issue order only."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.storage.storage_helpers import make_keys, make_page
from tpcache.io.storage.base import StorageClosedError
from tpcache.io.storage.file import FileBackend
from tpcache.io.storage.memory import MemoryBackend
from tpcache.io.storage.worker import StorageCompletion, StorageWorker

PAGE = 1024


def _wait_for(worker: StorageWorker, n: int, timeout: float = 10.0) -> list[StorageCompletion]:
    got: list[StorageCompletion] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        got += worker.poll()
        assert time.monotonic() < deadline, f"only {len(got)} of {n} completions arrived"
        time.sleep(0.002)
    return got


def test_put_get_exists_round_trip(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, capacity_bytes=1 << 20)
    keys = make_keys(3)
    with StorageWorker(backend) as w:
        w.submit_put(1, keys[:2], [make_page(0, PAGE), make_page(1, PAGE)])
        out = [bytearray(PAGE) for _ in keys]
        w.submit_get(2, keys, out)
        w.submit_exists(3, keys)
        done = _wait_for(w, 3)
    assert [(c.op_id, c.kind, c.results, c.error) for c in done] == [
        (1, "put", [True, True], None),
        (2, "get", [True, True, False], None),
        (3, "exists", [True, True, False], None),
    ]
    assert bytes(out[1]) == make_page(1, PAGE)
    backend.close()


def test_completions_wait_behind_an_unfinished_head() -> None:
    gate = threading.Event()
    ran: list[int] = []

    def hold_first(op_id: int, kind: str) -> None:
        if op_id == 10:
            assert gate.wait(10)
        ran.append(op_id)

    backend = MemoryBackend()
    w = StorageWorker(backend, threads=2, delay=hold_first)
    keys = make_keys(2)
    w.submit_put(10, keys[:1], [make_page(0, PAGE)])
    w.submit_put(11, keys[1:], [make_page(1, PAGE)])
    deadline = time.monotonic() + 10
    while 11 not in ran:  # op 11 finishes while op 10 is held
        assert time.monotonic() < deadline
        time.sleep(0.002)
    time.sleep(0.01)
    assert w.poll() == []
    assert w.pending() == 2
    gate.set()
    done = _wait_for(w, 2)
    assert [c.op_id for c in done] == [10, 11]
    assert w.pending() == 0
    w.close()


def test_backend_exception_becomes_failed_completion() -> None:
    backend = MemoryBackend()
    backend.close()  # every call now raises StorageClosedError on the worker thread
    w = StorageWorker(backend)
    w.submit_exists(1, make_keys(3))
    (c,) = _wait_for(w, 1)
    assert c.results == [False, False, False]
    assert c.error is not None and "StorageClosedError" in c.error
    w.close()


def test_caller_bugs_raise_at_submit() -> None:
    w = StorageWorker(MemoryBackend())
    keys = make_keys(2)
    with pytest.raises(ValueError):
        w.submit_put(1, keys, [make_page(0, PAGE)])
    with pytest.raises(TypeError):
        w.submit_get(1, keys[:1], [b"read-only"])
    w.submit_exists(5, keys)
    with pytest.raises(ValueError, match="already"):
        w.submit_exists(5, keys)
    _wait_for(w, 1)
    w.submit_exists(5, keys)  # reusable once polled
    w.close()
    with pytest.raises(StorageClosedError):
        w.submit_exists(6, keys)


def test_close_drains_or_cancels() -> None:
    gate = threading.Event()

    started = threading.Event()

    def hold(op_id: int, kind: str) -> None:
        if op_id == 1:
            started.set()
            assert gate.wait(10)

    finished = []

    def on_finish() -> None:
        finished.append(1)
        if len(finished) == 2:  # ops 2 and 3 were cancelled while op 1 is still held
            gate.set()

    backend = MemoryBackend()
    w = StorageWorker(backend, delay=hold, notify=on_finish)
    keys = make_keys(3)
    for i in range(3):
        w.submit_put(i + 1, keys[i : i + 1], [make_page(i, PAGE)])
    assert started.wait(10)  # op 1 is running; 2 and 3 are queued
    w.close(cancel=True)
    done = w.poll()
    assert [c.op_id for c in done] == [1, 2, 3]
    assert done[0].results == [True] and done[0].error is None
    assert [c.error for c in done[1:]] == ["cancelled", "cancelled"]
    assert backend.exists(keys) == [True, False, False]

    w2 = StorageWorker(backend)
    w2.submit_put(1, keys[1:], [make_page(1, PAGE), make_page(2, PAGE)])
    w2.close()  # drain: the queued put finishes
    assert [c.results for c in w2.poll()] == [[True, True]]
    assert backend.exists(keys) == [True, True, True]
