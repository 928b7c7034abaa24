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
    """A 62-bit mix of up to eight int64/uint64 fields (unused fields are zero)."""
    padded = list(fields) + [0] * (8 - len(fields))
    return xxhash.xxh3_64_intdigest(_RECORD.pack(*padded)) & DIGEST_MASK


if _native is not None:  # the same value in C (_account.c); it calls the reference for fields it does not take
    _native.set_mix_fallback(reference_mix)
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
