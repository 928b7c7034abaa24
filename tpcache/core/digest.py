"""An incrementally maintained 62-bit digest of the cache state.

The digest is the sum (mod 2**62) of one mixed value per page record, so adding, removing or
changing a page costs O(1): subtract its old record, add its new one. The sum is independent of
the order records were added, which is what makes it equal on ranks that reach the same state by
the same operations. 62 bits keep ``x`` and ``-x`` inside int64 for the round vector.
"""

from __future__ import annotations

import struct
import sys
from array import array

import xxhash

from tpcache.core.backend import NATIVE as _native

DIGEST_BITS = 62
DIGEST_MASK = (1 << DIGEST_BITS) - 1
_RECORD = struct.Struct("<QqqqqqqQ")
_BIG_ENDIAN = sys.byteorder == "big"


def reference_mix(*fields: int) -> int:
    """A 62-bit mix of up to eight int64/uint64 fields (unused fields are zero; the first and the
    last are uint64). Bad fields raise ``bad_fields``'s error."""
    padded = list(fields) + [0] * (8 - len(fields))
    try:
        packed = _RECORD.pack(*padded)
    except struct.error:
        raise bad_fields(fields) from None
    return xxhash.xxh3_64_intdigest(packed) & DIGEST_MASK


def bad_fields(fields: tuple[int, ...]) -> Exception:
    """What ``mix`` raises for fields it cannot pack (both cores raise the same): TypeError for more
    than eight fields or one that is not an int, OverflowError for one out of its range."""
    if len(fields) > 8:
        return TypeError(f"mix takes at most 8 fields, not {len(fields)}")
    for i, v in enumerate(fields):
        if not isinstance(v, int):
            return TypeError(f"mix: field {i} is not an int")
        unsigned = i in (0, 7)
        if not (0 <= v < 1 << 64 if unsigned else -(1 << 63) <= v < 1 << 63):
            return OverflowError(f"mix: field {i} is out of range ({'uint64' if unsigned else 'int64'})")
    return TypeError(f"mix: fields it cannot pack: {fields!r}")


if _native is not None:  # the same value in C (_account.c), and the same errors
    mix = _native.mix
else:
    mix = reference_mix


def reference_mix_ids(ids: list[int]) -> int:
    """An order-sensitive 62-bit digest of a list of ids (completion queues, plans): XXH3 of the
    ids as little-endian int64."""
    packed = array("q", ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return xxhash.xxh3_64_intdigest(packed) & DIGEST_MASK


mix_ids = reference_mix_ids if _native is None else _native.mix_ids  # the same value in C (_round.c)


class Digest:
    """Running sum of record mixes."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def add(self, record: int) -> None:
        self.value = (self.value + record) & DIGEST_MASK

    def remove(self, record: int) -> None:
        self.value = (self.value - record) & DIGEST_MASK


def mix_text(text: str) -> int:
    """A 62-bit digest of a text (configurations, layouts)."""
    return xxhash.xxh3_64_intdigest(text.encode("utf-8")) & DIGEST_MASK
