"""Asynchronous storage executor: backend I/O runs on worker threads, never the main thread.

Invariants:
- ``poll()`` returns completions in issue order, and only the finished ops at the head: an op
  that finished early waits behind an unfinished earlier one. This is the "finished operations
  at the head" count the round agrees on, so every rank sees the same prefix semantics.
- every submitted op yields exactly one completion, with one result per key: a backend
  exception or a cancellation yields all-False results and ``error`` set, never a lost op;
- op ids must be unique among ops not yet polled.
- buffers handed to ``submit_put``/``submit_get`` must stay alive and untouched until their
  completion is polled.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tpcache.io.storage.base import StorageBackend, StorageClosedError, check_keys, check_pairs
from tpcache.io.storage.buffers import byte_view
from tpcache.io.storage.keys import StorageKey

OpKind = Literal["put", "get", "exists"]


@dataclass(frozen=True)
class StorageCompletion:
    """One finished op. ``error`` is None when the backend ran it; otherwise why not."""

    op_id: int
    kind: OpKind
    results: list[bool]
    error: str | None = None


@dataclass(frozen=True)
class _Op:
    op_id: int
    kind: OpKind
    keys: list[StorageKey]
    bufs: Sequence[Any] | None


_STOP = None


class StorageWorker:
    """Runs backend calls on ``threads`` daemon threads; the caller polls completions.

    Args:
        backend: the storage backend; not owned (``close`` does not close it).
        threads: worker threads; with more than one, ops may finish out of order, and
            ``poll`` still releases them in issue order.
        delay: test hook called on the worker thread before each op runs, ``delay(op_id, kind)``;
            it may sleep or block on an event to hold that op back.
        notify: called on the worker thread after each op finishes (e.g. to wake an event loop).
    """

    def __init__(
        self,
        backend: StorageBackend,
        threads: int = 1,
        *,
        delay: Callable[[int, str], None] | None = None,
        notify: Callable[[], None] | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._backend = backend
        self._delay = delay
        self._notify = notify
        self._queue: queue.Queue[_Op | None] = queue.Queue()
        self._lock = threading.Lock()
        self._order: deque[int] = deque()  # issued, not yet polled
        self._outstanding: set[int] = set()
        self._done: dict[int, StorageCompletion] = {}
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"tpcache-storage-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    # ---- submission (main thread) ------------------------------------------------------------
    def submit_put(self, op_id: int, keys: Sequence[StorageKey], pages: Sequence[Any]) -> None:
        ks = check_pairs(keys, pages, "pages")
        for p in pages:
            byte_view(p)  # type errors surface here, not as a failed completion later
        self._submit(_Op(op_id, "put", ks, list(pages)))

    def submit_get(self, op_id: int, keys: Sequence[StorageKey], out_buffers: Sequence[Any]) -> None:
        ks = check_pairs(keys, out_buffers, "output buffers")
        for b in out_buffers:
            byte_view(b, writable=True)
        self._submit(_Op(op_id, "get", ks, list(out_buffers)))

    def submit_exists(self, op_id: int, keys: Sequence[StorageKey]) -> None:
        self._submit(_Op(op_id, "exists", check_keys(keys), None))

    def _submit(self, op: _Op) -> None:
        if not isinstance(op.op_id, int) or isinstance(op.op_id, bool):
            raise TypeError(f"op_id must be an int, got {type(op.op_id).__name__}")
        with self._lock:
            if self._closed:
                raise StorageClosedError("storage worker is closed")
            if op.op_id in self._outstanding:
                raise ValueError(f"op_id {op.op_id} is already in flight or not yet polled")
            self._outstanding.add(op.op_id)
            self._order.append(op.op_id)
        self._queue.put(op)

    # ---- completion (main thread) ------------------------------------------------------------
    def unusable(self) -> str | None:
        """The backend's ``unusable``: why it can no longer store anything, or None."""
        return self._backend.unusable()

    def poll(self) -> list[StorageCompletion]:
        """Finished ops at the head of issue order, removed from the worker."""
        out: list[StorageCompletion] = []
        with self._lock:
            while self._order and self._order[0] in self._done:
                op_id = self._order.popleft()
                self._outstanding.discard(op_id)
                out.append(self._done.pop(op_id))
        return out

    def pending(self) -> int:
        """Ops issued and not yet polled (running, queued or finished behind an unfinished one)."""
        with self._lock:
            return len(self._order)

    # ---- worker threads ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is _STOP:
                return
            self._finish(self._execute(op))

    def _execute(self, op: _Op) -> StorageCompletion:
        try:
            if self._delay is not None:
                self._delay(op.op_id, op.kind)
            if op.kind == "put":
                results = self._backend.put(op.keys, op.bufs or [])
            elif op.kind == "get":
                results = self._backend.get(op.keys, op.bufs or [])
            else:
                results = self._backend.exists(op.keys)
            if len(results) != len(op.keys):
                raise RuntimeError(f"backend returned {len(results)} results for {len(op.keys)} keys")
            return StorageCompletion(op.op_id, op.kind, [bool(r) for r in results])
        except Exception as exc:  # a worker thread must never die: the op fails instead
            return StorageCompletion(op.op_id, op.kind, [False] * len(op.keys), f"{type(exc).__name__}: {exc}")

    def _finish(self, completion: StorageCompletion) -> None:
        with self._lock:
            self._done[completion.op_id] = completion
        if self._notify is not None:
            with contextlib.suppress(Exception):  # a failing wake-up must not kill the worker
                self._notify()

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting ops; finish queued ones (or, with ``cancel``, fail the ones not yet
        started with error ``cancelled``) and join the threads. Completions stay pollable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if cancel:
            while True:
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:
                    break
                if op is not _STOP:
                    self._finish(StorageCompletion(op.op_id, op.kind, [False] * len(op.keys), "cancelled"))
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join(timeout)

    def __enter__(self) -> StorageWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
