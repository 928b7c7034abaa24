"""Eviction of component data: each component's pools free slots by their own LRU.

A component's device candidates are its device-valid, unpinned copies, least recently used first by
the component's own stamp (an SWA page is stamped only while inside some request's window, a state
only where a hit ended or an insert put it). Freeing one leaves a tombstone: the node and its full
page stay. Except at a device leaf that could be evicted whole anyway: without the component no hit
can end there, so its full page would be dead weight, and the whole node leaves the device (its
other components with it). Host candidates are host-valid, unpinned copies not on device.

Refuse before evicting, as for full pages: an allocation that the free and evictable slots cannot
meet frees nothing. Every candidate frees exactly one slot of its component, so the check is exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpcache.core.tiers import HostState
from tpcache.core.treecore.allocator import OutOfPages
from tpcache.core.treecore.components import Part
from tpcache.core.treecore.eviction import is_device_candidate

if TYPE_CHECKING:
    from tpcache.core.treecore.eviction import Evictor
    from tpcache.core.treecore.ledger import Ledger
    from tpcache.core.treecore.tree import Node


class PartEvictor:
    def __init__(self, ledger: Ledger, evictor: Evictor) -> None:
        self.ledger = ledger
        self.evictor = evictor

    def can_alloc_device(self, p: Part, n: int) -> bool:
        return n <= p.device.available + p.evictable

    def alloc_device(self, p: Part, n: int) -> list[int]:
        """``n`` device slots of component ``p``, evicting its least recently used data (or refuse first)."""
        short = n - p.device.available
        if short > 0:
            if short > p.evictable:
                raise OutOfPages(
                    f"{p.name} device pool: need {n} slots, {p.device.available} free and {p.evictable} evictable"
                )
            self.evict_device(p, short)
        return p.device.alloc(n)

    def evict_device(self, p: Part, n: int) -> int:
        led = self.ledger
        freed = 0
        while freed < n:
            node = p.pop(device=True)
            if node is None:
                break
            if self._drop_whole(node):
                self.evictor.drop_device(node)
                led.stats.device_evicted_pages += 1
            else:
                led.free_part_device(node, p)
            led.stats.part_device_evicted += 1
            freed += 1
        return freed

    def _drop_whole(self, node: Node) -> bool:
        """A device leaf that full-page eviction could take now, and whose page is clean under
        write_back (a dirty page is not dropped to free a component slot)."""
        if not is_device_candidate(node):
            return False
        return not self.evictor.write_back or node.host_state != HostState.NONE

    def alloc_host_upto(self, p: Part, n: int) -> list[int]:
        short = n - p.host.available
        if short > 0:
            self.evict_host(p, short)
        return p.host.alloc(min(n, p.host.available))

    def alloc_host(self, p: Part, n: int) -> list[int] | None:
        short = n - p.host.available
        if short > 0:
            self.evict_host(p, short)
        return p.host.alloc(n) if p.host.available >= n else None

    def evict_host(self, p: Part, n: int) -> int:
        freed = 0
        while freed < n:
            node = p.pop(device=False)
            if node is None:
                break
            self.ledger.free_part_host(node, p)
            self.ledger.stats.part_host_evicted += 1
            freed += 1
        return freed

    def enforce_retention(self, cap_tokens: int) -> int:
        """Each component keeps at most ``cap_tokens`` of evictable device data (a slot counts as the
        page it belongs to), as full pages do."""
        if cap_tokens < 0:
            return 0
        freed = 0
        page = self.ledger.page_size
        for p in self.ledger.parts.values():
            over = p.evictable - cap_tokens // page
            if over > 0:
                freed += self.evict_device(p, over)
        return freed
