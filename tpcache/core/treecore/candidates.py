"""Eviction candidates: policy keys, which nodes are candidates, and the heaps that order them.

A policy maps a node to a sort key, a non-negative int; the smallest key is evicted first. Keys use
only the logical clock (advanced by sequenced operations), counters, depth and the page hash, never
wall-clock time or object ids, so every rank orders candidates identically. A key packs its fields
64 bits each, most significant first (the first may be wider), so comparing keys compares the
fields in order, as a tuple would; every key ends in ``(-depth, hash)``: within equal stamps the
deepest page goes first, and ties are broken by hash. A heap entry is one int, ``key << 64 |
node_id`` (unique, and an int compares several times faster than a tuple in the heap's sifts).

Candidates are leaves of their tier that nothing uses. Every candidate has a live entry in its heap
(``invariants.check`` verifies it): the ledger offers a node whenever it or anything its candidacy
depends on changes. Entries of nodes that stopped being candidates, or whose key changed, are
skipped when popped.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from tpcache.core.backend import NATIVE
from tpcache.core.tiers import DeviceState, HostState
from tpcache.core.treecore.components import host_parts_idle

_VALID, _NONE, _HOST_VALID = DeviceState.VALID, DeviceState.NONE, HostState.VALID
_ID = (1 << 64) - 1  # an entry's low 64 bits: the node id
_DEPTH = (1 << 64) - 1  # a key's depth field, ``_DEPTH - depth``: deeper pages sort first

if TYPE_CHECKING:
    from tpcache.core.treecore.tree import Node, RadixTree

Entry = int  # key << 64 | node id


class EvictionPolicy(Protocol):
    name: str

    def key(self, node: Node) -> int: ...


class LRU:
    """Least recently used first. A page is used when a lease pins it (lock, load, insert) and when
    that lease lets it go, so a page a running request holds counts as used until it ends."""

    name = "lru"

    def key(self, node: Node) -> int:
        return node.last_access << 128 | (_DEPTH - node.depth) << 64 | node.hash


class LFU:
    """Fewest hits first, then least recently used."""

    name = "lfu"

    def key(self, node: Node) -> int:
        return node.hits << 192 | node.last_access << 128 | (_DEPTH - node.depth) << 64 | node.hash


class FIFO:
    """Oldest inserted first."""

    name = "fifo"

    def key(self, node: Node) -> int:
        return node.created_at << 128 | (_DEPTH - node.depth) << 64 | node.hash


POLICIES: dict[str, type[LRU] | type[LFU] | type[FIFO]] = {"lru": LRU, "lfu": LFU, "fifo": FIFO}
KEY_KINDS = {"lru": 0, "lfu": 1, "fifo": 2}  # how _candidates.c knows each policy's key


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None


def host_subtree_droppable(node: Node) -> bool:
    """The host-only pages below ``node`` can all go with it: valid, unpinned, not on device."""
    stack = [c for c in node.child_nodes() if c.host_state != HostState.NONE]
    while stack:
        child = stack.pop()
        if child.host_state != HostState.VALID or child.host_pins or child.device_state != DeviceState.NONE:
            return False
        if child.comp is not None and not host_parts_idle(child):
            return False  # a component copy of it is read (a storage write) or pinned
        stack.extend(c for c in child.child_nodes() if c.host_state != HostState.NONE)
    return True


def is_device_candidate(node: Node) -> bool:
    """A device leaf not in use. A page with no host copy whose children live only on host goes only
    if those host copies can go with it (they would hang from nothing)."""
    if node.device_state != DeviceState.VALID or node.device_pins or node.parent is None:
        return False
    host_children = False
    for child in node.child_nodes():
        if child.device_state != DeviceState.NONE:
            return False
        host_children = host_children or child.host_state != HostState.NONE
    return not host_children or node.host_state != HostState.NONE or host_subtree_droppable(node)


def is_host_candidate(node: Node) -> bool:
    """A host leaf not in use and not on device. A device page's host copy makes its device eviction
    free (write-through) or is the copy a write-back eviction waits for, so it is not evicted from
    host: it goes only when its device copy goes, or by an agreed mirror-release plan."""
    if node.host_state != HostState.VALID or node.host_pins or node.parent is None:
        return False
    if node.device_state != DeviceState.NONE:
        return False
    if node.comp is not None and not host_parts_idle(node):
        return False  # a component copy on host is being written or read
    return not any(c.host_state != HostState.NONE for c in node.child_nodes())


_native = NATIVE


class Candidates:
    """The device and host candidate heaps of one tree."""

    def __init__(self, policy: str, tree: RadixTree) -> None:
        self.policy = make_policy(policy)
        self.tree = tree
        self.key_kind = KEY_KINDS[self.policy.name]  # how _candidates.c builds each policy's key
        self.device_heap: list[Entry] = []
        self.host_heap: list[Entry] = []
        if _native is not None:  # the same offers and pops in C (_candidates.c), on heaps it holds
            # The C kernels are handed ``native``, never this object: the heaps are its lists (changed
            # in place, also by ``rebuild``), the tree's nodes its dict, the key kind its int.
            self.native = _native.Heaps(tree.nodes, self.key_kind)
            self.device_heap, self.host_heap = self.native.device, self.native.host
            self.offer = functools.partial(_native.offer, self.native)  # type: ignore[method-assign]
            self.offer_around = functools.partial(_native.offer_around, self.native)  # type: ignore[method-assign]

    def offer(self, node: Node) -> None:
        """Push ``node`` on the heap of each tier it is a candidate of (older entries of it go stale).
        The heaps are rebuilt when stale entries outnumber the nodes; a rebuild never changes which
        node a pop returns (it keeps one entry per candidate, the current one). With native nodes
        an instance attribute replaces this with the same test in C (``_candidates.c``)."""
        state = node.device_state
        device = state == _VALID and not node.device_pins and is_device_candidate(node)
        host = state == _NONE and node.host_state == _HOST_VALID and not node.host_pins and is_host_candidate(node)
        if device or host:
            self._push(node, device | host << 1)
        # else: pinned, not readable on either tier, or not a leaf of it: most offers

    def _push(self, node: Node, which: int) -> None:
        """Push ``node`` on the device heap (``which & 1``) and the host heap (``which & 2``)."""
        if len(self.device_heap) + len(self.host_heap) > 4 * len(self.tree.nodes) + 64:
            self.rebuild()
        if which & 1:
            heapq.heappush(self.device_heap, self.policy.key(node) << 64 | node.node_id)
        if which & 2:
            heapq.heappush(self.host_heap, self.policy.key(node) << 64 | node.node_id)

    def offer_around(self, node: Node) -> None:
        """Offer ``node`` and every node whose candidacy its change can decide: its parent (a child's
        tiers decide it) and, above a chain of host-only pages, the device page they hang from (its
        candidacy depends on that whole host-only subtree)."""
        self.offer(node)
        parent = node.parent
        if parent is None or parent.parent is None:
            return
        self.offer(parent)
        while parent.device_state == DeviceState.NONE and parent.host_state != HostState.NONE:
            parent = parent.parent
            if parent is None or parent.parent is None:
                return
        if parent is not node.parent and parent.device_state == DeviceState.VALID:
            self.offer(parent)

    def rebuild(self) -> None:
        """Drop stale entries. Iterates nodes in insertion order, so every rank rebuilds alike."""
        if _native is not None:  # the same, in C, on the lists the C kernels hold (changed in place)
            _native.rebuild(self.native)
            return
        nodes = list(self.tree.nodes.values())
        key = self.policy.key
        self.device_heap = [key(n) << 64 | n.node_id for n in nodes if is_device_candidate(n)]
        self.host_heap = [key(n) << 64 | n.node_id for n in nodes if is_host_candidate(n)]
        heapq.heapify(self.device_heap)
        heapq.heapify(self.host_heap)

    def pop_device(self) -> Node | None:
        """The device candidate that goes first, off its heap (None: there is none)."""
        if _native is not None:
            return _native.pop(self.native, 1)  # the same loop in C
        return self._pop(self.device_heap, is_device_candidate)

    def pop_host(self) -> Node | None:
        if _native is not None:
            return _native.pop(self.native, 2)
        return self._pop(self.host_heap, is_host_candidate)

    def live(self, entry: Entry, is_candidate: Callable[[Node], bool]) -> Node | None:
        """The node of a heap entry if the entry is current (a candidate with that key), else None."""
        node = self.tree.nodes.get(entry & _ID)
        if node is not None and is_candidate(node) and self.policy.key(node) == entry >> 64:
            return node
        return None

    def _pop(self, heap: list[Entry], is_candidate: Callable[[Node], bool]) -> Node | None:
        while heap:
            node = self.live(heapq.heappop(heap), is_candidate)
            if node is not None:
                return node
        return None
