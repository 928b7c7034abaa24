"""What a lease holds, as lists that keep their own digest.

A lease's record in the state digest covers every node it pins and every page it holds. Mixing
those lists whole would make each change to a lease cost the length of its path; instead each list
keeps ``total``, the sum (mod 2**62) of one term per entry, updated by the entry that changed, so a
request that adds two pages to a 140-page context re-records its lease in O(2). The sum does not
depend on the order of the entries: ranks that hold the same entries agree.

Invariant: ``total == recount()`` after every change; ``invariants.check`` recomputes it. Only the
methods below change a holding (anything else raises), so the sum cannot drift.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Container, Iterable
from typing import TYPE_CHECKING, Any

import xxhash

from tpcache.core.digest import DIGEST_MASK
from tpcache.core.tree import NATIVE_NODES

if NATIVE_NODES:
    from tpcache.core._node import terms as _native_terms
else:
    _native_terms = None

if TYPE_CHECKING:
    from tpcache.core.tree import Node

_TERM = struct.Struct("<qqq")
_digest = xxhash.xxh3_64_intdigest

DEVICE_PINS = 1  # the kinds of holding
HOST_PINS = 2
PAGES = 3


class _Holding(list):
    """A list that keeps ``total`` equal to the sum of ``term`` over its entries."""

    __slots__ = ("lease_id", "kind", "total")

    def __init__(self, lease_id: int, kind: int, items: Iterable[Any] = ()) -> None:
        super().__init__()
        self.lease_id = lease_id
        self.kind = kind
        self.total = 0
        if items:  # most holdings start empty (a lease's three)
            self.extend(items)

    def _key(self, item: Any) -> int:
        raise NotImplementedError

    def _term(self, item: Any) -> int:
        """One entry's share of the total: the same id under another kind or lease is another term."""
        return _digest(_TERM.pack(self.lease_id, self.kind, self._key(item))) & DIGEST_MASK

    def _terms(self, items: list[Any]) -> int:
        """The sum of ``_term`` over ``items`` (in C where built: ``_account.c``, the same terms)."""
        if _native_terms is not None:
            return _native_terms(self.lease_id, self.kind, items)
        return sum(self._term(item) for item in items)

    def append(self, item: Any) -> None:
        super().append(item)
        self.total = (self.total + self._terms([item])) & DIGEST_MASK

    def extend(self, items: Iterable[Any]) -> None:
        added = items if type(items) is list else list(items)
        if not added:  # a request extends each holding a few times, often with nothing
            return
        super().extend(added)
        terms = _native_terms(self.lease_id, self.kind, added) if _native_terms is not None else self._terms(added)
        self.total = (self.total + terms) & DIGEST_MASK

    def empty(self) -> None:
        """Drop every entry (the sum of none is 0)."""
        super().clear()
        self.total = 0

    def remove(self, item: Any) -> None:
        super().remove(item)
        self.total = (self.total - self._terms([item])) & DIGEST_MASK

    def discard(self, items: Container[Any]) -> None:
        """Drop every entry that is in ``items``, keeping the others in order (``remove`` of each,
        for entries that are distinct, in one pass)."""
        gone = [item for item in self if item in items]
        if gone:
            kept = [item for item in self if item not in items]
            super().__delitem__(slice(None))
            super().extend(kept)
            self.total = (self.total - self._terms(gone)) & DIGEST_MASK

    def truncate(self, length: int) -> None:
        """Drop every entry from position ``length`` on."""
        self.total = (self.total - self._terms(self[length:])) & DIGEST_MASK
        super().__delitem__(slice(length, None))

    def retain(self, keep: Callable[[Any], bool]) -> None:
        """Keep only the entries ``keep`` accepts, in order."""
        kept = [item for item in self if keep(item)]
        super().clear()
        self.total = 0
        self.extend(kept)

    def recount(self) -> int:
        """The total computed from scratch (the invariant's check)."""
        return sum(self._term(item) for item in self) & DIGEST_MASK

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        raise TypeError(f"{name} changes only through append/extend/empty/remove/discard/truncate/retain")

    __setitem__ = __delitem__ = __iadd__ = insert = pop = clear = sort = reverse = _refuse  # type: ignore[assignment]


class NodeHolding(_Holding):
    """Nodes a lease pins (one pin each), keyed by node id."""

    __slots__ = ()

    def _key(self, item: Node) -> int:
        return item.node_id


class PageHolding(_Holding):
    """Device pages a lease holds outside the tree."""

    __slots__ = ()

    def _key(self, item: int) -> int:
        return item
