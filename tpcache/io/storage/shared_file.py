"""A file store that several deployments share: each writes its own owner directory, reads all.

Layout: ``<root>/<owner>/`` per writer (a ``FileBackend`` with that owner name: segments, indexes,
``LOCK``). An instance writes, evicts and compacts only its own directory, under its exclusive
lock; it reads its own records first and then, read-only, every other owner's: it lists their
segments, takes each sealed segment's index (``segment_index``) and scans the headers of a segment
without one (a writer's active segment, from where it last looked), and looks again whenever a key
it is asked for is not known. Another owner's record is served only after magic, header checksum,
key echo, length, payload checksum (and MAC, when a storage key is set) all match, read from the
segment file as it is now: a record the owner evicted (marked dead) or a segment it removed is a
miss, never stale bytes.

When several owners hold a record of one key, the reader's own copy is served first, then the other
owners' in name order; each is a verified copy of the same page.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpcache.io.storage.base import (
    MISS_CORRUPT,
    MISS_FOREIGN,
    MISS_IO_ERROR,
    MISS_MISSING,
    MISS_SHORT,
    MISS_UNAUTHENTICATED,
    StorageBackend,
    StorageCounters,
    check_keys,
    check_pairs,
)
from tpcache.io.storage.buffers import byte_view
from tpcache.io.storage.file import _INDEX_NAME, _SCAN_READ, _SEGMENT_NAME, DEFAULT_SEGMENT_BYTES, FileBackend
from tpcache.io.storage.keys import StorageKey
from tpcache.io.storage.record import (
    HEADER_SIZE,
    MAX_KEY_BYTES,
    RecordError,
    decode_header,
    payload_checksum,
    read_key_echo,
)
from tpcache.io.storage.segment_index import SegmentIndexError, decode_index


@dataclass(frozen=True)
class _Loc:
    path: Path
    offset: int
    record_len: int
    payload_len: int
    seq: int


@dataclass
class _Seen:
    """What this reader knows of another owner's segment."""

    ino: int
    size: int  # bytes looked at
    sealed: bool = False  # read from its index: it no longer grows
    keys: dict[bytes, _Loc] = field(default_factory=dict)


class SharedFileStore(StorageBackend):
    """Writes ``<root>/<owner>`` (a ``FileBackend``), reads every owner under ``root``. Serves any key
    (no shard check: the caller decides what it writes); see the module docstring."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        owner: str,
        *,
        capacity_bytes: int,
        fsync: Any = "batch",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> None:
        self._root = Path(root)
        self._owner = owner
        self._own = FileBackend(
            self._root, capacity_bytes=capacity_bytes, fsync=fsync, segment_bytes=segment_bytes, owner=owner
        )
        self._lock = threading.Lock()
        self._seen: dict[str, dict[int, _Seen]] = {}  # owner -> segno -> what was read of it
        self._where: dict[bytes, dict[str, _Loc]] = {}  # key -> owner -> its record there
        self._stamps: dict[str, int | None] = {}  # owner -> its directory's mtime when last listed
        self._names: dict[str, list[str]] = {}  # owner -> that listing
        self._looks = 0
        self._counters = StorageCounters(0)
        for name in ("peer_refreshes", "peer_records"):
            self._counters.set(name, 0)

    # ---- other owners' directories (caller holds the lock) -----------------------------------
    def _refresh(self) -> None:
        self._counters.add("peer_refreshes")
        try:
            owners = sorted(e.name for e in os.scandir(self._root) if e.is_dir() and e.name != self._owner)
        except OSError:
            owners = []
        for gone in set(self._seen) - set(owners):
            for segno in list(self._seen[gone]):
                self._drop(gone, segno)
            del self._seen[gone]
        for owner in owners:
            self._refresh_owner(owner)
        self._counters.set("peer_records", len(self._where))

    def _drop(self, owner: str, segno: int) -> None:
        seen = self._seen[owner].pop(segno)
        for enc in seen.keys:
            held = self._where.get(enc)
            if held is not None and held.get(owner) is seen.keys[enc]:
                del held[owner]
                if not held:
                    del self._where[enc]

    def _refresh_owner(self, owner: str) -> None:
        d = self._root / owner
        segs = self._seen.setdefault(owner, {})
        try:
            stamp = os.stat(d).st_mtime_ns
        except OSError:
            stamp = None
        self._looks += 1
        # The same directory stamp: no file came or went (a full listing every 64th look all the same,
        # should two changes share one stamp), and a segment read from its index no longer grows.
        same = stamp is not None and stamp == self._stamps.get(owner) and self._looks % 64
        if same:
            names = self._names[owner]
        else:
            try:
                names = os.listdir(d)
            except OSError:
                names = []
            self._stamps[owner], self._names[owner] = stamp, names
        segnos = {int(m[1]) for m in map(_SEGMENT_NAME.fullmatch, names) if m is not None}
        indexed = {int(m[1]) for m in map(_INDEX_NAME.fullmatch, names) if m is not None}
        for segno in set(segs) - segnos:
            self._drop(owner, segno)
        for segno in sorted(segnos):
            path = d / f"{segno:010d}.seg"
            seen = segs.get(segno)
            if same and seen is not None and seen.sealed:
                continue
            try:
                st = os.stat(path)
            except OSError:
                if segno in segs:
                    self._drop(owner, segno)
                continue
            if seen is not None and seen.ino == st.st_ino and seen.size == st.st_size:
                continue
            if seen is not None and (seen.ino != st.st_ino or st.st_size < seen.size):
                self._drop(owner, segno)
                seen = None
            found = self._from_index(owner, segno, path, st.st_size) if segno in indexed else None
            if found is not None and seen is not None:  # the index lists every live record: start over
                self._drop(owner, segno)
                seen = None
            if seen is None:
                seen = segs[segno] = _Seen(st.st_ino, 0)
            looked = st.st_size
            if found is None:  # up to a record not yet whole: the next look starts there
                found, looked = self._scan(path, seen.size, st.st_size)
            else:
                seen.sealed = True  # an index is written for a sealed segment only
            for enc, loc in found:
                old = seen.keys.get(enc)
                if old is None or loc.seq >= old.seq:  # newest record of a key in one owner wins
                    seen.keys[enc] = loc
                    self._where.setdefault(enc, {})[owner] = loc
            seen.size = looked

    def _from_index(self, owner: str, segno: int, path: Path, size: int) -> list[tuple[bytes, _Loc]] | None:
        try:
            data = (path.parent / f"{segno:010d}.idx").read_bytes()
            index = decode_index(data, owner, segno, size)
        except (OSError, SegmentIndexError):
            return None
        return [(e.key, _Loc(path, e.offset, e.record_len, e.payload_len, e.seq)) for e in index.entries()]

    def _scan(self, path: Path, start: int, size: int) -> tuple[list[tuple[bytes, _Loc]], int]:
        """The live records whole in ``[start, size)``, and the offset the scan stopped at (the
        first record not yet whole, torn or past ``size``): where the next look starts."""
        out: list[tuple[bytes, _Loc]] = []
        offset = start
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return out, offset
        try:
            while offset + HEADER_SIZE <= size:
                raw = os.pread(fd, _SCAN_READ, offset)
                key_len = int.from_bytes(raw[6:8], "little")
                if HEADER_SIZE + key_len > len(raw) and key_len <= MAX_KEY_BYTES:
                    raw = os.pread(fd, HEADER_SIZE + key_len, offset)
                try:
                    head = decode_header(raw, None)
                except RecordError:
                    break  # torn or being written: look again later
                if offset + head.record_len > size:
                    break
                if head.live:
                    loc = _Loc(path, offset, head.record_len, head.payload_len, head.seq)
                    out.append((read_key_echo(raw, head), loc))
                offset += head.record_len
        except OSError:
            pass
        finally:
            os.close(fd)
        return out, offset

    def _read_peer(self, enc: bytes, view: memoryview) -> str | None:
        """Serve ``enc`` from another owner into ``view``; None on a hit, else the miss reason."""
        reason = MISS_MISSING
        for owner, loc in sorted(self._where.get(enc, {}).items()):
            reason = self._read_at(enc, loc, view)
            if reason is None:
                return None
            view[:] = bytes(len(view))
            if reason in (MISS_IO_ERROR, MISS_SHORT):
                continue  # perhaps passing: the record stays known, the next get tries it again
            held = self._where[enc]
            del held[owner]
            if not held:
                del self._where[enc]
        return reason

    def _read_at(self, enc: bytes, loc: _Loc, view: memoryview) -> str | None:
        if loc.payload_len != len(view):
            return MISS_FOREIGN
        try:
            fd = os.open(loc.path, os.O_RDONLY)
        except FileNotFoundError:
            return MISS_MISSING  # the owner removed the segment
        except OSError:
            return MISS_IO_ERROR
        try:
            head = bytearray(loc.record_len - loc.payload_len)
            n = os.preadv(fd, [head, view], loc.offset)
        except OSError:
            return MISS_IO_ERROR
        finally:
            os.close(fd)
        if n < loc.record_len:
            return MISS_SHORT
        try:
            header = decode_header(head, enc)
        except RecordError as exc:
            return MISS_CORRUPT if exc.reason == "corrupt" else MISS_FOREIGN
        if not header.live:
            return MISS_MISSING  # evicted or deleted by its owner
        if header.record_len != loc.record_len:
            return MISS_FOREIGN
        if payload_checksum(view) != header.payload_xxh:
            return MISS_CORRUPT
        if self.record_mac is not None and not self.record_mac.verify(header, enc, view):
            return MISS_UNAUTHENTICATED
        return None

    # ---- StorageBackend ----------------------------------------------------------------------
    def authenticate(self, mac: Any) -> None:
        self._own.authenticate(mac)
        self.record_mac = mac

    def unusable(self) -> str | None:
        return self._own.unusable()

    def exists(self, keys: Sequence[StorageKey]) -> list[bool]:
        ks = check_keys(keys)
        found = self._own.exists(ks)
        with self._lock:
            encs = [k.encode().encode("ascii") for k in ks]
            if not all(f or e in self._where for f, e in zip(found, encs, strict=True)):
                self._refresh()
            return [f or e in self._where for f, e in zip(found, encs, strict=True)]

    def get(self, keys: Sequence[StorageKey], out: Sequence[Any]) -> list[bool]:
        ks = check_pairs(keys, out, "output buffers")
        results = [False] * len(ks)
        mine = [i for i, f in enumerate(self._own.exists(ks)) if f]
        if mine:
            got = self._own.get([ks[i] for i in mine], [out[i] for i in mine])
            for i, ok in zip(mine, got, strict=True):
                results[i] = ok
        rest = [i for i, ok in enumerate(results) if not ok]
        if not rest:
            return results
        with self._lock:
            encs = {i: ks[i].encode().encode("ascii") for i in rest}
            if any(e not in self._where for e in encs.values()):
                self._refresh()
            for i in rest:
                reason = self._read_peer(encs[i], byte_view(out[i], writable=True))
                results[i] = reason is None
                if i in mine:  # the own directory counted this get (a miss) already
                    continue
                self._counters.add("gets")
                if reason is None:
                    self._counters.add("hits")
                else:
                    self._counters.miss(reason)
        return results

    def put(self, keys: Sequence[StorageKey], pages: Sequence[Any]) -> list[bool]:
        return self._own.put(keys, pages)

    def delete(self, keys: Sequence[StorageKey]) -> list[bool]:
        return self._own.delete(keys)

    def stats(self) -> dict[str, int]:
        """The own directory's counters, with reads from other owners added (``gets``, ``hits``,
        ``misses``), ``peer_records`` (other owners' records known) and ``peer_refreshes``."""
        out = self._own.stats()
        for name, value in self._counters.snapshot().items():
            if name == "capacity_bytes" or name == "bytes_used":
                continue
            out[name] = out.get(name, 0) + value
        return out

    def close(self) -> None:
        self._own.close()
