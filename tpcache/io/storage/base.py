"""The storage backend interface (L3): batched, with one result per key.

Invariants every backend keeps:
- each call returns exactly one bool per key, in key order; a batch is never one pass/fail;
- ``put`` returns True for a key only when its page is wholly written (and synced as the
  backend's fsync mode promises); a page is never visible half-written;
- ``get`` returns True only after the stored bytes were verified for that exact key; on False
  the output buffer holds no stored bytes (it is zero-filled where the backend wrote into it) and
  the miss is counted with its reason;
- storage faults (I/O errors, a full disk, corrupt records) are results and counters, never
  exceptions; exceptions mean caller bugs (bad key, buffer count or type).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from tpcache.comm.parallel import Shard
from tpcache.io.storage.keys import StorageKey, StorageKeyError
from tpcache.io.storage.record import RecordMac

# Why a get missed.
MISS_MISSING = "missing"  # no record for the key
MISS_SHORT = "short"  # the record ends before its declared length (truncated file)
MISS_CORRUPT = "corrupt"  # bad magic, header or payload checksum
MISS_FOREIGN = "foreign"  # a valid record, but for another key/layout/rank, or another page size
MISS_IO_ERROR = "io_error"  # the OS refused the read
MISS_UNAUTHENTICATED = "unauthenticated"  # a storage key is set and the record's MAC is missing or wrong
MISS_UNUSABLE = "unusable"  # the storage can no longer be used (its directory was removed or made read-only)
MISS_REASONS = (
    MISS_MISSING,
    MISS_SHORT,
    MISS_CORRUPT,
    MISS_FOREIGN,
    MISS_IO_ERROR,
    MISS_UNAUTHENTICATED,
    MISS_UNUSABLE,
)

# Why a put failed.
PUT_NO_SPACE = "no_space"  # capacity or disk full (ENOSPC/EDQUOT) and nothing evictable
PUT_TOO_LARGE = "too_large"  # one page larger than the capacity allows
PUT_IO_ERROR = "io_error"  # any other OS error while writing or syncing
PUT_UNUSABLE = "unusable"  # the storage can no longer be used (see ``StorageBackend.unusable``)
PUT_REASONS = (PUT_NO_SPACE, PUT_TOO_LARGE, PUT_IO_ERROR, PUT_UNUSABLE)


class StorageError(RuntimeError):
    """A storage backend cannot be used as configured (bad directory, already in use, closed)."""


class StorageInUse(StorageError):
    """A file store's owner directory is held (its ``LOCK``) by another running instance."""


class StorageClosedError(StorageError):
    """The backend or worker was closed."""


class StorageCounters:
    """Monotonic counters plus gauges behind ``stats()``; thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        self._lock = threading.Lock()
        self._c: dict[str, int] = {
            "puts": 0,
            "put_ok": 0,
            "put_failures": 0,
            **{f"put_failures_{r}": 0 for r in PUT_REASONS},
            "gets": 0,
            "hits": 0,
            "misses": 0,
            **{f"misses_{r}": 0 for r in MISS_REASONS},
            "exists_calls": 0,
            "deletes": 0,
            "evictions": 0,
            "bytes_used": 0,
            "capacity_bytes": capacity_bytes,
        }

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._c[name] = value

    def miss(self, reason: str) -> None:
        with self._lock:
            self._c["misses"] += 1
            self._c[f"misses_{reason}"] += 1

    def put_failure(self, reason: str) -> None:
        with self._lock:
            self._c["put_failures"] += 1
            self._c[f"put_failures_{reason}"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


def check_keys(keys: Sequence[StorageKey]) -> list[StorageKey]:
    """Validate a key batch up front so a bad key fails the call before any I/O."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise StorageKeyError(f"keys must be a sequence of StorageKey, got {type(keys).__name__}")
    out = list(keys)
    for k in out:
        if not isinstance(k, StorageKey):
            raise StorageKeyError(f"expected StorageKey, got {type(k).__name__}")
    return out


def check_pairs(keys: Sequence[StorageKey], bufs: Sequence[Any], what: str) -> list[StorageKey]:
    ks = check_keys(keys)
    if len(bufs) != len(ks):
        raise ValueError(f"{len(ks)} keys but {len(bufs)} {what}; need one per key")
    return ks


def check_shard(shard: tuple[int, ...] | None) -> Shard | None:
    """A backend's ``shard`` argument as a ``Shard``, checked with the keys' rules: ``(tp_rank,
    tp_size)`` for plain TP, or a whole ``Shard`` (stage and context rank included)."""
    if shard is None:
        return None
    try:
        full = Shard(*shard)
    except TypeError:
        what = "(tp_rank, tp_size[, pp_rank, pp_size, cp_rank, cp_size])"
        raise StorageKeyError(f"a shard is {what}, got {shard!r}") from None
    StorageKey.of("", 0, full, 0)  # raises StorageKeyError for a rank outside its size
    return full


def encode_for_shard(keys: Sequence[StorageKey], shard: Shard | None) -> list[bytes]:
    """Each key's canonical encoding (ASCII bytes); a key of another shard (tensor rank, stage or
    context rank) than the backend's ``shard`` (None: any) is refused, so one rank can never read
    or write another's slice of a page."""
    if shard is None:
        return [k.encode().encode("ascii") for k in keys]
    out = []
    for k in keys:
        if k.shard != shard:
            raise StorageKeyError(f"key for shard {k.shard.label} given to the storage of shard {Shard(*shard).label}")
        out.append(k.encode().encode("ascii"))
    return out


class StorageBackend(ABC):
    """Batched page storage keyed by :class:`StorageKey`. Implementations are thread-safe."""

    record_mac: RecordMac | None = None  # the deployment's storage key, when it has one

    def authenticate(self, mac: RecordMac | None) -> None:
        """Sign every record written from now on with ``mac`` and serve only records whose MAC
        verifies under it (anything else is a ``unauthenticated`` miss); None: checksums only.
        Backends that store no records (``MemoryBackend``) keep pages in this process only."""
        self.record_mac = mac

    def unusable(self) -> str | None:
        """Why this backend can no longer store anything (its directory was removed, replaced or made
        read-only), or None. Once it says so it stays so: its reads miss and its writes fail, and the
        rank tells the others in the round (every rank stops using storage). Cheap: the rank asks
        every round."""
        return None

    @property
    def trust(self) -> str:
        """In words, for the start-up line: what a served record has been checked for."""
        if self.record_mac is None:
            return "records checksummed, not authenticated (set storage_key to authenticate them)"
        return "records authenticated with the storage key (keyed BLAKE2b)"

    @abstractmethod
    def exists(self, keys: Sequence[StorageKey]) -> list[bool]:
        """Whether each key has a stored record (not verified; ``get`` verifies)."""

    @abstractmethod
    def get(self, keys: Sequence[StorageKey], out: Sequence[Any]) -> list[bool]:
        """Read each key's page into ``out[i]`` (same byte length as the stored page)."""

    @abstractmethod
    def put(self, keys: Sequence[StorageKey], pages: Sequence[Any]) -> list[bool]:
        """Store each page; True per key once wholly written (and synced per fsync mode)."""

    @abstractmethod
    def delete(self, keys: Sequence[StorageKey]) -> list[bool]:
        """Remove each key; True where a record was removed."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: puts, put_failures(_<reason>), gets, hits, misses(_<reason>), evictions,
        bytes_used, capacity_bytes and backend-specific extras."""

    @abstractmethod
    def close(self) -> None:
        """Release files and locks; idempotent. Later calls raise :class:`StorageClosedError`."""

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
