"""The change feed: which pages became readable or stopped being readable on each tier.

A page is *on* a tier when its copy there is readable: device ``VALID``, host ``VALID``, storage
``DURABLE``, in a node that is in the tree. The ledger (the one mutator of node state) tells the feed
about every node before it changes one (``before``) and about every node it creates (``fresh``),
also around its C kernels: the nodes a settle will change before the call, the nodes a chain kernel
made after it, and the leaves the eviction kernel dropped (it lists them for the ledger). The
feed keeps, per node first seen since the last ``drain``, the tiers it was on then; ``drain``
compares them with the tiers it is on now and returns the difference as a ``Changes``.

So a drain holds the net change since the one before: a page stored and removed between two drains
is in neither list. Applying each drain's ``removed`` then its ``stored`` to a set of
(page hash, tier) gives the cache's pages on each tier (``on_tiers``), which the tests check after
every round. ``cleared`` says the cache dropped everything (an agreed flush) before ``stored``.

Nothing here decides cache state and the feed adds nothing to the digest: the order of a drain's
lists is the order the nodes were first changed in, the same on every rank. A cache without a feed
(the default) pays one ``is None`` test per change.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.treecore.tree import Node

DEVICE, HOST, STORAGE = 0, 1, 2
TIER_NAMES = ("device", "host", "storage")

_DEV_VALID, _HOST_VALID, _DURABLE = DeviceState.VALID, HostState.VALID, StorageState.DURABLE


def tier_bits(node: Node) -> int:
    """The tiers ``node`` is on, a bit per tier (1 << DEVICE, ...): 0 for a node out of the tree."""
    if node.parent is None:
        return 0
    return (
        (node.device_state == _DEV_VALID)
        | (node.host_state == _HOST_VALID) << HOST
        | (node.storage_state == _DURABLE) << STORAGE
    )


@dataclass
class Changes:
    """One drain: per tier, the page hashes that left it and those that reached it, in the order
    the nodes first changed. Apply ``cleared``, then ``removed``, then ``stored``."""

    cleared: bool = False
    removed: tuple[list[int], list[int], list[int]] = field(default_factory=lambda: ([], [], []))
    stored: tuple[list[int], list[int], list[int]] = field(default_factory=lambda: ([], [], []))

    def __bool__(self) -> bool:
        return self.cleared or any(self.removed) or any(self.stored)

    def count(self) -> int:
        return sum(map(len, self.removed)) + sum(map(len, self.stored))


NO_CHANGES = Changes()  # what an empty drain returns (shared: read it, never change it)


class ChangeFeed:
    """What changed on each tier since the last ``drain`` (see the module docstring)."""

    __slots__ = ("_seen", "_cleared")

    def __init__(self) -> None:
        # node -> the tiers it was on when first seen (identity keys: the dict's order is the order
        # the nodes first changed, never their ids)
        self._seen: dict[Node, int] = {}
        self._cleared = False

    def before(self, node: Node) -> None:
        """``node`` is about to change: keep the tiers it is on now, unless already kept."""
        seen = self._seen
        if node not in seen:  # ``tier_bits``, inlined: this runs per change
            seen[node] = (
                0
                if node.parent is None
                else (node.device_state == _DEV_VALID)
                | (node.host_state == _HOST_VALID) << 1
                | (node.storage_state == _DURABLE) << 2
            )

    def before_all(self, nodes: Iterable[Node]) -> None:
        seen = self._seen
        for node in nodes:
            if node not in seen:
                seen[node] = tier_bits(node)

    def fresh(self, nodes: Iterable[Node]) -> None:
        """New nodes (on no tier before this drain), whatever they hold by now."""
        seen = self._seen
        for node in nodes:
            if node not in seen:
                seen[node] = 0

    def dropped_device_leaves(self, nodes: Iterable[Node]) -> None:
        """Plain device leaves already taken out of the tree by a kernel: they were on device and,
        unchanged, on storage if durable there."""
        seen = self._seen
        for node in nodes:
            if node not in seen:
                seen[node] = 1 | (node.storage_state == _DURABLE) << STORAGE

    def clear(self) -> ChangeFeed:
        """The cache dropped every node (an agreed flush): nothing before it matters any more."""
        self._seen = {}
        self._cleared = True
        return self

    def drain(self) -> Changes:
        if not self._seen and not self._cleared:
            return NO_CHANGES
        out = Changes(cleared=self._cleared)
        removed, stored = out.removed, out.stored
        for node, was in self._seen.items():
            if node.parent is None:  # ``tier_bits``, inlined: this loop runs per changed page
                now = 0
            else:
                now = (
                    (node.device_state == _DEV_VALID)
                    | (node.host_state == _HOST_VALID) << 1
                    | (node.storage_state == _DURABLE) << 2
                )
            if now == was:
                continue
            h = node.hash
            gone, new = was & ~now, now & ~was
            if gone & 1:
                removed[0].append(h)
            if gone & 2:
                removed[1].append(h)
            if gone & 4:
                removed[2].append(h)
            if new & 1:
                stored[0].append(h)
            if new & 2:
                stored[1].append(h)
            if new & 4:
                stored[2].append(h)
        self._seen = {}
        self._cleared = False
        return out


def on_tiers(nodes: Iterable[Node]) -> tuple[set[int], set[int], set[int]]:
    """Per tier, the hashes of the pages on it among ``nodes`` (a tree's nodes): what a feed's
    drains add up to."""
    out: tuple[set[int], set[int], set[int]] = (set(), set(), set())
    for node in nodes:
        bits = tier_bits(node)
        for tier in range(3):
            if bits >> tier & 1:
                out[tier].add(node.hash)
    return out


def apply_changes(mirror: tuple[set[int], set[int], set[int]], changes: Changes) -> None:
    """Bring ``mirror`` (per tier, a set of page hashes) from the state before ``changes`` to after."""
    if changes.cleared:
        for tier in mirror:
            tier.clear()
    for tier, hashes in zip(mirror, changes.removed, strict=True):
        tier.difference_update(hashes)
    for tier, hashes in zip(mirror, changes.stored, strict=True):
        tier.update(hashes)
