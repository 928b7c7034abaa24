"""In-memory storage backend for tests and simulation, with fault injection.

Same contract as every backend (see ``base``): per-key results, verified reads (each page keeps
its xxh3 checksum so an injected corruption is a counted ``corrupt`` miss), LRU eviction in
access order when ``capacity_bytes`` is set. Faults are armed per key and stay armed until
cleared, so a test states exactly which keys misbehave.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from tpcache.io.storage.base import (
    MISS_CORRUPT,
    MISS_FOREIGN,
    MISS_MISSING,
    PUT_IO_ERROR,
    PUT_NO_SPACE,
    PUT_REASONS,
    PUT_TOO_LARGE,
    StorageBackend,
    StorageClosedError,
    StorageCounters,
    check_keys,
    check_pairs,
)
from tpcache.io.storage.buffers import byte_view
from tpcache.io.storage.keys import StorageKey
from tpcache.io.storage.record import payload_checksum


class MemoryBackend(StorageBackend):
    """Pages in a dict. ``capacity_bytes=None`` means unbounded."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._pages: OrderedDict[StorageKey, tuple[bytes, int]] = OrderedDict()  # LRU first
        self._used = 0
        self._fail_put: dict[StorageKey, str] = {}
        self._lose_on_put: set[StorageKey] = set()
        self._closed = False
        self._counters = StorageCounters(capacity_bytes or 0)

    # ---- fault injection -------------------------------------------------------------------
    def fail_puts(self, keys: Iterable[StorageKey], reason: str = PUT_IO_ERROR) -> None:
        """Make future puts of ``keys`` fail with ``reason`` until :meth:`clear_faults`."""
        if reason not in PUT_REASONS:
            raise ValueError(f"unknown put failure reason {reason!r}; one of {PUT_REASONS}")
        with self._lock:
            for k in check_keys(list(keys)):
                self._fail_put[k] = reason

    def lose_puts(self, keys: Iterable[StorageKey]) -> None:
        """Future puts of ``keys`` report success but store nothing (a lying backend)."""
        with self._lock:
            self._lose_on_put.update(check_keys(list(keys)))

    def clear_faults(self) -> None:
        with self._lock:
            self._fail_put.clear()
            self._lose_on_put.clear()

    def drop(self, keys: Iterable[StorageKey]) -> None:
        """Remove stored pages behind the cache's back (storage-side loss); not counted."""
        with self._lock:
            for k in check_keys(list(keys)):
                self._remove(k)

    def corrupt(self, keys: Iterable[StorageKey], offset: int = 0) -> None:
        """Flip one byte of each stored page; the next get of it is a ``corrupt`` miss."""
        with self._lock:
            for k in check_keys(list(keys)):
                if k in self._pages:
                    data, xxh = self._pages[k]
                    b = bytearray(data)
                    b[offset % len(b)] ^= 0xFF
                    self._pages[k] = (bytes(b), xxh)

    # ---- StorageBackend --------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StorageClosedError("memory storage backend is closed")

    def _remove(self, k: StorageKey) -> bool:
        entry = self._pages.pop(k, None)
        if entry is None:
            return False
        self._used -= len(entry[0])
        return True

    def exists(self, keys: Sequence[StorageKey]) -> list[bool]:
        ks = check_keys(keys)
        with self._lock:
            self._check_open()
            self._counters.add("exists_calls")
            return [k in self._pages for k in ks]

    def get(self, keys: Sequence[StorageKey], out: Sequence[Any]) -> list[bool]:
        ks = check_pairs(keys, out, "output buffers")
        views = [byte_view(b, writable=True) for b in out]
        results: list[bool] = []
        with self._lock:
            self._check_open()
            for k, view in zip(ks, views, strict=True):
                self._counters.add("gets")
                entry = self._pages.get(k)
                if entry is None:
                    self._counters.miss(MISS_MISSING)
                    results.append(False)
                    continue
                data, xxh = entry
                if len(data) != len(view):
                    self._counters.miss(MISS_FOREIGN)
                    results.append(False)
                    continue
                if payload_checksum(data) != xxh:
                    # Corrupt pages are dropped so they are not served or counted again as hits.
                    self._remove(k)
                    self._counters.miss(MISS_CORRUPT)
                    results.append(False)
                    continue
                view[:] = data
                self._pages.move_to_end(k)
                self._counters.add("hits")
                results.append(True)
        return results

    def put(self, keys: Sequence[StorageKey], pages: Sequence[Any]) -> list[bool]:
        ks = check_pairs(keys, pages, "pages")
        views = [byte_view(p) for p in pages]
        results: list[bool] = []
        with self._lock:
            self._check_open()
            batch: set[StorageKey] = set()
            for k, view in zip(ks, views, strict=True):
                self._counters.add("puts")
                reason = self._fail_put.get(k)
                if reason is None and self._capacity is not None:
                    reason = self._make_room(k, len(view), batch)
                if reason is not None:
                    self._counters.put_failure(reason)
                    results.append(False)
                    continue
                if k not in self._lose_on_put:
                    self._remove(k)
                    data = bytes(view)
                    self._pages[k] = (data, payload_checksum(data))
                    self._used += len(data)
                    batch.add(k)
                self._counters.add("put_ok")
                results.append(True)
            self._counters.set("bytes_used", self._used)
        return results

    def _make_room(self, key: StorageKey, size: int, batch: set[StorageKey]) -> str | None:
        """Evict least recently used pages (never ones written in this batch) to fit ``size``."""
        assert self._capacity is not None
        if size > self._capacity:
            return PUT_TOO_LARGE
        replaced = len(self._pages[key][0]) if key in self._pages else 0
        while self._used - replaced + size > self._capacity:
            victim = next((k for k in self._pages if k not in batch and k != key), None)
            if victim is None:
                return PUT_NO_SPACE
            self._remove(victim)
            self._counters.add("evictions")
        return None

    def delete(self, keys: Sequence[StorageKey]) -> list[bool]:
        ks = check_keys(keys)
        with self._lock:
            self._check_open()
            results = [self._remove(k) for k in ks]
            self._counters.add("deletes", sum(results))
            self._counters.set("bytes_used", self._used)
            return results

    def stats(self) -> dict[str, int]:
        with self._lock:
            s = self._counters.snapshot()
            s["records"] = len(self._pages)
            return s

    def close(self) -> None:
        with self._lock:
            self._closed = True
