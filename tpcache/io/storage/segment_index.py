"""A file segment's index: where its live records are, so a restart need not read every header.

``<segno:010d>.idx`` beside ``<segno:010d>.seg`` lists the segment's live records when it was
written: when the segment is sealed (the backend rolls to a new one, or closes), and again at close
or after a delete when records in it died since. Layout (little-endian)::

    magic        4s  b"TPI1"
    version      u16 INDEX_VERSION
    owner_len    u16 bytes of the owner directory name that follow the header
    segno        u64 the segment this index describes
    seg_size     u64 the segment's length in bytes when the index was written
    count        u64 entries that follow
    tail_offset  u64 offset of the segment's last record (live or dead)
    tail_head    56s that record's header past its magic (the header checksum covers it)
    owner        owner_len bytes
    entries      count x (offset u64, seq u64, payload_len u64, key_len u16), in offset order
    keys         the entries' keys, concatenated in entry order
    checksum     u64 xxh3_64 of every byte before it

(Fixed-size entries before the keys let a restart unpack them in one C loop.)

Invariants: an index is used only when its checksum, version, segment number, owner and length all
match and the tail record's header on disk still equals ``tail_head`` (one read per segment), which
ties the index to this incarnation of the segment file; anything else is ``IndexError`` and the
caller scans the segment instead. Sealed segments are never appended to, so a matching length means
the index saw every record. An index can only be stale in one way: a record it lists died later
(evicted, or found corrupt) or never became durable (a power loss before its sync), and the backend
stopped before rewriting it; the record's dead mark or checksums still fail it at its first get, so
a stale index costs a miss, never a wrong hit. The backend never leaves a durable live record out
of its segment's index, so using one never loses durable data.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import xxhash

from tpcache.io.storage.record import HEADER_SIZE, MAX_KEY_BYTES

MAGIC = b"TPI1"
INDEX_VERSION = 2  # 1: before the record header had its mac field
_HEAD = struct.Struct(f"<4sHHQQQQ{HEADER_SIZE - 4}s")
_ENTRY = struct.Struct("<QQQH")
_SUM = struct.Struct("<Q")
TAIL_BYTES = HEADER_SIZE - 4  # a record header past its magic


class SegmentIndexError(ValueError):
    """An index that cannot be used (missing pieces, corrupt, stale, another segment's)."""


@dataclass(frozen=True)
class IndexEntry:
    key: bytes
    offset: int
    seq: int
    payload_len: int
    record_len: int


@dataclass(frozen=True)
class SegmentIndex:
    segno: int
    seg_size: int
    tail_offset: int
    tail_head: bytes  # the tail record's header bytes [4:HEADER_SIZE]
    rows: list[tuple[int, int, int, int]]  # (offset, seq, payload_len, key_len) per entry
    keys: bytes  # the entries' keys, concatenated

    def entries(self) -> Iterator[IndexEntry]:
        keys, start = self.keys, 0
        for offset, seq, payload_len, key_len in self.rows:
            end = start + key_len
            yield IndexEntry(keys[start:end], offset, seq, payload_len, HEADER_SIZE + key_len + payload_len)
            start = end


def encode_index(
    owner: str, segno: int, seg_size: int, tail_offset: int, tail_head: bytes, entries: Iterable[IndexEntry]
) -> bytes:
    if len(tail_head) != TAIL_BYTES:
        raise ValueError(f"tail header must be {TAIL_BYTES} bytes, got {len(tail_head)}")
    owner_b = owner.encode("ascii")
    rows = []
    keys = []
    pack = _ENTRY.pack
    for e in entries:
        if e.record_len != HEADER_SIZE + len(e.key) + e.payload_len:
            raise ValueError(f"entry at {e.offset}: record length {e.record_len} does not match its key and payload")
        rows.append(pack(e.offset, e.seq, e.payload_len, len(e.key)))
        keys.append(e.key)
    head = _HEAD.pack(MAGIC, INDEX_VERSION, len(owner_b), segno, seg_size, len(rows), tail_offset, tail_head)
    body = b"".join([head, owner_b, *rows, *keys])
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_index(data: bytes, owner: str, segno: int, seg_size: int) -> SegmentIndex:
    """Parse and check an index read from disk against the segment it should describe."""
    if len(data) < _HEAD.size + _SUM.size:
        raise SegmentIndexError("index is truncated")
    body = memoryview(data)[: -_SUM.size]
    if xxhash.xxh3_64_intdigest(body) != _SUM.unpack_from(data, len(data) - _SUM.size)[0]:
        raise SegmentIndexError("index checksum mismatch")
    magic, version, owner_len, i_segno, i_size, count, tail_offset, tail_head = _HEAD.unpack_from(data)
    if magic != MAGIC or version != INDEX_VERSION:
        raise SegmentIndexError(f"not an index of this format (magic {magic!r}, version {version})")
    pos = _HEAD.size
    if bytes(body[pos : pos + owner_len]) != owner.encode("ascii"):
        raise SegmentIndexError("index belongs to another owner directory")
    if i_segno != segno or i_size != seg_size:
        raise SegmentIndexError(f"index describes segment {i_segno} of {i_size} bytes, found {segno} of {seg_size}")
    if seg_size and not 0 <= tail_offset <= seg_size - HEADER_SIZE:
        raise SegmentIndexError("index tail record lies outside the segment")
    pos += owner_len
    rows_end = pos + count * _ENTRY.size
    if rows_end > len(body):
        raise SegmentIndexError("index entries are truncated")
    rows = list(_ENTRY.iter_unpack(body[pos:rows_end]))
    key_lens = [row[3] for row in rows]
    if rows_end + sum(key_lens) != len(body):
        raise SegmentIndexError("index keys do not match its entries")
    # Entries are in offset order and must not overlap or leave the segment.
    ends = [offset + HEADER_SIZE + key_len + payload_len for offset, _, payload_len, key_len in rows]
    if rows and (
        max(key_lens) > MAX_KEY_BYTES
        or ends[-1] > seg_size
        or any(rows[i + 1][0] < ends[i] for i in range(len(rows) - 1))
    ):
        raise SegmentIndexError("index entries do not fit the segment")
    return SegmentIndex(i_segno, i_size, tail_offset, bytes(tail_head), rows, bytes(body[rows_end:]))
