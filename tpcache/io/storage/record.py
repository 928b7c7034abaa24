"""The stored record: fixed header, key echo, payload (a file segment's entry, a store's value).

Layout (little-endian)::

    magic        4s  b"TPC1" live, b"TPCX" dead (evicted/deleted, flipped in place)
    version      u16 RECORD_VERSION
    key_len      u16 bytes of the encoded key that follow the header
    flags        u32 FLAG_MAC when ``mac`` holds a MAC; other bits reserved, 0
    seq          u64 per-directory-owner write sequence (newest record of a key wins); 0 in
                     key-value stores, which keep one value per key
    payload_len  u64
    payload_xxh  u64 xxh3_64 of the payload
    header_xxh   u64 xxh3_64 of header[4:36] + mac + key bytes
    mac          16s keyed BLAKE2b (``RecordMac``) over payload_len, the key echo and the payload,
                     under the deployment's storage key; zeros when written without a key

Invariants: the header checksum covers every field but the magic, so a dead mark is a single
aligned 4-byte write that leaves the record skippable; a record is trusted only when magic,
version, header checksum, key echo and payload checksum all match, and, when the reader holds a
storage key, its MAC verifies under that key.

Trust: the checksums catch accidents (a torn write, a flipped bit, another key's value), never a
writer who means it: anyone who can write the store can write a record whose checksums match. The
MAC is what a writer without the storage key cannot forge; the key echo it covers names the
namespace, layout version, shard and page hash, so a genuine record copied under another key fails
it too. A reader with a key serves only records with a valid MAC (a record written without one is a
miss); a reader without a key ignores the MAC and checks the checksums alone.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

import xxhash

MAGIC_LIVE = b"TPC1"
MAGIC_DEAD = b"TPCX"
RECORD_VERSION = 2  # 1: no mac field (a version-1 record is a miss, reason foreign)
MAC_SIZE = 16
FLAG_MAC = 1
HEADER = struct.Struct(f"<4sHHIQQQQ{MAC_SIZE}s")
HEADER_SIZE = HEADER.size  # 60
_CHECKED = slice(4, 36)  # version .. payload_xxh
_CHECKED_FIELDS = struct.Struct("<HHIQQQ")  # the fields _CHECKED covers
_MAC = slice(44, HEADER_SIZE)
_NO_MAC = bytes(MAC_SIZE)
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 1024
COPY_BLOCK = 64 << 10  # fits a core's L2 cache with room to spare


class RecordError(ValueError):
    """A header that is not a valid record header (reason in ``.reason``: corrupt or foreign)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RecordHeader:
    live: bool
    key_len: int
    seq: int
    payload_len: int
    payload_xxh: int
    mac: bytes = b""  # empty: written without a storage key

    @property
    def record_len(self) -> int:
        return HEADER_SIZE + self.key_len + self.payload_len


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def copy_checksum(dst: memoryview, src: memoryview | bytes) -> int:
    """Copy ``src`` into ``dst`` (same length) and return the payload checksum of the bytes now in
    ``dst``. Each block is hashed right after it is copied, while it is still in the CPU's cache,
    so the page is read from memory once, not twice. The checksum covers what ``dst`` holds, never
    what ``src`` held: a write into ``src`` during the copy fails the check."""
    n = len(dst)
    if n <= COPY_BLOCK:
        dst[:] = src
        return xxhash.xxh3_64_intdigest(dst)
    src = memoryview(src)
    h = xxhash.xxh3_64()
    for off in range(0, n, COPY_BLOCK):
        block = dst[off : off + COPY_BLOCK]
        block[:] = src[off : off + COPY_BLOCK]
        h.update(block)
    return h.intdigest()


class RecordMac:
    """The deployment's storage key: signs records and checks their MAC (keyed BLAKE2b, 128 bits).

    Every instance that shares a store must hold the same key. The key itself never appears in a
    log, an error or a ``repr``."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes) or len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"a storage key must be at least {MIN_KEY_BYTES} bytes")
        # Any length of secret becomes one BLAKE2b key (at most 64 bytes) of its own purpose.
        self._key = hashlib.blake2b(secret, digest_size=32, person=b"tpcache-storekey").digest()

    def __repr__(self) -> str:
        return "RecordMac(***)"

    def sign(self, key: bytes, payload: memoryview | bytes) -> bytes:
        """The MAC of ``payload`` stored under the key echo ``key``."""
        h = hashlib.blake2b(key=self._key, digest_size=MAC_SIZE, person=b"tpcache-record2")
        h.update(struct.pack("<QH", len(payload), len(key)))
        h.update(key)
        h.update(payload)
        return h.digest()

    def verify(self, header: RecordHeader, key: bytes, payload: memoryview | bytes) -> bool:
        """Whether ``header`` carries a MAC and it is this key's MAC of ``payload`` under ``key``."""
        return self.verify_mac(header.mac, key, payload)

    def verify_mac(self, mac: bytes, key: bytes, payload: memoryview | bytes) -> bool:
        """Whether ``mac`` (a header's, empty when it has none) is this key's MAC of ``payload``."""
        return bool(mac) and hmac.compare_digest(mac, self.sign(key, payload))


def encode_header(key: bytes, seq: int, payload_len: int, payload_xxh: int, *, mac: bytes = b"") -> bytes:
    """Header bytes followed by the key echo; ``mac`` (``RecordMac.sign``) or none."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"encoded key is {len(key)} bytes, the limit is {MAX_KEY_BYTES}")
    if mac and len(mac) != MAC_SIZE:
        raise ValueError(f"a record MAC is {MAC_SIZE} bytes, got {len(mac)}")
    field = mac or _NO_MAC
    checked = _CHECKED_FIELDS.pack(RECORD_VERSION, len(key), FLAG_MAC if mac else 0, seq, payload_len, payload_xxh)
    hxh = xxhash.xxh3_64_intdigest(b"".join((checked, field, key)))
    return b"".join((MAGIC_LIVE, checked, hxh.to_bytes(8, "little"), field, key))


def decode_header(raw: bytes | memoryview, key: bytes | None) -> RecordHeader:
    """Parse and check ``raw`` = header + key echo bytes (at least ``HEADER_SIZE``).

    ``key`` is the expected key echo, or None to accept any (index rebuild). Raises
    :class:`RecordError` with reason ``corrupt`` or ``foreign``; ``short`` is the caller's to
    detect (it knows the file length).
    """
    raw = bytes(raw)
    if len(raw) < HEADER_SIZE:
        raise RecordError("short", "record header is truncated")
    magic = raw[:4]
    if magic not in (MAGIC_LIVE, MAGIC_DEAD):
        raise RecordError("corrupt", f"bad record magic {magic!r}")
    version = int.from_bytes(raw[4:6], "little")
    if version != RECORD_VERSION:
        raise RecordError("foreign", f"record format version {version}, expected {RECORD_VERSION}")
    _, _, key_len, flags, seq, payload_len, payload_xxh, header_xxh, mac = HEADER.unpack_from(raw)
    if key_len > MAX_KEY_BYTES:
        raise RecordError("corrupt", f"record key length {key_len} exceeds {MAX_KEY_BYTES}")
    if len(raw) < HEADER_SIZE + key_len:
        raise RecordError("short", "record key echo is truncated")
    echo = raw[HEADER_SIZE : HEADER_SIZE + key_len]
    if xxhash.xxh3_64_intdigest(raw[_CHECKED] + raw[_MAC] + echo) != header_xxh:
        raise RecordError("corrupt", "record header checksum mismatch")
    if key is not None and echo != key:
        raise RecordError("foreign", "record belongs to another key")
    return RecordHeader(magic == MAGIC_LIVE, key_len, seq, payload_len, payload_xxh, mac if flags & FLAG_MAC else b"")


def read_key_echo(raw: bytes | memoryview, header: RecordHeader) -> bytes:
    return bytes(raw[HEADER_SIZE : HEADER_SIZE + header.key_len])


def check_value(
    value: bytes | memoryview, key: bytes, payload_len: int, *, value_len: int | None = None
) -> tuple[int, bytes]:
    """``parse_value``'s checks, returning the header's ``(payload_xxh, mac)`` (``mac`` empty when
    written without a key). The common case (a live record of this key and page size, its header
    checksum matching) is decided in a few calls, as a store's reader does it once per record;
    anything else takes ``parse_value``'s path for its reason."""
    n = len(value) if value_len is None else value_len
    end = HEADER_SIZE + len(key)
    if len(value) >= end and n == end + payload_len:
        magic, version, key_len, flags, _, plen, pxh, hxh, mac = HEADER.unpack_from(value)
        if (
            magic == MAGIC_LIVE
            and version == RECORD_VERSION
            and key_len == len(key)
            and plen == payload_len
            and value[HEADER_SIZE:end] == key
            and xxhash.xxh3_64_intdigest(b"".join((value[_CHECKED], value[_MAC.start : end]))) == hxh
        ):
            return pxh, mac if flags & FLAG_MAC else b""
    head = parse_value(value, key, payload_len, value_len=value_len)
    return head.payload_xxh, head.mac


def parse_value(
    value: bytes | memoryview, key: bytes, payload_len: int, *, value_len: int | None = None
) -> RecordHeader:
    """The header of a whole stored value (header, key echo, payload) that is this key's page.

    ``value_len``: the whole value's length when ``value`` holds only its header and key echo (the
    payload was read elsewhere); by default ``len(value)``.

    Raises :class:`RecordError` with the miss reason (``short``, ``corrupt`` or ``foreign``: another
    key, layout, rank or page size, a dead or other-format record). Checks everything but the
    payload checksum, which the caller computes over the bytes it keeps (after copying them out of
    a transfer buffer that a late transfer could still write).
    """
    n = len(value) if value_len is None else value_len
    if n < HEADER_SIZE or len(value) < HEADER_SIZE:
        raise RecordError("short", "value is shorter than a record header")
    key_len = int.from_bytes(value[6:8], "little")
    head = decode_header(value[: HEADER_SIZE + min(key_len, MAX_KEY_BYTES)], key)
    if not head.live:
        raise RecordError("foreign", "value is a dead record")
    if head.payload_len != payload_len:
        raise RecordError("foreign", f"value holds a {head.payload_len}-byte page, expected {payload_len}")
    if n != head.record_len:
        reason = "short" if n < head.record_len else "corrupt"
        raise RecordError(reason, f"value is {n} bytes, its header says {head.record_len}")
    return head
