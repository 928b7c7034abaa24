"""What a lease holds, as lists that keep their own digest.

A lease's record in the state digest covers every node it pins and every page it holds. Mixing
those lists whole would make each change to a lease cost the length of its path; instead each list
keeps ``total``, the sum (mod 2**62) of one term per entry, updated by the entry that changed, so a
request that adds two pages to a 140-page context re-records its lease in O(2). The sum does not
depend on the order of the entries: ranks that hold the same entries agree. Entries are ints: the
ids of the nodes a lease pins, or the pages it holds.

Invariant: ``total == recount()`` after every change; ``invariants.check`` recomputes it. Only the
methods below change a holding (anything else raises), so the sum cannot drift.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import xxhash

from tpcache.core.backend import NATIVE
from tpcache.core.digest import DIGEST_MASK

_NativeHolding = NATIVE.Holding if NATIVE is not None else None

_TERM = struct.Struct("<qqq")
_digest = xxhash.xxh3_64_intdigest

DEVICE_PINS = 1  # the kinds of holding
HOST_PINS = 2
PAGES = 3


class _Holding(list):
    """A list that keeps ``total`` equal to the sum of ``term`` over its entries (the reference;
    ``_node.Holding`` is the same in C, used where built)."""

    __slots__ = ("lease_id", "kind", "total")

    def __init__(self, lease_id: int, kind: int, items: Iterable[Any] = ()) -> None:
        super().__init__()
        self.lease_id = lease_id
        self.kind = kind
        self.total = 0
        if items:  # most holdings start empty (a lease's three)
            self.extend(items)

    def _terms(self, items: list[int]) -> int:
        try:
            return sum(term(self.lease_id, self.kind, item) for item in items)
        except struct.error:
            raise TypeError("a holding's entry is a node id or a page (an int)") from None

    # Each change computes its terms before it changes the list: one that raises changes nothing.

    def append(self, item: Any) -> None:
        terms = self._terms([item])
        super().append(item)
        self.total = (self.total + terms) & DIGEST_MASK

    def extend(self, items: Iterable[Any]) -> None:
        added = items if type(items) is list else list(items)
        if not added:  # a request extends each holding a few times, often with nothing
            return
        terms = self._terms(added)
        super().extend(added)
        self.total = (self.total + terms) & DIGEST_MASK

    def empty(self) -> None:
        """Drop every entry (the sum of none is 0)."""
        super().clear()
        self.total = 0

    def remove(self, item: Any) -> None:
        terms = self._terms([self[self.index(item)]])
        super().remove(item)
        self.total = (self.total - terms) & DIGEST_MASK

    def discard(self, items: Iterable[int]) -> None:
        """Drop every entry equal to one of ``items``, keeping the others in order (``remove`` of
        each, for entries that are distinct, in one pass)."""
        drop = items if isinstance(items, set | frozenset | dict) else set(items)
        gone = [item for item in self if item in drop]
        if gone:
            kept = [item for item in self if item not in drop]
            terms = self._terms(gone)
            super().__delitem__(slice(None))
            super().extend(kept)
            self.total = (self.total - terms) & DIGEST_MASK

    def truncate(self, length: int) -> None:
        """Drop every entry from position ``length`` on."""
        self.total = (self.total - self._terms(self[length:])) & DIGEST_MASK
        super().__delitem__(slice(length, None))

    def recount(self) -> int:
        """The total computed from scratch (the invariant's check)."""
        return self._terms(self) & DIGEST_MASK


def term(lease_id: int, kind: int, key: int) -> int:
    """One entry's share of a holding's total (``key``: a node id or a page): the same key under
    another kind or lease is another term."""
    return _digest(_TERM.pack(lease_id, kind, key)) & DIGEST_MASK


def _refuse(self: list, *args: Any, **kwargs: Any) -> None:
    name = type(self).__name__
    raise TypeError(f"{name} changes only through append/extend/empty/remove/discard/truncate")


class _Refusing:
    """list's other mutators, refused: only the methods of ``_Holding`` change a holding."""

    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = insert = pop = clear = sort = reverse = _refuse


_Base: Any = _NativeHolding if _NativeHolding is not None else _Holding


class NodeHolding(_Refusing, _Base):
    """Nodes a lease pins (one pin each)."""

    __slots__ = ()


class PageHolding(_Refusing, _Base):
    """Device pages a lease holds outside the tree."""

    __slots__ = ()


class ReferenceHolding(_Refusing, _Holding):
    """The pure-Python holding, whichever ``NodeHolding`` and ``PageHolding`` use (for the tests)."""

    __slots__ = ()
