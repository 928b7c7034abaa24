"""Load-back: a lease's host hits copied back to device, for every component its hit needs.

Invariants:
- a page another request is already loading is shared: the lease pins it and waits for that load,
  and nothing at or below it is loaded here (if that load fails, a page loaded under it would hang
  from nothing, and a component loaded into it would outlive its full page);
- everything the hit needs is pinned before anything is allocated (our own evictions never take
  it), and every pool is checked before any is evicted from: a refused load changes nothing;
- loaded data becomes device-valid only when the round agrees the copy landed on every rank; until
  then it is ``LOADING`` and no match reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpcache.core.records import Lease, OpKind
from tpcache.core.tiers import DeviceState
from tpcache.core.treecore import TreeCore
from tpcache.core.treecore.allocator import OutOfPages

if TYPE_CHECKING:
    from tpcache.core.hybrid import Hybrid
    from tpcache.core.leases import Leases
    from tpcache.core.outbox import Outbox
    from tpcache.core.treecore.eviction import Evictor


class Loader:
    def __init__(self, core: TreeCore, book: Leases, outbox: Outbox, evictor: Evictor, hybrid: Hybrid | None) -> None:
        self.core = core
        self.book = book
        self.outbox = outbox
        self.evictor = evictor
        self.hybrid = hybrid

    def load(self, lease: Lease) -> list[int]:
        """Start loading the host pages (and component data) of the lease's hit back to device.
        Returns the device pages of the hit, loading ones included, in page order."""
        core = self.core
        ids = core.walk(lease.tokens).ids
        _, on_device, reach, first_loading = core.load_reach(ids)
        prefix: list[int] = ids[:on_device]
        todo: list[int] = ids[on_device:reach]
        plan = None
        if self.hybrid is not None:
            plan = self.hybrid.plan_load(ids, len(prefix) + len(todo), first_loading)
            prefix, todo = prefix[: plan.pages], todo[: max(0, plan.pages - len(prefix))]
        # Pin the prefix before allocating: the eviction must not take it (nor its host-only pages).
        before, cursor = len(lease.device_nodes), lease.cursor
        self.book.pin_device(lease, prefix)
        try:
            slots = self.hybrid.reserve(lease, plan, len(todo)) if plan is not None else {}
            pages = self.evictor.alloc_device(len(todo)) if todo else []
        except OutOfPages:  # a refused load changes nothing
            core.touch(lease.device_nodes[before:], -1)
            lease.device_nodes.truncate(before)
            lease.cursor = cursor
            raise
        for node_id, (device, _, _) in zip(prefix, core.tier_states(prefix), strict=True):
            if device == DeviceState.LOADING:
                for op in self.outbox.inflight[OpKind.LOAD]:
                    if node_id in op.nodes and op.op_id not in lease.ops:
                        self.book.wait_for(lease, op.op_id)
        for node_id, page in zip(todo, pages, strict=True):
            # the lease's pin (a loading page is never evicted) and the op's read of the host slot
            core.update(node_id, device=(DeviceState.LOADING, page), device_pins=+1, host_pins=+1)
            lease.device_nodes.append(node_id)
            lease.cursor = None  # a pin off the inserted path: ``append`` needs an insert first
        op = None
        if plan is not None and (todo or plan.loads):
            op_nodes, full_index, parts = self.hybrid.start_loads(lease, plan, todo, slots)  # type: ignore[union-attr]
            op = self.outbox.issue(OpKind.LOAD, op_nodes, lease.lease_id, full_index=full_index, parts=parts)
        elif todo:
            op = self.outbox.issue(OpKind.LOAD, todo, lease.lease_id)
        if op is not None:
            self.book.wait_for(lease, op.op_id)
            core.stats.loads_issued_pages += len(todo)
            if lease.admission is None:  # (an admission counts its own hit when it commits)
                # Pages past the lock's hit were read from storage since: counted once they land.
                op.storage_hits = todo[max(0, lease.locked_pages - len(prefix)) :]
        self.book.refresh(lease)
        return core.device_pages(prefix + todo)
