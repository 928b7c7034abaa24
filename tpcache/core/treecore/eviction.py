"""Eviction: the loops that free device pages and host slots, least valuable first (the candidates
and their order are ``candidates``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpcache.core.backend import NATIVE
from tpcache.core.tiers import DeviceState, HostState
from tpcache.core.treecore.allocator import OutOfPages
from tpcache.core.treecore.candidates import (
    FIFO,
    KEY_KINDS,
    LFU,
    LRU,
    POLICIES,
    Candidates,
    Entry,
    host_subtree_droppable,
    is_device_candidate,
    is_host_candidate,
    make_policy,
)

_native = NATIVE

if TYPE_CHECKING:
    from tpcache.core.treecore.ledger import Ledger
    from tpcache.core.treecore.tree import Node

__all__ = [
    "FIFO",
    "KEY_KINDS",
    "LFU",
    "LRU",
    "POLICIES",
    "Candidates",
    "Evictor",
    "host_subtree_droppable",
    "is_device_candidate",
    "is_host_candidate",
    "make_policy",
]


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
        self.back_up: Callable[[list[int]], None] = lambda ids: None  # the core wires the backup layer (by id)
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
        pages = led.device.try_alloc(n)  # most allocations: enough pages are free
        if pages is not None:
            return pages
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
                and all(c.node_id in gone or c.device_state == DeviceState.NONE for c in parent.child_nodes())
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
        # Without write-back, the plain leaves among the candidates go in one C loop (_evict.c);
        # it hands back the first other candidate, which the loop below treats as its own.
        leaves = _native.drop_leaves if _native is not None and not self.write_back and free_clean else None
        pool = (self.candidates.native, led.device._owned, led.device._free, led.backup_backlog) if leaves else ()
        while (want := n - freed - (len(backups) if count_backups else 0)) > 0:
            if leaves is not None:
                gone: list[Node] | None = None if led.feed is None else []  # the feed learns which leaves went
                tally = [led.digest.value, led.evictable_device_pages]  # kept by the loop, also on an error
                try:
                    dropped, node = leaves(*pool, tally, want, gone)
                finally:
                    led.digest.value, led.evictable_device_pages = tally
                if gone is not None:
                    led.feed.dropped_device_leaves(gone)
                freed += dropped
                if node is None:
                    if dropped < want:
                        break
                    continue
            else:
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
            self.back_up([n.node_id for n in backups])
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
        if node.host_state == HostState.NONE and node.num_children:
            self._drop_host_subtree(node)
        if led.backup_backlog.pop(node.node_id, None) is not None:
            led.stats.backup_rejected_host_full += 1  # its only copy goes: never reached a lower tier
        if not led.drop_device_leaf(node):
            led.free_device_copy(node)
            led.remove_if_empty(node)

    def _drop_host_subtree(self, node: Node) -> None:
        led = self.ledger
        order: list[Node] = []
        stack = [c for c in node.child_nodes() if c.host_state != HostState.NONE]
        while stack:
            child = stack.pop()
            order.append(child)
            stack.extend(c for c in child.child_nodes() if c.host_state != HostState.NONE)
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
        and all(c is child or c.device_state == DeviceState.NONE for c in node.child_nodes())
    )
