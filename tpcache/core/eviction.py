"""Eviction: policy keys, the candidates and their heaps, and the loops that free pages.

A policy maps a node to a sort key; the smallest key is evicted first. Keys use only the logical
clock (advanced by sequenced operations), counters, depth and the page hash, never wall-clock time
or object ids, so every rank orders candidates identically. Every key ends in ``(-depth, hash)``:
within equal stamps the deepest page goes first, and ties are broken by hash; node ids make a heap
entry unique.

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

from tpcache.core.allocator import OutOfPages
from tpcache.core.components import host_parts_idle
from tpcache.core.tiers import DeviceState, HostState
from tpcache.core.tree import NATIVE_NODES

_VALID, _NONE, _HOST_VALID = DeviceState.VALID, DeviceState.NONE, HostState.VALID

if TYPE_CHECKING:
    from tpcache.core.ledger import Ledger
    from tpcache.core.tree import Node, RadixTree

Entry = tuple[tuple[int, ...], int]


class EvictionPolicy(Protocol):
    name: str

    def key(self, node: Node) -> tuple[int, ...]: ...


class LRU:
    """Least recently used first. A page is used when a lease pins it (lock, load, insert) and when
    that lease lets it go, so a page a running request holds counts as used until it ends."""

    name = "lru"

    def key(self, node: Node) -> tuple[int, ...]:
        return (node.last_access, -node.depth, node.hash)


class LFU:
    """Fewest hits first, then least recently used."""

    name = "lfu"

    def key(self, node: Node) -> tuple[int, ...]:
        return (node.hits, node.last_access, -node.depth, node.hash)


class FIFO:
    """Oldest inserted first."""

    name = "fifo"

    def key(self, node: Node) -> tuple[int, ...]:
        return (node.created_at, -node.depth, node.hash)


POLICIES: dict[str, type[LRU] | type[LFU] | type[FIFO]] = {"lru": LRU, "lfu": LFU, "fifo": FIFO}
KEY_KINDS = {"lru": 0, "lfu": 1, "fifo": 2}  # how _account.c knows each policy's key


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None


def host_subtree_droppable(node: Node) -> bool:
    """The host-only pages below ``node`` can all go with it: valid, unpinned, not on device."""
    stack = [c for c in node.children.values() if c.host_state != HostState.NONE]
    while stack:
        child = stack.pop()
        if child.host_state != HostState.VALID or child.host_pins or child.device_state != DeviceState.NONE:
            return False
        if child.comp is not None and not host_parts_idle(child):
            return False  # a component copy of it is read (a storage write) or pinned
        stack.extend(c for c in child.children.values() if c.host_state != HostState.NONE)
    return True


def is_device_candidate(node: Node) -> bool:
    """A device leaf not in use. A page with no host copy whose children live only on host goes only
    if those host copies can go with it (they would hang from nothing)."""
    if node.device_state != DeviceState.VALID or node.device_pins or node.parent is None:
        return False
    host_children = False
    for child in node.children.values():
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
    return not any(c.host_state != HostState.NONE for c in node.children.values())


if NATIVE_NODES:  # the candidacy test in C; it calls these for the cases it leaves to them
    from tpcache.core import _node as _native

    _native.set_candidacy(is_device_candidate, is_host_candidate, host_subtree_droppable)
else:
    _native = None  # type: ignore[assignment]


class Candidates:
    """The device and host candidate heaps of one tree."""

    def __init__(self, policy: str, tree: RadixTree) -> None:
        self.policy = make_policy(policy)
        self.tree = tree
        self.device_heap: list[Entry] = []
        self.host_heap: list[Entry] = []
        self.key_kind = KEY_KINDS.get(self.policy.name, -1)  # the policies the C kernels build keys for
        if _native is not None:  # the same offers and pops in C (_account.c)
            self.offer = functools.partial(_native.offer, self)  # type: ignore[method-assign]
            self.offer_around = functools.partial(_native.offer_around, self)  # type: ignore[method-assign]

    def offer(self, node: Node) -> None:
        """Push ``node`` on the heap of each tier it is a candidate of (older entries of it go stale).
        The heaps are rebuilt when stale entries outnumber the nodes; a rebuild never changes which
        node a pop returns (it keeps one entry per candidate, the current one). With native nodes
        an instance attribute replaces this with the same test in C (``_account.c``)."""
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
            heapq.heappush(self.device_heap, (self.policy.key(node), node.node_id))
        if which & 2:
            heapq.heappush(self.host_heap, (self.policy.key(node), node.node_id))

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
        nodes = list(self.tree.nodes.values())
        key = self.policy.key
        self.device_heap = [(key(n), n.node_id) for n in nodes if is_device_candidate(n)]
        self.host_heap = [(key(n), n.node_id) for n in nodes if is_host_candidate(n)]
        heapq.heapify(self.device_heap)
        heapq.heapify(self.host_heap)

    def pop_device(self) -> Node | None:
        """The device candidate that goes first, off its heap (None: there is none)."""
        if _native is not None and self.key_kind >= 0:
            return _native.pop(self, self.device_heap, 1)  # the same loop in C
        return self._pop(self.device_heap, is_device_candidate)

    def pop_host(self) -> Node | None:
        if _native is not None and self.key_kind >= 0:
            return _native.pop(self, self.host_heap, 2)
        return self._pop(self.host_heap, is_host_candidate)

    def live(self, entry: Entry, is_candidate: Callable[[Node], bool]) -> Node | None:
        """The node of a heap entry if the entry is current (a candidate with that key), else None."""
        node = self.tree.nodes.get(entry[1])
        if node is not None and is_candidate(node) and self.policy.key(node) == entry[0]:
            return node
        return None

    def _pop(self, heap: list[Entry], is_candidate: Callable[[Node], bool]) -> Node | None:
        while heap:
            node = self.live(heapq.heappop(heap), is_candidate)
            if node is not None:
                return node
        return None


class Evictor:
    """Frees device pages and host slots, least valuable first.

    Refuse before evicting: an allocation that cannot be met frees nothing. Under write_back a page
    with no host copy (dirty) is backed up first and freed by a later eviction once its copy is
    agreed complete, so only clean pages count as freeable at once; a refused allocation starts the
    write-backs a retry will need."""

    def __init__(self, ledger: Ledger, candidates: Candidates, write_back: bool) -> None:
        self.ledger = ledger
        self.candidates = candidates
        self.write_back = write_back
        self.back_up: Callable[[list[Node]], None] = lambda nodes: None  # the core wires the backup layer
        self.retention_cap_tokens = ledger.config.retention_cap_tokens

    # ------------------------------------------------------------------ allocation

    def can_alloc_device(self, n: int) -> bool:
        """Whether ``alloc_device(n)`` would succeed now. Changes nothing."""
        short = n - self.ledger.device.available
        return short <= 0 or self._can_free(short)

    def _can_free(self, short: int) -> bool:
        return short <= self.ledger.evictable_device_pages and (not self.write_back or self._clean_suffices(short))

    def alloc_device(self, n: int) -> list[int]:
        led = self.ledger
        short = n - led.device.available
        if short > 0:
            if not self._can_free(short):
                if self.write_back:
                    self.evict_device(short, free_clean=False, drop_dirty=False)  # a retry finds these pages clean
                raise OutOfPages(
                    f"device pool: need {n} pages, {led.device.available} free and "
                    f"{led.evictable_device_pages} evictable"
                    + (" (dirty pages are being written back; retry)" if self.write_back else "")
                )
            freed = self.evict_device(short, drop_dirty=False)
            if freed < short:
                raise RuntimeError(f"eviction freed {freed} of {short} device pages it had found freeable")
        return led.device.alloc(n)

    def alloc_host_upto(self, n: int) -> list[int]:
        """As many of ``n`` host slots as eviction can make free."""
        host = self.ledger.host
        short = n - host.available
        if short > 0:
            self.evict_host(short)
        return host.alloc(min(n, host.available))

    def alloc_host(self, n: int) -> list[int] | None:
        """``n`` host slots, or None (and nothing evicted beyond what became free) if they cannot be had."""
        host = self.ledger.host
        short = n - host.available
        if short > 0:
            self.evict_host(short)
        return host.alloc(n) if host.available >= n else None

    def _clean_suffices(self, short: int) -> bool:
        """Whether freeing clean pages alone yields ``short`` pages now. A dry run that changes
        nothing: leaf-first over the candidates, a clean page's parent joining once its device
        children would be gone; every heap entry it pops goes back."""
        heap = self.candidates.device_heap
        popped: list[Entry] = []
        stack: list[Node] = []
        gone: set[int] = set()
        freed = 0
        while freed < short:
            if stack:
                node = stack.pop()
            elif heap:
                entry = heapq.heappop(heap)
                popped.append(entry)
                found = self.candidates.live(entry, is_device_candidate)
                if found is None or found.node_id in gone:
                    continue
                node = found
            else:
                break
            if node.host_state != HostState.VALID:
                continue  # dirty: it must be written back first, and it holds up its ancestors
            gone.add(node.node_id)
            freed += 1
            parent = node.parent
            if (
                parent is not None
                and parent.parent is not None
                and parent.device_state == DeviceState.VALID
                and not parent.device_pins
                and all(c.node_id in gone or c.device_state == DeviceState.NONE for c in parent.children.values())
            ):
                stack.append(parent)
        for entry in popped:
            heapq.heappush(heap, entry)
        return freed >= short

    # ------------------------------------------------------------------ eviction

    def evict_device(self, n: int, *, free_clean: bool = True, drop_dirty: bool = True) -> int:
        """Free up to ``n`` device pages, least valuable first. Returns the pages freed now.

        Under write_back a dirty page is backed up instead, with the ancestors that would become
        candidates right after it (a chain drains in one round trip, not one per page); with
        ``drop_dirty`` a dirty page that finds no host slot goes anyway (it is only a cache) and
        write-backs count towards ``n``, else only freed pages do. ``free_clean=False`` only starts
        write-backs."""
        led = self.ledger
        freed = 0
        backups: list[Node] = []
        kept: list[Node] = []
        count_backups = drop_dirty or not free_clean
        while freed + (len(backups) if count_backups else 0) < n:
            node = self.candidates.pop_device()
            if node is None:
                break
            if self.write_back and node.host_state == HostState.NONE:
                if len(backups) >= n:
                    kept.append(node)
                    continue
                chain = [node]
                cur = node.parent
                while len(backups) + len(chain) < n and _next_in_line(cur, chain[-1]):
                    assert cur is not None
                    chain.append(cur)
                    cur = cur.parent
                for x in chain:
                    led.update(x, device_pins=+1)  # hold it out of the heap while we look further
                backups.extend(chain)
                continue
            if not free_clean:
                kept.append(node)
                continue
            self.drop_device(node)
            freed += 1
        for node in backups:
            led.update(node, device_pins=-1)
        for node in kept:
            self.candidates.offer(node)
        if backups:
            self.back_up(backups)
            if drop_dirty:
                for node in backups:  # no host slot for its copy: evict it anyway, it is only a cache
                    if node.node_id in led.backup_backlog and is_device_candidate(node):
                        self.drop_device(node)
                        freed += 1
        led.stats.device_evicted_pages += freed
        return freed

    def evict_host(self, n: int) -> int:
        led = self.ledger
        freed = 0
        while freed < n:
            node = self.candidates.pop_host()
            if node is None:
                break
            led.free_host_copy(node)
            led.remove_if_empty(node)
            freed += 1
        led.stats.host_evicted_pages += freed
        return freed

    def drop_device(self, node: Node) -> None:
        """Free a device page; with no host copy, the host-only pages below it go too."""
        led = self.ledger
        if node.host_state == HostState.NONE and node.children:
            self._drop_host_subtree(node)
        if led.backup_backlog.pop(node.node_id, None) is not None:
            led.stats.backup_rejected_host_full += 1  # its only copy goes: never reached a lower tier
        if not led.drop_device_leaf(node):
            led.free_device_copy(node)
            led.remove_if_empty(node)

    def _drop_host_subtree(self, node: Node) -> None:
        led = self.ledger
        order: list[Node] = []
        stack = [c for c in node.children.values() if c.host_state != HostState.NONE]
        while stack:
            child = stack.pop()
            order.append(child)
            stack.extend(c for c in child.children.values() if c.host_state != HostState.NONE)
        for child in reversed(order):  # leaves first
            led.free_host_copy(child)
            led.remove_if_empty(child)
            led.stats.host_evicted_pages += 1

    # ------------------------------------------------------------------ the retention cap

    def enforce_retention(self) -> int:
        """Evict until evictable device tokens <= the cap. Returns pages freed."""
        cap = self.retention_cap_tokens
        led = self.ledger
        freed = 0
        while cap >= 0 and led.evictable_device_tokens > cap:
            before = led.evictable_device_tokens
            # Under write_back an eviction may start a backup instead (which protects the page), so
            # go again until the count is under the cap or nothing more can move.
            freed += self.evict_device(-(-(before - cap) // led.page_size))
            if led.evictable_device_tokens >= before:
                break
        return freed


def _next_in_line(node: Node | None, child: Node) -> bool:
    """Whether ``node`` becomes a write-back eviction candidate once ``child`` leaves device."""
    return (
        node is not None
        and node.parent is not None
        and node.device_state == DeviceState.VALID
        and not node.device_pins
        and node.host_state == HostState.NONE
        and all(c is child or c.device_state == DeviceState.NONE for c in node.children.values())
    )
