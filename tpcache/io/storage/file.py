"""The default storage backend: append-only segment files in a directory, crash-safe.

Why segments: one temp file + rename per page has to sync every page (or give up durability) and
reads back one small file per page; appending records to a segment with one fdatasync per batch
writes at close to raw sequential speed, and a batch read back is contiguous on disk.
``scripts/bench_storage.py --layouts`` measures both against raw sequential I/O.

Layout: ``<root>/<owner>/<segno:010d>.seg`` plus ``<root>/<owner>/LOCK``, where the owner is
``r<rank>of<size>`` for an instance bound to one TP shard (``p<stage>of<stages>.r<rank>of<size>``
with pipeline stages; ranks can share ``root``) or ``all``.
Each record is ``record.HEADER`` + key echo + payload (see ``record``). A sealed segment has an
index ``<segno:010d>.idx`` (see ``segment_index``), written when it is sealed and rewritten at close
(or after a delete) when records in it died since, so a restart reads one small file per segment
instead of one header per record; a segment whose index is missing, corrupt or stale is scanned.

Invariants:
- a record enters the index only after its bytes are wholly written (and synced as ``fsync``
  promises), and a restarted instance indexes only records whose header checksum verifies and
  whose full length is on disk: a torn write is never visible;
- a get returns True only after magic, header checksum, key echo, length and payload checksum
  match; anything else is a counted miss and the bad record is dropped from the index;
- ``bytes_used`` (all segment bytes on disk) never exceeds ``capacity_bytes`` after a put; room
  is made by LRU eviction in access order (deterministic: the order of calls alone decides it)
  and by compacting the segment with the most dead bytes;
- segments are written only by their owner, which holds an exclusive ``flock`` on ``LOCK``;
  a new instance never appends to an old segment (its tail may be torn);
- an index is written only for a sealed segment and lists only records already written to it;
  one that gains records after it was written (compaction copies) is rewritten and synced before
  the originals are deleted, so no durable record is ever missing from its segment's index; an
  index is removed before its segment is, and a new segment removes any leftover index of its
  number first (the tail check catches one a power loss brings back).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tpcache.io.memory import format_bytes
from tpcache.io.storage.base import (
    MISS_CORRUPT,
    MISS_FOREIGN,
    MISS_IO_ERROR,
    MISS_MISSING,
    MISS_SHORT,
    MISS_UNAUTHENTICATED,
    MISS_UNUSABLE,
    PUT_IO_ERROR,
    PUT_NO_SPACE,
    PUT_TOO_LARGE,
    PUT_UNUSABLE,
    StorageBackend,
    StorageClosedError,
    StorageCounters,
    StorageError,
    StorageInUse,
    check_keys,
    check_pairs,
    check_shard,
    encode_for_shard,
)
from tpcache.io.storage.buffers import byte_view
from tpcache.io.storage.keys import StorageKey, StorageKeyError
from tpcache.io.storage.record import (
    HEADER_SIZE,
    MAGIC_DEAD,
    MAX_KEY_BYTES,
    RecordError,
    decode_header,
    encode_header,
    payload_checksum,
    read_key_echo,
)
from tpcache.io.storage.segment_index import (
    IndexEntry,
    SegmentIndex,
    SegmentIndexError,
    decode_index,
    encode_index,
)

log = logging.getLogger("tpcache.storage")

FsyncMode = Literal["always", "batch", "never"]
FSYNC_MODES: tuple[str, ...] = ("always", "batch", "never")
DEFAULT_SEGMENT_BYTES = 64 << 20
_SEGMENT_NAME = re.compile(r"([0-9]{10})\.seg")
_INDEX_NAME = re.compile(r"([0-9]{10})\.idx")
_OWNER_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")
_TMP_SUFFIX = ".tmp"
_RUN_BUFS = 512  # buffers per pwritev (two per record), under the kernel's IOV_MAX of 1024
_SCAN_READ = HEADER_SIZE + 256  # one pread covers the header and a typical key echo
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How often ``unusable`` looks at the directory again (a stat, an fstat and an access: ~10 us).
_CHECK_S = 0.05
_CHECK_CALLS = 4
_EXTRA_COUNTERS = (
    "live_bytes",
    "records",
    "segments",
    "compactions",
    "startup_discarded_torn",
    "startup_discarded_corrupt",
    "startup_discarded_foreign",
    "startup_superseded",
    "startup_indexed_segments",
    "startup_scanned_segments",
    "startup_index_fallbacks",
    "index_writes",
    "index_write_failures",
    "dead_mark_failures",
    "unlink_failures",
    "delete_sync_failures",
)


@dataclass(slots=True)
class _Loc:
    segno: int
    offset: int
    record_len: int
    payload_len: int
    seq: int


@dataclass
class _Segment:
    segno: int
    path: Path
    fd: int
    size: int  # bytes on disk, also the append offset
    live_bytes: int = 0
    members: dict[bytes, None] = field(default_factory=dict)  # live keys, insertion-ordered
    tail: int = -1  # offset of the last whole record (live or dead); -1 when none
    indexed: bool = False  # its .idx file lists exactly its live records

    @property
    def dead_bytes(self) -> int:
        return self.size - self.live_bytes


@dataclass
class _Run:
    """Records queued for one ``pwritev`` at the end of the active segment (not yet indexed)."""

    seg: _Segment | None = None
    start: int = 0  # where the run's bytes begin in the segment
    tail: int = -1  # the segment's tail before the run
    bufs: list[Any] = field(default_factory=list)
    records: list[tuple[int, bytes, _Loc]] = field(default_factory=list)  # (call index, key, location)


class _PutFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _pwritev_all(fd: int, bufs: list[memoryview | bytes], offset: int) -> None:
    """Write every byte of ``bufs`` at ``offset``, looping over short writes."""
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _index_path(segment: Path) -> Path:
    return segment.with_suffix(".idx")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileBackend(StorageBackend):
    """Append-only segment storage under ``root``; see the module docstring for invariants.

    Args:
        root: directory (created if missing); several shards' instances may share it.
        capacity_bytes: bound on this instance's bytes on disk.
        fsync: ``always`` (each record synced before its True), ``batch`` (one sync per segment
            touched, per call, before any True), ``never`` (survives a process kill, not a
            power loss).
        shard: ``(tp_rank, tp_size)`` or a ``Shard`` (with its stage) this instance serves; keys
            of other shards are rejected. None serves every shard from one owner directory.
        segment_bytes: target segment size; capped at ``capacity_bytes // 16`` so compaction
            headroom stays small relative to capacity.
        verify_on_open: also check every payload checksum at start (reads all data).
        owner: the owner directory's name (``[A-Za-z0-9._-]``) instead of the shard's label; a
            store shared by groups of different shapes names each writer (see ``sharded``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity_bytes: int,
        fsync: FsyncMode = "batch",
        shard: tuple[int, ...] | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        verify_on_open: bool = False,
        owner: str | None = None,
    ) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {FSYNC_MODES}, got {fsync!r}")
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        self._shard = check_shard(shard)  # validated with the same rules as keys
        if owner is not None and (not _OWNER_NAME.fullmatch(owner) or owner in (".", "..")):
            raise ValueError(f"owner must be a directory name of [A-Za-z0-9._-], got {owner!r}")
        owner = owner or ("all" if self._shard is None else self._shard.label)
        self._fsync = fsync
        self._capacity = capacity_bytes
        self._segment_cap = segment_bytes
        self._set_capacity(capacity_bytes)
        self._full_noted = False  # the filesystem filled up below capacity once (logged once)
        self._unusable: str | None = None  # why the directory can no longer be used, once it cannot
        self._checked_at = 0.0
        self._asked = 0
        self._check_lock = threading.Lock()
        self._lock = threading.RLock()
        self._closed = False
        self._counters = StorageCounters(capacity_bytes)
        for extra in _EXTRA_COUNTERS:
            self._counters.set(extra, 0)
        self._index: OrderedDict[bytes, _Loc] = OrderedDict()  # least recently used first
        self._segments: dict[int, _Segment] = {}
        self._active: _Segment | None = None
        self._disk = 0
        self._live = 0
        self._seq = 1
        self._dir = Path(root) / owner
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self._dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot use storage directory {self._dir}: {exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise StorageInUse(
                f"storage directory {self._dir} is in use by another instance of the same shard"
            ) from None
        st = os.stat(self._dir)
        self._dir_id = (st.st_dev, st.st_ino)  # a directory removed and made again is another one
        self._clamp_to_filesystem()
        try:
            self._rebuild(verify_on_open)
            with self._lock:
                self._make_room(0, set())
        except BaseException:
            self._release()
            raise
        self._publish()

    def unusable(self) -> str | None:
        """Why the directory can no longer be used, or None. Looks again every ``_CHECK_CALLS``-th
        call (a rank asks once a round) or once ``_CHECK_S`` passed, whichever comes first."""
        if self._unusable is None and not self._closed:
            self._asked += 1
            if self._asked % _CHECK_CALLS == 0 or time.monotonic() - self._checked_at >= _CHECK_S:
                self._check_dir()
        return self._unusable

    def _check_dir(self) -> bool:
        """Look at the directory now: whether it is unusable (removed, replaced, not writable).
        Writes into files whose directory is gone would be acknowledged and lost at the next start;
        the first look that finds it so logs one warning, and from then on nothing is written."""
        with self._check_lock:
            if self._unusable is not None:
                return True
            self._checked_at = time.monotonic()
            why = None
            try:
                st = os.stat(self._dir)
                links = os.fstat(self._lock_fd).st_nlink
            except FileNotFoundError:
                why = "was removed"
            except OSError as exc:
                why = f"cannot be read ({exc.strerror})"
            else:
                if (st.st_dev, st.st_ino) != self._dir_id or links == 0:
                    why = "was removed or replaced"
                elif not st.st_mode & stat.S_IWUSR or not os.access(self._dir, os.W_OK, effective_ids=True):
                    why = "is not writable"
            if why is None:
                return False
            self._unusable = why
            self._counters.set("capacity_bytes", 0)
        log.warning(
            "storage directory %s %s: this rank's storage turns to misses and refused writes, and every rank "
            "stops using storage; restart with a usable directory",
            self._dir,
            why,
        )
        return True

    def _set_capacity(self, capacity: int) -> None:
        self._capacity = capacity
        self._segment_bytes = max(1, min(self._segment_cap, capacity // 16))
        self._reserve = self._segment_bytes  # compaction headroom, see _make_room
        if hasattr(self, "_counters"):
            self._counters.set("capacity_bytes", capacity)

    def _clamp_to_filesystem(self) -> None:
        """A capacity above what the filesystem can hold (its free space plus this store's own
        segments already on it) is lowered to that, with a warning: otherwise the disk fills
        before eviction starts. 5% of it is left for index files and the filesystem's own use."""
        try:
            st = os.statvfs(self._dir)
            own = sum(e.stat().st_size for e in os.scandir(self._dir) if _SEGMENT_NAME.fullmatch(e.name))
        except OSError:
            return  # the start-up scan reports an unusable directory
        room = (st.f_bavail * st.f_frsize + own) * 95 // 100
        if self._capacity <= room:
            return
        log.warning(
            "storage capacity %s is more than %s can hold (%s free + %s of its own segments): using %s",
            format_bytes(self._capacity),
            self._dir,
            format_bytes(st.f_bavail * st.f_frsize),
            format_bytes(own),
            format_bytes(room),
        )
        self._set_capacity(max(room, 1))

    def _filesystem_full(self, pinned: set[bytes], keep: _Segment | None) -> bool:
        """The disk is full below capacity (ENOSPC: other files took the space, or it shrank):
        evict this store's oldest segment (neither the one being written, ``keep``, nor one holding
        a record of this call) so that writing goes on, and lower the capacity to what the store
        held when the disk filled (until a restart sizes it again), so that later puts make room
        by eviction first. Whether any space was freed."""
        victim = next(
            (
                seg
                for seg in sorted(self._segments.values(), key=lambda x: x.segno)
                if seg is not keep and not any(enc in pinned for enc in seg.members)
            ),
            None,
        )
        if victim is None:
            return False
        if self._disk < self._capacity:
            if not self._full_noted:
                self._full_noted = True
                log.warning(
                    "storage directory %s is full at %s of this store's own (capacity %s): capacity lowered to "
                    "that, oldest records evicted to keep writing",
                    self._dir,
                    format_bytes(self._disk),
                    format_bytes(self._capacity),
                )
            self._set_capacity(max(self._disk, 1))
        self._drop_oldest(victim)
        return True

    def _drop_oldest(self, seg: _Segment) -> None:
        """Evict every record of ``seg`` and delete it (it frees its whole file at once)."""
        for enc in list(seg.members):
            self._forget(enc, self._index.pop(enc), mark_dead=False)
            self._counters.add("evictions")
        if seg.segno in self._segments:  # the active segment: seal it, then delete it
            if seg is self._active:
                self._active = None
            self._drop_segment(seg)

    # ---- startup -----------------------------------------------------------------------------
    def _rebuild(self, verify: bool) -> None:
        """Index every complete, checksummed, own-shard live record; newest seq per key wins.

        A segment's records come from its index file when that verifies, else from a scan of its
        headers (always with ``verify``, which reads every payload anyway)."""
        found: list[tuple[bytes, _Loc]] = []
        names = sorted(os.listdir(self._dir))
        segnos = {int(m[1]) for m in map(_SEGMENT_NAME.fullmatch, names) if m is not None}
        for name in names:
            m = _INDEX_NAME.fullmatch(name)
            if (m is not None and int(m[1]) not in segnos) or name.endswith(_TMP_SUFFIX):
                with contextlib.suppress(OSError):  # an index left by a segment that is gone
                    os.unlink(self._dir / name)
        segments = []
        for segno in sorted(segnos):
            path = self._dir / f"{segno:010d}.seg"
            fd = os.open(path, os.O_RDWR)
            seg = _Segment(segno, path, fd, os.fstat(fd).st_size)
            self._segments[seg.segno] = seg
            self._disk += seg.size
            segments.append(seg)
        # Two passes of small reads, each announced first so that a cold device serves them in
        # parallel: every index file, then every tail record header they name.
        indexes = {} if verify else self._read_indexes(segments)
        for seg in segments:
            indexed = self._load_index(seg, indexes.get(seg.segno))
            if indexed is None:
                self._counters.add("startup_scanned_segments")
                found.extend(self._scan(seg, verify))
            else:
                self._counters.add("startup_indexed_segments")
                seg.indexed = True
                found.extend(indexed)
        # Newest record of a key wins; ties (a compaction copy and its original) go to the copy.
        # In (seq, segno, offset) order the last record of each key is its winner, and the winners
        # in that order are the LRU order after a restart: write order, the only one that survived.
        found.sort(key=lambda item: (item[1].seq, item[1].segno, item[1].offset))
        winners: dict[bytes, _Loc] = dict(found)
        for enc, loc in found:
            if winners[enc] is not loc:
                seg = self._segments[loc.segno]
                self._mark_dead(seg, loc)
                seg.indexed = False
                self._counters.add("startup_superseded")
        for enc, loc in found:
            if winners[enc] is loc:
                self._remember(enc, loc)
        if found:
            self._seq = max(self._seq, max(loc.seq for loc in winners.values()) + 1)
        for seg in list(self._segments.values()):
            if not seg.members:
                self._drop_segment(seg)

    def _scan(self, seg: _Segment, verify: bool) -> list[tuple[bytes, _Loc]]:
        out: list[tuple[bytes, _Loc]] = []
        offset = 0
        while offset + HEADER_SIZE <= seg.size:
            raw = os.pread(seg.fd, _SCAN_READ, offset)
            key_len = int.from_bytes(raw[6:8], "little")
            if HEADER_SIZE + key_len > len(raw) and key_len <= MAX_KEY_BYTES:
                raw = os.pread(seg.fd, HEADER_SIZE + key_len, offset)
            try:
                head = decode_header(raw, None)
            except RecordError as exc:
                # Torn or corrupt: nothing after it in this segment can be located safely.
                torn = exc.reason == "short"
                self._counters.add("startup_discarded_torn" if torn else "startup_discarded_corrupt")
                break
            if offset + head.record_len > seg.size:
                self._counters.add("startup_discarded_torn")
                break
            enc = read_key_echo(raw, head)
            loc = _Loc(seg.segno, offset, head.record_len, head.payload_len, head.seq)
            seg.tail = offset
            offset += head.record_len
            if not head.live:
                continue
            if not self._own_key(enc):
                self._counters.add("startup_discarded_foreign")
                self._mark_dead(seg, loc)
                continue
            if verify:
                payload = os.pread(seg.fd, head.payload_len, loc.offset + loc.record_len - head.payload_len)
                if payload_checksum(payload) != head.payload_xxh:
                    self._counters.add("startup_discarded_corrupt")
                    self._mark_dead(seg, loc)
                    continue
            out.append((enc, loc))
        return out

    def _read_indexes(self, segments: list[_Segment]) -> dict[int, SegmentIndex]:
        """The decoded index of each segment that has a well-formed one for its current length."""
        paths = {seg.segno: _index_path(seg.path) for seg in segments}
        fds: dict[int, int] = {}
        try:
            for segno, path in paths.items():
                try:
                    fds[segno] = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    continue
                except OSError:
                    self._counters.add("startup_index_fallbacks")
                    continue
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fds[segno], 0, 0, os.POSIX_FADV_WILLNEED)
            out: dict[int, SegmentIndex] = {}
            for seg in segments:
                fd = fds.get(seg.segno)
                if fd is None:
                    continue
                try:
                    with open(fd, "rb", closefd=False) as f:
                        out[seg.segno] = decode_index(f.read(), self._dir.name, seg.segno, seg.size)
                except (SegmentIndexError, OSError):
                    self._counters.add("startup_index_fallbacks")
                    continue
                with contextlib.suppress(OSError):
                    os.posix_fadvise(seg.fd, out[seg.segno].tail_offset, HEADER_SIZE, os.POSIX_FADV_WILLNEED)
            return out
        finally:
            for fd in fds.values():
                os.close(fd)

    def _load_index(self, seg: _Segment, index: SegmentIndex | None) -> list[tuple[bytes, _Loc]] | None:
        """The live records of ``seg`` from its decoded index, or None when it has no usable one."""
        if index is None:
            return None
        if index.rows or seg.size:
            # Ties the index to this file: the tail record it saw is still there, unchanged.
            try:
                raw = os.pread(seg.fd, HEADER_SIZE, index.tail_offset)
            except OSError:
                raw = b""
            if raw[4:] != index.tail_head:
                self._counters.add("startup_index_fallbacks")
                return None
        seg.tail = index.tail_offset
        out = []
        keys, start, segno = index.keys, 0, seg.segno
        for offset, seq, payload_len, key_len in index.rows:
            end = start + key_len
            out.append((keys[start:end], _Loc(segno, offset, HEADER_SIZE + key_len + payload_len, payload_len, seq)))
            start = end
        return out

    def _write_index(self, seg: _Segment, *, durable: bool = False) -> None:
        """Write ``seg``'s index (temp file, rename); on failure remove any stale one.

        ``durable``: synced before returning, for an index that gained records since its last
        version (a compaction copy, which must stay findable once its original is deleted) or lost
        a deleted one. Otherwise a power loss may cost the index (the segment is scanned) or bring
        back its previous version, which lists a superset of the live records (a miss at get)."""
        path = _index_path(seg.path)
        if seg.tail < 0:
            # No whole record: nothing to index; drop any older index.
            self._unlink_index(seg)
            seg.indexed = True
            return
        tmp = path.with_name(path.name + _TMP_SUFFIX)
        try:
            tail_head = os.pread(seg.fd, HEADER_SIZE, seg.tail)[4:]
            entries = []
            for enc in seg.members:
                loc = self._index[enc]
                entries.append(IndexEntry(enc, loc.offset, loc.seq, loc.payload_len, loc.record_len))
            entries.sort(key=lambda e: e.offset)
            data = encode_index(self._dir.name, seg.segno, seg.size, seg.tail, tail_head, entries)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _pwritev_all(fd, [data], 0)
                if durable and self._fsync != "never":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if durable and self._fsync != "never":
                _fsync_dir(self._dir)
        except OSError:
            self._counters.add("index_write_failures")
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._unlink_index(seg)  # a restart scans this segment instead
            return
        seg.indexed = True
        self._counters.add("index_writes")

    def _unlink_index(self, seg: _Segment) -> None:
        with contextlib.suppress(FileNotFoundError):
            try:
                os.unlink(_index_path(seg.path))
            except OSError:
                self._counters.add("unlink_failures")

    def _own_key(self, enc: bytes) -> bool:
        try:
            key = StorageKey.decode(enc.decode("ascii"))
        except (StorageKeyError, UnicodeDecodeError):
            return False
        return self._shard is None or key.shard == self._shard

    # ---- bookkeeping (caller holds the lock) -------------------------------------------------
    def _remember(self, enc: bytes, loc: _Loc) -> None:
        seg = self._segments[loc.segno]
        seg.members[enc] = None
        seg.live_bytes += loc.record_len
        self._live += loc.record_len
        self._index[enc] = loc

    def _forget(self, enc: bytes, loc: _Loc, *, mark_dead: bool) -> None:
        """Drop a record already popped from the index; free its segment when it empties."""
        seg = self._segments[loc.segno]
        del seg.members[enc]
        seg.indexed = False
        seg.live_bytes -= loc.record_len
        self._live -= loc.record_len
        if mark_dead:
            self._mark_dead(seg, loc)
        if not seg.members and seg is not self._active:
            self._drop_segment(seg)

    def _mark_dead(self, seg: _Segment, loc: _Loc) -> None:
        # One aligned 4-byte write; if it is lost in a crash the record merely comes back as
        # a valid (older) copy of its own key, which the next restart indexes or supersedes.
        try:
            os.pwrite(seg.fd, MAGIC_DEAD, loc.offset)
        except OSError:
            self._counters.add("dead_mark_failures")

    def _drop_segment(self, seg: _Segment) -> None:
        del self._segments[seg.segno]
        self._disk -= seg.size
        os.close(seg.fd)
        self._unlink_index(seg)  # first: an index never outlives its segment's file
        try:
            os.unlink(seg.path)
        except OSError:
            self._counters.add("unlink_failures")

    def _evict_lru(self, pinned: set[bytes]) -> bool:
        for enc in self._index:
            if enc not in pinned:
                self._forget(enc, self._index.pop(enc), mark_dead=True)
                self._counters.add("evictions")
                return True
        return False

    def _make_room(self, need: int, pinned: set[bytes]) -> str | None:
        """Evict/compact until ``need`` more bytes fit; a put-failure reason or None.

        Disk use is kept at most ``capacity - reserve`` between puts, so a compaction (which
        copies at most one segment's live bytes before deleting it) never exceeds capacity;
        live data is kept at most ``capacity - 2 * reserve`` so compaction always has dead bytes
        to reclaim.
        """
        if need and need + 2 * self._reserve > self._capacity:
            return PUT_TOO_LARGE
        while self._disk + need + self._reserve > self._capacity:
            if self._live + need + 2 * self._reserve > self._capacity:
                # Evict down to a lower watermark (one more reserve) so the following
                # compactions find more dead bytes per segment copied.
                while self._live + need + 3 * self._reserve > self._capacity:
                    if not self._evict_lru(pinned):
                        break
                if self._live + need + 2 * self._reserve > self._capacity:
                    return PUT_NO_SPACE
                continue
            # Most dead bytes first (most space per byte copied); ties to the oldest segment.
            victim = max(self._segments.values(), key=lambda s: (s.dead_bytes, -s.segno), default=None)
            if victim is None or victim.dead_bytes <= 0:
                return PUT_NO_SPACE
            if self._disk + victim.live_bytes > self._capacity:
                # Only an oversized record can get here; evicting keeps the bound strict.
                if not self._evict_lru(pinned):
                    return PUT_NO_SPACE
                continue
            try:
                self._compact(victim)
            except OSError as exc:
                if exc.errno in _NO_SPACE_ERRNOS and self._filesystem_full(pinned, None):
                    continue
                return PUT_NO_SPACE if exc.errno in _NO_SPACE_ERRNOS else PUT_IO_ERROR
        return None

    def _compact(self, victim: _Segment) -> None:
        """Copy the victim's live records to the active segment, then delete the victim."""
        if victim is self._active:
            self._active = None  # seal it (no index: it is about to go); copies go to a fresh segment
        moved: list[tuple[bytes, _Loc]] = []
        touched: set[int] = set()
        # On an OSError below the copies are never indexed (their bytes are dead space) and
        # the originals stay where they are.
        for enc in sorted(victim.members, key=lambda e: self._index[e].offset):
            loc = self._index[enc]
            data = os.pread(victim.fd, loc.record_len, loc.offset)
            if len(data) != loc.record_len:
                raise OSError(errno.EIO, "segment shorter than its index")
            dst = self._append_raw([data], loc.record_len)
            touched.add(dst.segno)
            new = _Loc(dst.segno, dst.size - loc.record_len, loc.record_len, loc.payload_len, loc.seq)
            moved.append((enc, new))
        if self._fsync != "never":
            self._sync(touched)  # the copies are durable before the originals go
        for enc, new in moved:
            old = self._index[enc]
            self._segments[old.segno].members.pop(enc)
            self._segments[old.segno].live_bytes -= old.record_len
            dst = self._segments[new.segno]
            dst.indexed = False
            dst.members[enc] = None
            dst.live_bytes += new.record_len
            self._index[enc] = new  # same key: keeps its LRU position
        # A copy in a segment sealed meanwhile must be in its index before the original goes, or a
        # crash would leave the copy unlisted and the original deleted.
        for segno in sorted(touched):
            dst = self._segments[segno]
            if dst is not self._active and not dst.indexed:
                self._write_index(dst, durable=True)
        self._counters.add("compactions")
        self._drop_segment(victim)

    def _append_raw(self, bufs: list[Any], length: int) -> _Segment:
        """Append ``length`` bytes to the active segment (rolling it first when full)."""
        seg = self._active
        if seg is None or (seg.size > 0 and seg.size + length > self._segment_bytes):
            seg = self._new_segment()
        try:
            _pwritev_all(seg.fd, bufs, seg.size)
        except OSError:
            # Drop partial bytes so the segment holds only whole records; best effort.
            with contextlib.suppress(OSError):
                os.ftruncate(seg.fd, seg.size)
            raise
        seg.tail = seg.size
        seg.size += length
        self._disk += length
        return seg

    def _new_segment(self) -> _Segment:
        segno = max(self._segments, default=0) + 1
        path = self._dir / f"{segno:010d}.seg"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_index_path(path))  # left by an earlier segment of this number
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        if self._fsync != "never":
            _fsync_dir(self._dir)
        seg = _Segment(segno, path, fd, 0)
        self._segments[segno] = seg
        # The sealed segment is kept even when it has no live records yet: a compaction in
        # progress may have copied records into it that it indexes only after syncing.
        # An empty sealed segment is all dead bytes, so the next compaction drops it first.
        sealed, self._active = self._active, seg
        if sealed is not None and sealed.segno in self._segments:
            self._write_index(sealed)  # once nothing can be appended to it any more
        return seg

    def _sync(self, segnos: set[int]) -> None:
        for segno in sorted(segnos):
            seg = self._segments.get(segno)
            if seg is not None:
                os.fdatasync(seg.fd)

    def _publish(self) -> None:
        self._counters.set("bytes_used", self._disk)
        self._counters.set("live_bytes", self._live)
        self._counters.set("records", len(self._index))
        self._counters.set("segments", len(self._segments))

    # ---- StorageBackend ----------------------------------------------------------------------
    def _encode(self, keys: Sequence[StorageKey]) -> list[bytes]:
        return encode_for_shard(keys, self._shard)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageClosedError(f"file storage backend at {self._dir} is closed")

    def exists(self, keys: Sequence[StorageKey]) -> list[bool]:
        encs = self._encode(check_keys(keys))
        with self._lock:
            self._check_open()
            self._counters.add("exists_calls")
            if self.unusable() is not None:
                return [False] * len(encs)
            return [e in self._index for e in encs]

    def get(self, keys: Sequence[StorageKey], out: Sequence[Any]) -> list[bool]:
        encs = self._encode(check_pairs(keys, out, "output buffers"))
        views = [byte_view(b, writable=True) for b in out]
        with self._lock:
            self._check_open()
            if self.unusable() is not None:
                self._counters.add("gets", len(encs))
                for _ in encs:
                    self._counters.miss(MISS_UNUSABLE)
                return [False] * len(encs)
            results = [self._get_one(enc, view) for enc, view in zip(encs, views, strict=True)]
            self._publish()
        return results

    def _get_one(self, enc: bytes, view: memoryview) -> bool:
        self._counters.add("gets")
        loc = self._index.get(enc)
        if loc is None:
            self._counters.miss(MISS_MISSING)
            return False
        if loc.payload_len != len(view):
            # Same key, another page size: a layout the caller does not expect.
            self._counters.miss(MISS_FOREIGN)
            return False
        seg = self._segments[loc.segno]
        head = bytearray(loc.record_len - loc.payload_len)
        try:
            n = os.preadv(seg.fd, [head, view], loc.offset)
        except OSError:
            self._counters.miss(MISS_IO_ERROR)
            return False
        reason: str | None = None
        mark_dead = True
        if n < loc.record_len:
            reason, mark_dead = MISS_SHORT, False  # writing past a truncation would extend it
        else:
            try:
                header = decode_header(head, enc)
                if not header.live or header.record_len != loc.record_len:
                    reason = MISS_FOREIGN
                elif payload_checksum(view) != header.payload_xxh:
                    reason = MISS_CORRUPT
                elif self.record_mac is not None and not self.record_mac.verify(header, enc, view):
                    reason = MISS_UNAUTHENTICATED
            except RecordError as exc:
                reason = MISS_CORRUPT if exc.reason == "corrupt" else MISS_FOREIGN
        if reason is not None:
            view[:] = bytes(len(view))  # never leave unverified bytes in the caller's buffer
            self._forget(enc, self._index.pop(enc), mark_dead=mark_dead)
            self._counters.miss(reason)
            return False
        self._index.move_to_end(enc)
        self._counters.add("hits")
        return True

    def put(self, keys: Sequence[StorageKey], pages: Sequence[Any]) -> list[bool]:
        encs = self._encode(check_pairs(keys, pages, "pages"))
        views = [byte_view(p) for p in pages]
        results = [False] * len(encs)
        with self._lock:
            self._check_open()
            self._counters.add("puts", len(encs))
            if self._check_dir():
                for _ in encs:
                    self._counters.put_failure(PUT_UNUSABLE)
                return results
            pinned: set[bytes] = set()
            touched: set[int] = set()
            run = _Run()
            for i, (enc, view) in enumerate(zip(encs, views, strict=True)):
                try:
                    self._put_one(i, enc, view, pinned, run, results, touched)
                except _PutFailed as exc:
                    self._counters.put_failure(exc.reason)
            self._flush_run(run, pinned, results, touched)
            written = [i for i, ok in enumerate(results) if ok]
            withdraw = None
            if self._fsync == "batch" and written:
                try:
                    self._sync(touched)
                except OSError:
                    withdraw = PUT_IO_ERROR  # not durable
            if written and withdraw is None and self._check_dir():
                withdraw = PUT_UNUSABLE  # written into files a restart cannot find
            if withdraw is not None:
                # Withdraw this call's records, report each key as failed.
                for i in written:
                    loc = self._index.pop(encs[i], None)
                    if loc is not None:
                        self._forget(encs[i], loc, mark_dead=True)
                    results[i] = False
                    self._counters.put_failure(withdraw)
            self._counters.add("put_ok", sum(results))
            self._publish()
        return results

    def _put_one(
        self,
        i: int,
        enc: bytes,
        view: memoryview,
        pinned: set[bytes],
        run: _Run,
        results: list[bool],
        touched: set[int],
    ) -> None:
        """Queue one record on ``run`` (written by ``_flush_run``), making room first if needed."""
        mac = self.record_mac.sign(enc, view) if self.record_mac is not None else b""
        head = encode_header(enc, self._seq, len(view), payload_checksum(view), mac=mac)
        length = len(head) + len(view)
        if length + 2 * self._reserve > self._capacity:
            raise _PutFailed(PUT_TOO_LARGE)
        if self._disk + length + self._reserve > self._capacity:
            # Eviction and compaction see only written, indexed records: write the run first.
            self._flush_run(run, pinned, results, touched)
            reason = self._make_room(length, pinned)
            if reason is not None:
                raise _PutFailed(reason)
        seg = self._active
        if seg is None or (seg.size > 0 and seg.size + length > self._segment_bytes):
            self._flush_run(run, pinned, results, touched)
            while True:
                try:
                    seg = self._new_segment()
                except OSError as exc:
                    if exc.errno in _NO_SPACE_ERRNOS and self._filesystem_full(pinned, self._active):
                        continue
                    raise _PutFailed(PUT_NO_SPACE if exc.errno in _NO_SPACE_ERRNOS else PUT_IO_ERROR) from None
                break
        if run.seg is None:
            run.seg, run.start, run.tail = seg, seg.size, seg.tail
        # Reserved now (the capacity bound counts it), indexed once its bytes are written.
        run.bufs += (head, view)
        run.records.append((i, enc, _Loc(seg.segno, seg.size, length, len(view), self._seq)))
        self._seq += 1
        seg.tail = seg.size
        seg.size += length
        self._disk += length
        if self._fsync == "always" or len(run.bufs) >= _RUN_BUFS:
            self._flush_run(run, pinned, results, touched)

    def _flush_run(self, run: _Run, pinned: set[bytes], results: list[bool], touched: set[int]) -> None:
        """Write the queued records in one ``pwritev`` (looping over short writes), then index them;
        on an I/O error none of them is indexed, the segment is cut back and each key fails."""
        seg = run.seg
        if seg is None:
            return
        records, bufs = run.records, run.bufs
        run.seg, run.bufs, run.records = None, [], []
        try:
            _pwritev_all(seg.fd, bufs, run.start)
            if self._fsync == "always":
                os.fdatasync(seg.fd)
        except OSError:
            # Cut the run off and write its records one by one, so that only the keys that do not
            # land fail (as a disk that fills up midway, or frees space again, decides).
            self._truncate(seg, run.start)
            self._disk -= seg.size - run.start
            seg.size, seg.tail = run.start, run.tail
            for n, (i, enc, loc) in enumerate(records):
                loc.offset = seg.size
                while True:
                    try:
                        _pwritev_all(seg.fd, bufs[2 * n : 2 * n + 2], loc.offset)
                        if self._fsync == "always":
                            os.fdatasync(seg.fd)
                    except OSError as exc:
                        self._truncate(seg, loc.offset)
                        if exc.errno in _NO_SPACE_ERRNOS and self._filesystem_full(pinned, seg):
                            continue  # a segment was freed: try this record again
                        self._counters.put_failure(PUT_NO_SPACE if exc.errno in _NO_SPACE_ERRNOS else PUT_IO_ERROR)
                        failed = True
                    else:
                        failed = False
                    break
                if failed:
                    continue
                seg.tail = loc.offset
                seg.size += loc.record_len
                self._disk += loc.record_len
                self._index_put(i, enc, loc, pinned, results)
        else:
            for i, enc, loc in records:
                self._index_put(i, enc, loc, pinned, results)
        touched.add(seg.segno)

    def _index_put(self, i: int, enc: bytes, loc: _Loc, pinned: set[bytes], results: list[bool]) -> None:
        old = self._index.pop(enc, None)
        if old is not None:
            self._forget(enc, old, mark_dead=True)  # the new record is on disk first
        self._remember(enc, loc)
        pinned.add(enc)
        results[i] = True

    def _truncate(self, seg: _Segment, size: int) -> None:
        """Drop partial bytes so the segment holds only whole records; best effort."""
        with contextlib.suppress(OSError):
            os.ftruncate(seg.fd, size)

    def delete(self, keys: Sequence[StorageKey]) -> list[bool]:
        encs = self._encode(check_keys(keys))
        with self._lock:
            self._check_open()
            results = []
            touched: set[int] = set()
            for enc in encs:
                loc = self._index.pop(enc, None)
                if loc is not None:
                    touched.add(loc.segno)
                    self._forget(enc, loc, mark_dead=True)
                results.append(loc is not None)
            if self._fsync != "never":
                try:
                    self._sync(touched)
                except OSError:
                    self._counters.add("delete_sync_failures")
            # A deleted key must not come back from a sealed segment's index after a crash.
            for segno in sorted(touched):
                seg = self._segments.get(segno)
                if seg is not None and seg is not self._active and not seg.indexed:
                    self._write_index(seg, durable=True)
            self._counters.add("deletes", sum(results))
            self._publish()
            return results

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._publish()
            return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._fsync != "never":
                with contextlib.suppress(OSError):
                    self._sync(set(self._segments))
            # Every segment is sealed now (a new instance never appends to one): index the ones
            # whose index is missing or out of date, so the next start reads indexes only.
            for segno in sorted(self._segments):
                seg = self._segments[segno]
                if not seg.indexed:
                    self._write_index(seg)
            self._release()

    def _release(self) -> None:
        for seg in self._segments.values():
            os.close(seg.fd)
        self._segments.clear()
        self._active = None
        os.close(self._lock_fd)  # releases the flock
