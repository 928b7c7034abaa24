"""Storage keys: which rank's shard of which page, under which namespace and KV layout.

Invariants:
- ``encode()`` is a pure function of the fields, versioned (``v1/...``), and made only of
  ``[A-Za-z0-9._-]`` components joined by ``/``; no component is empty, ``.`` or ``..``, so an
  encoded key used as a relative path can never leave its directory.
- ``decode(encode(k)) == k`` and ``decode`` rejects every string ``encode`` cannot produce.
- Two keys that differ in any field (namespace, layout version, TP rank or size, page hash)
  encode differently, so ranks never read each other's shards and a layout change never reads
  old bytes as new ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEY_FORMAT = "v1"
MAX_NAMESPACE_BYTES = 100  # hex-encoded that is 202 chars, still under NAME_MAX (255)
MAX_LAYOUT_VERSION = (1 << 31) - 1
MAX_TP_SIZE = 1 << 16
MAX_PAGE_HASH = (1 << 64) - 1

# A namespace is kept readable when it is plainly safe; anything else is hex-encoded.
_SAFE_NAMESPACE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_ENCODED = re.compile(
    r"v1/(?:n_(?P<plain>[A-Za-z0-9_-][A-Za-z0-9._-]*)|x_(?P<hex>(?:[0-9a-f]{2})*))"
    r"/(?P<layout>0|[1-9][0-9]*)/(?P<rank>0|[1-9][0-9]*)of(?P<size>[1-9][0-9]*)/(?P<hash>[0-9a-f]{16})"
)


class StorageKeyError(ValueError):
    """A storage key field or encoded key is invalid (wrong type, out of range, unsafe)."""


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    # bool is an int subclass; a True rank is a caller bug, not rank 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise StorageKeyError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise StorageKeyError(f"{name}={value} is outside [{lo}, {hi}]")
    return value


def _encode_namespace(namespace: str) -> str:
    raw = namespace.encode("utf-8")
    if _SAFE_NAMESPACE.fullmatch(namespace) and ".." not in namespace:
        return "n_" + namespace
    return "x_" + raw.hex()


@dataclass(frozen=True)
class StorageKey:
    """One rank's shard of one page: the unit every storage backend stores and looks up."""

    namespace: str
    layout_version: int
    tp_rank: int
    tp_size: int
    page_hash: int

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str):
            raise StorageKeyError(f"namespace must be a str, got {type(self.namespace).__name__}")
        if "\x00" in self.namespace:
            raise StorageKeyError("namespace must not contain NUL")
        try:
            nbytes = len(self.namespace.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise StorageKeyError(f"namespace is not encodable as UTF-8: {exc}") from None
        if nbytes > MAX_NAMESPACE_BYTES:
            raise StorageKeyError(f"namespace is {nbytes} bytes, the limit is {MAX_NAMESPACE_BYTES}")
        _check_int("layout_version", self.layout_version, 0, MAX_LAYOUT_VERSION)
        _check_int("tp_size", self.tp_size, 1, MAX_TP_SIZE)
        _check_int("tp_rank", self.tp_rank, 0, self.tp_size - 1)
        _check_int("page_hash", self.page_hash, 0, MAX_PAGE_HASH)

    def encode(self) -> str:
        """The versioned, filesystem-safe form, e.g. ``v1/n_llama/3/0of4/00ab...``."""
        return (
            f"{KEY_FORMAT}/{_encode_namespace(self.namespace)}/{self.layout_version}"
            f"/{self.tp_rank}of{self.tp_size}/{self.page_hash:016x}"
        )

    @property
    def shard(self) -> tuple[int, int]:
        """``(tp_rank, tp_size)``: the shard this key belongs to."""
        return (self.tp_rank, self.tp_size)

    @classmethod
    def decode(cls, encoded: str) -> StorageKey:
        """Parse an ``encode()`` string; raises :class:`StorageKeyError` for anything else."""
        if not isinstance(encoded, str):
            raise StorageKeyError(f"encoded key must be a str, got {type(encoded).__name__}")
        m = _ENCODED.fullmatch(encoded)
        if m is None:
            raise StorageKeyError(f"not a valid encoded storage key: {encoded[:80]!r}")
        if m["plain"] is not None:
            namespace = m["plain"]
        else:
            try:
                namespace = bytes.fromhex(m["hex"]).decode("utf-8")
            except UnicodeDecodeError:
                raise StorageKeyError(f"namespace in {encoded[:80]!r} is not UTF-8") from None
        key = cls(namespace, int(m["layout"]), int(m["rank"]), int(m["size"]), int(m["hash"], 16))
        # Only the canonical spelling is accepted, so one key has exactly one encoded form.
        if key.encode() != encoded:
            raise StorageKeyError(f"non-canonical encoded storage key: {encoded[:80]!r}")
        return key
