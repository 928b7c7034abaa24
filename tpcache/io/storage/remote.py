"""Key-value stores that span machines (Mooncake Store, Redis/Valkey) behind ``StorageBackend``.

What is stored: one value per :class:`StorageKey`, under ``<prefix><key.encode()>`` (e.g.
``tpcache/v1/n_llama/1234/0of2/00ab...``): the checksummed record of ``record`` (header, key echo,
payload). Several tpcache groups with the same namespace and KV layout share what they store.

Invariants (beyond the base contract):
- ``get`` returns True only after the value named this exact key in its echo (so namespace,
  layout version, TP rank and size), this page size and record format, and the payload bytes in
  the caller's buffer match the header's checksum. Anything else (a missing or evicted key, a
  value of another layout or rank, a damaged value, an unreadable one) is a counted miss and the
  buffer is zero-filled where it was written;
- the store's answers are hints: ``exists`` may say yes for a key whose read then fails; only a
  verified read counts, and the round agrees a hit only after every rank's read verified;
- a store that does not answer fails calls fast: after a connection-level failure, calls fail
  for ``retry_s`` without waiting on the store (counted ``unavailable``), then one call tries it
  again, so a dead server costs one timeout rather than one per queued op. This is rank-local
  I/O timing, never cache state: what failed is agreed as failed in the round like any miss;
- every call on the store has a deadline (``deadline_s``): it runs on the instance's own store
  thread, and a call that has not answered by then is abandoned: the caller gets misses and put
  failures at once (counted ``deadline_exceeded``), and later calls fail fast, touching neither
  the store nor the transfer buffers, until the abandoned call has returned and ``retry_s`` has
  passed. So a stalled (stopped, not dead) store costs one deadline, not one per call. An abandoned
  call can never write into the caller's memory: what a primitive hands to ``sink`` is copied
  into the caller's buffer only while the call is still awaited (one lock decides), and a
  primitive that reads into the caller's memory itself is not used with a deadline (see
  ``mooncake_store``); the transfer buffers it may still use are not reused until it returns.
  A put abandoned at its deadline is reported failed; the store may still complete it later,
  leaving a valid record that a later read verifies like any other;
- calls on one instance are serialised: its transfer buffers are per instance.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tpcache.core.backend import RECORD as _native  # None: the shard layout takes the Python path
from tpcache.io.storage.base import (
    MISS_CORRUPT,
    MISS_FOREIGN,
    MISS_IO_ERROR,
    MISS_MISSING,
    MISS_UNAUTHENTICATED,
    PUT_IO_ERROR,
    StorageBackend,
    StorageClosedError,
    StorageCounters,
    check_keys,
    check_pairs,
    check_shard,
    encode_for_shard,
)
from tpcache.io.storage.buffers import byte_view
from tpcache.io.storage.keys import StorageKey
from tpcache.io.storage.record import (
    HEADER_SIZE,
    RecordError,
    check_value,
    copy_checksum,
    encode_header,
    payload_checksum,
)

DEFAULT_PREFIX = "tpcache/"
DEFAULT_RETRY_S = 1.0
DEFAULT_DEADLINE_S = 2.0  # every store call answers within this, or is abandoned (0: no deadline)


class Sink(Protocol):
    """``sink(i, value, reason)``: the store's answer for key i: its whole value (valid only during
    the call: it may live in a reused transfer buffer), or None and a miss reason.

    ``sink(i, head, None, placed=n)``: the store wrote the payload straight into the caller's buffer
    for key i and ``head`` holds the rest of the value (record header and key echo); ``n`` is the
    whole value's length as the store reported it. The caller must have made sure that nothing can
    write into that buffer any more (see ``mooncake_store``)."""

    def __call__(self, i: int, value: Any, reason: str | None, *, placed: int | None = None) -> None: ...


class StoreUnavailable(Exception):
    """The store did not answer (connection refused or reset, timeout): a whole call failed."""


class _Guard:
    """Whether the caller still waits for a call. ``awaited`` is cleared, under ``lock``, when it
    stops waiting: from then on nothing of the call reaches the caller's memory."""

    __slots__ = ("lock", "awaited")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.awaited = True


class _Call:
    """One primitive call on the store thread."""

    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class _StoreThread:
    """A daemon thread that runs one instance's store calls, one at a time (a stuck call never
    keeps the process from exiting)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call.result = call.fn(*call.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                call.error = exc
            finally:
                call.done.set()

    def submit(self, call: _Call) -> None:
        self._calls.put(call)

    def stop(self) -> None:
        self._calls.put(None)


class RemoteBackend(StorageBackend):
    """The shared half of a key-value store backend; subclasses implement five primitives."""

    scheme = ""

    def __init__(
        self,
        *,
        shard: tuple[int, ...] | None,
        prefix: str,
        retry_s: float,
        where: str,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        shard = check_shard(shard)  # validated with the keys' rules
        if not isinstance(prefix, str) or any(c.isspace() for c in prefix):
            raise ValueError(f"key prefix must be a string without whitespace, got {prefix!r}")
        if retry_s < 0:
            raise ValueError(f"retry_s must be >= 0, got {retry_s}")
        if deadline_s < 0:
            raise ValueError(f"deadline must be >= 0 (0: none), got {deadline_s}")
        self._shard = shard
        self._prefix = prefix
        self._retry_s = retry_s
        self._retry_at = 0.0
        self._deadline_s = deadline_s
        self._store_thread: _StoreThread | None = None
        self._stuck: _Call | None = None  # a call abandoned at its deadline that has not returned
        self.where = where  # for logs: where the store is, never a password
        self._lock = threading.Lock()
        self._closed = False
        self._counters = StorageCounters(0)
        for extra in ("unavailable", "bytes_written", "bytes_read", "deadline_exceeded"):
            self._counters.set(extra, 0)

    # ---- the deadline
    def _call(self, fn: Any, *args: Any, guard: _Guard | None = None) -> Any:
        """``fn(*args)`` (a primitive) within the deadline; StoreUnavailable when it is passed or
        while an abandoned call has not returned (see the module docstring). ``guard``: cleared
        when the call is abandoned. Lock held."""
        if not self._deadline_s:
            return fn(*args)
        if self._stuck is not None:
            if not self._stuck.done.is_set():
                raise StoreUnavailable("a store call abandoned at its deadline has not returned yet")
            self._stuck = None
        if self._store_thread is None:
            self._store_thread = _StoreThread(f"tpcache-{self.scheme}-store")
        call = _Call(fn, args)
        self._store_thread.submit(call)
        if not call.done.wait(self._deadline_s):
            if guard is not None:
                with guard.lock:  # waits for a copy into the caller's buffer in progress, if any
                    guard.awaited = False
            if not call.done.is_set():
                self._stuck = call
                self._counters.add("deadline_exceeded")
                raise StoreUnavailable(f"no answer within the {self._deadline_s:g} s deadline")
        if call.error is not None:
            raise call.error
        return call.result

    # ---- primitives (called with the lock held; raise StoreUnavailable when the store is gone)
    @abstractmethod
    def _exists(self, names: list[str]) -> list[bool]: ...

    @abstractmethod
    def _put(self, names: list[str], heads: list[bytes], payloads: list[memoryview]) -> list[str | None]:
        """Store ``heads[i] + payloads[i]`` under ``names[i]``, replacing any value; None or a
        put-failure reason per key."""

    @abstractmethod
    def _get(self, names: list[str], sizes: list[int], sink: Sink, out: list[memoryview]) -> None:
        """Fetch each value (``sizes[i]`` is the record length expected) and hand it to ``sink``;
        ``out[i]`` is the caller's buffer for key i's payload, for stores that read into it."""

    @abstractmethod
    def _delete(self, names: list[str]) -> list[bool]: ...

    # Whether ``_get_records`` hands ``take`` values that nothing else can write (bytes objects)
    # rather than views of a transfer buffer.
    _stable_values = False

    # Whole records (the shard layout's native path, ``put_shards``/``get_shards``): a store that
    # implements these two serves it; each is called with the lock held, like the primitives above.
    def _records(self, echoes: list[bytes], pages: list[Any], places: bytes, geometry: tuple, sizes: list[int]) -> Any:
        """The batch's records for ``_put_records``, gathered from the caller's pages (on the
        caller's thread, lock held): by default one bytes object each."""
        return _native.encode_records(echoes, pages, places, geometry)

    def _idle(self) -> bool:
        """Whether no call abandoned at its deadline is still running (the transfer buffers are free)."""
        return self._stuck is None or self._stuck.done.is_set()

    def _put_records(self, names: list[str], records: Any) -> list[str | None]:
        """Store each whole record of ``records`` (``_records``') under ``names[i]``, replacing any
        value; None or a put-failure reason per key."""
        raise NotImplementedError

    def _get_records(self, names: list[str], sizes: list[int], take: Any) -> None:
        """Fetch each value and hand runs of them to ``take(start, values, reasons)``: ``values[j]``
        is key ``start + j``'s whole value (valid only during the call) or None with ``reasons[j]``
        (``reasons`` may be None when every value is given)."""
        raise NotImplementedError

    @abstractmethod
    def _close(self) -> None: ...

    # ---- StorageBackend -----------------------------------------------------------------------
    def describe(self) -> str:
        return f"{self.scheme} store at {self.where}"

    def _echoes(self, keys: Sequence[StorageKey]) -> list[bytes]:
        return encode_for_shard(keys, self._shard)

    def _names(self, echoes: list[bytes]) -> list[str]:
        return [self._prefix + e.decode("ascii") for e in echoes]

    def _shard_names(self, echoes: list[bytes]) -> list[Any]:
        """The store names of shard keys for ``_put_records``/``_get_records``: ``_names``' by default."""
        return self._names(echoes)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageClosedError(f"{self.describe()} is closed")

    def _reachable(self) -> bool:
        if time.monotonic() >= self._retry_at:
            return True
        self._counters.add("unavailable")
        return False

    def _unreachable(self) -> None:
        self._retry_at = time.monotonic() + self._retry_s
        self._counters.add("unavailable")

    def exists(self, keys: Sequence[StorageKey]) -> list[bool]:
        names = self._names(self._echoes(check_keys(keys)))
        with self._lock:
            self._check_open()
            self._counters.add("exists_calls")
            if not names or not self._reachable():
                return [False] * len(names)
            try:
                return [bool(x) for x in self._call(self._exists, names)]
            except StoreUnavailable:
                self._unreachable()
                return [False] * len(names)

    def put(self, keys: Sequence[StorageKey], pages: Sequence[Any]) -> list[bool]:
        echoes = self._echoes(check_pairs(keys, pages, "pages"))
        views = [byte_view(p) for p in pages]
        mac = self.record_mac
        heads = [
            encode_header(e, 0, len(v), payload_checksum(v), mac=mac.sign(e, v) if mac is not None else b"")
            for e, v in zip(echoes, views, strict=True)
        ]
        return self._put_batch(
            [len(v) for v in views], lambda: self._call(self._put, self._names(echoes), heads, views)
        )

    def _put_batch(self, sizes: list[int], store: Callable[[], list[str | None]]) -> list[bool]:
        """A put of ``len(sizes)`` records of these payload sizes: ``store()`` (called with the lock
        held, unless the store is closed or marked unreachable) gives a put-failure reason or None
        per record. Counted; True where stored."""
        with self._lock:
            self._check_open()
            self._counters.add("puts", len(sizes))
            reasons: list[str | None] = [PUT_IO_ERROR] * len(sizes)
            if sizes and self._reachable():
                try:
                    reasons = store()
                except StoreUnavailable:
                    self._unreachable()
            self._count_puts(reasons, sizes)
        return [r is None for r in reasons]

    def _count_puts(self, reasons: list[str | None], sizes: list[int]) -> None:
        written = [n for r, n in zip(reasons, sizes, strict=True) if r is None]
        self._counters.add("put_ok", len(written))
        self._counters.add("bytes_written", sum(written))
        for reason in reasons:
            if reason is not None:
                self._counters.put_failure(reason)

    def get(self, keys: Sequence[StorageKey], out: Sequence[Any]) -> list[bool]:
        echoes = self._echoes(check_pairs(keys, out, "output buffers"))
        views = [byte_view(b, writable=True) for b in out]
        results: list[bool | None] = [None] * len(views)

        guard = _Guard()

        record_mac = self.record_mac

        def sink(i: int, value: Any, reason: str | None, *, placed: int | None = None) -> None:
            with guard.lock:
                if guard.awaited:  # else abandoned at its deadline: the caller's buffers are not ours
                    answer(i, value, reason, placed)

        def answer(i: int, value: Any, reason: str | None, placed: int | None) -> None:
            if results[i] is not None:
                return  # one answer per key
            view, echo = views[i], echoes[i]
            if reason is None:
                try:
                    want, mac = check_value(value, echo, len(view), value_len=placed)
                    # Verified in the caller's buffer: after the copy out of a transfer buffer that
                    # a late write could still change, or where the store placed it.
                    if placed is not None:
                        xxh = payload_checksum(view)
                    else:
                        xxh = copy_checksum(view, memoryview(value)[HEADER_SIZE + len(echo) :])
                    if xxh != want:
                        reason = MISS_CORRUPT
                    elif record_mac is not None and not record_mac.verify_mac(mac, echo, view):
                        reason = MISS_UNAUTHENTICATED
                    else:
                        results[i] = True
                        return
                except RecordError as exc:
                    reason = exc.reason
                view[:] = bytes(len(view))  # never leave unverified bytes in the caller's buffer
            results[i] = False
            self._counters.miss(reason)

        with self._lock:
            self._check_open()
            self._counters.add("gets", len(views))
            if views and self._reachable():
                sizes = [HEADER_SIZE + len(e) + len(v) for e, v in zip(echoes, views, strict=True)]
                try:
                    self._call(self._get, self._names(echoes), sizes, sink, views, guard=guard)
                except StoreUnavailable:
                    self._unreachable()
            for i, r in enumerate(results):
                if r is None:
                    answer(i, None, MISS_IO_ERROR, None)
            hits = [i for i, r in enumerate(results) if r]
            self._counters.add("hits", len(hits))
            self._counters.add("bytes_read", sum(len(views[i]) for i in hits))
        return [bool(r) for r in results]

    # ---- the shard layout's native path ------------------------------------------------------
    @property
    def shard_records(self) -> bool:
        """Whether ``put_shards``/``get_shards`` serve this instance: the native record code is built,
        the store implements whole records, and no storage key is set (a MAC is checked in Python)."""
        return (
            _native is not None
            and self.record_mac is None
            and type(self)._put_records is not RemoteBackend._put_records
            and type(self)._get_records is not RemoteBackend._get_records
        )

    def put_shards(self, echoes: list[bytes], pages: list[memoryview], places: bytes, geometry: tuple) -> list[bool]:
        """Store shard i of the batch, gathered from ``pages`` (``_record.encode_records``: ``places``
        and ``geometry`` say where its rows are), as the record of the key echo ``echoes[i]`` (a
        model shard key's encoding, checked by its maker). Counted as ``put`` counts."""
        names = self._shard_names(echoes)
        payload = _payload_len(geometry)
        sizes = [HEADER_SIZE + len(e) + payload for e in echoes]

        def store() -> list[str | None]:
            # Gathered and checksummed on this thread, while the caller still owns its pages: a call
            # abandoned at its deadline stores these bytes or nothing, never what a reused page
            # holds later.
            records = self._records(echoes, pages, places, geometry, sizes)
            return self._call(self._put_records, names, records)

        return self._put_batch([payload] * len(names), store)

    def get_shards(self, echoes: list[bytes], pages: list[memoryview], places: bytes, geometry: tuple) -> bytearray:
        """Read shard i of the batch, the record of the key echo ``echoes[i]``, checked and copied into
        ``pages`` where ``places`` and ``geometry`` say (``_record.scatter_check``). Returns one byte
        per shard: 1 when verified there. A shard not verified is a counted miss, as ``get``'s; its
        rows hold zeros or what was there before (the caller clears the page of a shard it lacks)."""
        n = len(echoes)
        names = self._shard_names(echoes)
        payload = _payload_len(geometry)
        sizes = [HEADER_SIZE + len(e) + payload for e in echoes]
        done = bytearray(n)  # 1: verified, 2: a miss counted
        guard = _Guard()
        stable = self._stable_values  # bytes objects: checked where they are, not copied first

        def take(start: int, values: list[Any], reasons: list[str | None] | None) -> None:
            with guard.lock:
                if not guard.awaited:  # abandoned at its deadline: the caller's pages are not ours
                    return
                stop = start + len(values)
                where = places[16 * start : 16 * stop]
                codes = _native.scatter_check(values, echoes[start:stop], pages, where, geometry, stable)
                if codes.count(0) == len(codes):  # the common case: every record verified
                    done[start:stop] = b"\x01" * len(codes)
                    return
                for j, code in enumerate(codes):
                    if code == 0:
                        done[start + j] = 1
                    else:
                        done[start + j] = 2
                        value = values[j]
                        if code == 1:
                            reason = MISS_CORRUPT
                        elif value is None:
                            reason = reasons[j] if reasons is not None and reasons[j] else MISS_MISSING
                        elif not isinstance(value, (bytes, bytearray, memoryview)):
                            reason = MISS_FOREIGN
                        else:
                            try:  # the Python check names why the native one refused it
                                check_value(value, echoes[start + j], payload)
                                reason = MISS_CORRUPT
                            except RecordError as exc:
                                reason = exc.reason
                        self._counters.miss(reason)

        with self._lock:
            self._check_open()
            self._counters.add("gets", n)
            if n and self._reachable():
                try:
                    self._call(self._get_records, names, sizes, take, guard=guard)
                except StoreUnavailable:
                    self._unreachable()
            with guard.lock:
                guard.awaited = False  # a late answer of an abandoned call is dropped from here on
            hits = done.count(1)
            for _ in range(n - hits - done.count(2)):
                self._counters.miss(MISS_IO_ERROR)
            self._counters.add("hits", hits)
            self._counters.add("bytes_read", hits * payload)
        return done.replace(b"\x02", b"\x00")

    def delete(self, keys: Sequence[StorageKey]) -> list[bool]:
        names = self._names(self._echoes(check_keys(keys)))
        with self._lock:
            self._check_open()
            if not names or not self._reachable():
                return [False] * len(names)
            try:
                removed = [bool(x) for x in self._call(self._delete, names)]
            except StoreUnavailable:
                self._unreachable()
                return [False] * len(names)
            self._counters.add("deletes", sum(removed))
            return removed

    def stats(self) -> dict[str, int]:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stuck = self._stuck
            if stuck is not None and not stuck.done.wait(self._deadline_s):
                # Still inside the store: closing the client (or freeing its buffers) under it is
                # not safe. Both are left to the process's exit.
                return
            if self._store_thread is not None:
                self._store_thread.stop()
            self._close()


def _payload_len(geometry: tuple) -> int:
    """Bytes of one shard's payload: ``width * n0 * n1 * n2 * n3`` of a ``_record`` geometry."""
    width, *rest = geometry
    return width * rest[0] * rest[2] * rest[4] * rest[6]
