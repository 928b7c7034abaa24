"""Leases: everything one request holds (pins, pages, ops it waits for), and its release.

Invariants (``invariants.check``):
- a lease pins whole paths on device: no node it pins on device has an unpinned ancestor; a page it
  pins on host that hangs from a device page with no host copy has that page pinned too, so an
  unpinned device page is always evictable;
- a lease waits for exactly the in-flight ops into its pages or slots (``ops``), and is registered
  as a waiter of each;
- a released lease with ops in flight is parked (``releasing``) and finishes in the commit that
  completes its last op: nothing a copy still writes is ever freed or handed to another request,
  whichever component's slot (full page, SWA page, Mamba state) the copy writes;
- per component (``lease.parts``), the same: what it pins on device or host, the slots it holds.
"""

from __future__ import annotations

from tpcache.core.digest import DIGEST_MASK, mix, mix_ids
from tpcache.core.outbox import Outbox
from tpcache.core.records import Lease, LeasePart, UnknownLease
from tpcache.core.tiers import HostState
from tpcache.core.treecore import TreeCore
from tpcache.core.treecore.accounting import lease_record
from tpcache.core.treecore.core import ROOT
from tpcache.core.treecore.tree import Walk

# What an agreed flush keeps of a live lease: id, tokens, device pages, component slots by component.
Kept = tuple[int, bytes, list[int], dict[int, list[int]]]


class Leases:
    def __init__(self, core: TreeCore, outbox: Outbox) -> None:
        self.core = core
        self.ledger = core.ledger  # lease records, pools (no node is read through it)
        self.outbox = outbox
        self.table: dict[int, Lease] = {}
        self.waiters: dict[int, list[int]] = {}  # op id -> leases waiting for it
        self.next_lease = 1
        self._kept_digest = 0  # sum of ``lease.kept``: the leases a flush keeps, and their pages
        # Leases changed since their records were last folded into the digests (see ``refresh``).
        self.stale: dict[int, Lease] = {}

    def new(self, tokens: bytes, walk: Walk | None = None, locked_pages: int = 0) -> Lease:
        """A new lease of ``tokens``; ``walk``: its lock's walk of them (see ``Lease.walk``);
        ``locked_pages``: the hit (device + host) its lock found (see ``Lease.locked_pages``)."""
        lease = Lease(self.next_lease, tokens=tokens, walk=walk, locked_pages=locked_pages)
        self.next_lease += 1
        self.table[lease.lease_id] = lease
        return lease

    def get(self, lease_id: int) -> Lease:
        try:
            return self.table[lease_id]
        except KeyError:
            raise UnknownLease(f"no lease {lease_id}") from None

    def live(self, lease_id: int) -> Lease:
        """A lease that is not being released (only those take new work)."""
        lease = self.table.get(lease_id)
        if lease is None:
            raise UnknownLease(f"no lease {lease_id}")
        if lease.releasing:
            raise ValueError(f"lease {lease_id} is being released")
        return lease

    def refresh(self, lease: Lease) -> None:
        """Call after any change to a lease: its records in the state digest and the kept digest
        are made again by the next ``fold``, once however often it changed in between (a running
        request's alloc and append in one step cost one record). The digests are read only through
        ``fold`` (``CacheCore.digest``, ``state_digest``, ``kept_digest``): a sum does not depend on
        when its terms were updated, so the value read is the one refreshing at once would give."""
        self.stale[lease.lease_id] = lease

    def fold(self) -> None:
        """Re-record every lease changed since the last fold, in both digests."""
        if self.stale:
            self._kept_digest = self.ledger.record_leases(list(self.stale.values()), self._kept_digest, self.records)
            self.stale.clear()

    @staticmethod
    def records(lease: Lease) -> tuple[int, int]:
        """A lease's record in the state digest, and in the digest of what a flush keeps (its pages
        and component slots; 0 while it is being released)."""
        kept = 0 if lease.releasing else mix(lease.lease_id, lease.pages.total)
        if lease.parts and not lease.releasing:  # a flush keeps each component's slots too
            slots = [v for c, held in sorted(lease.parts.items()) for v in (c, len(held.pages), *held.pages)]
            kept = mix(kept, mix_ids(slots))
        return lease_record(lease, lease.state_fields()), kept

    @property
    def kept_digest(self) -> int:
        self.fold()
        return self._kept_digest

    # ------------------------------------------------------------------ pins (the caller refreshes)

    def pin_device(self, lease: Lease, ids: list[int]) -> None:
        core = self.core
        pinned = set(lease.device_nodes)
        for node_id in ids:
            if node_id not in pinned:
                lease.cursor = None  # a pin off the inserted path: ``append`` needs an insert first
                core.update(node_id, device_pins=+1)
                lease.device_nodes.append(node_id)
                pinned.add(node_id)

    def pin_host(self, lease: Lease, ids: list[int]) -> None:
        for node_id in ids:
            self.core.update(node_id, host_pins=+1)
            lease.host_nodes.append(node_id)

    def unpin_host(self, lease: Lease, ids: list[int]) -> None:
        for node_id in ids:
            self.core.update(node_id, host_pins=-1)
            lease.host_nodes.remove(node_id)

    def pin_anchor(self, lease: Lease, node_id: int) -> list[tuple[str, int]]:
        """Pin, for the lease, the node a fetch hangs from on the tier it is readable on, with its
        device path (see the module invariants). Returns what was pinned (tier, node id), for
        ``unpin_anchor``."""
        core = self.core
        if node_id == ROOT:
            return []
        pins: list[tuple[str, int]] = []
        if core.host(node_id)[0] == HostState.VALID and node_id not in lease.host_nodes:
            self.pin_host(lease, [node_id])
            pins.append(("host", node_id))
        before = len(lease.device_nodes)
        self.pin_device(lease, list(reversed(core.path_on_device([node_id]))))
        pins += [("device", i) for i in lease.device_nodes[before:]]
        return pins

    def unpin_anchor(self, lease: Lease, pins: list[tuple[str, int]]) -> None:
        for tier, node_id in reversed(pins):
            if tier == "host":
                self.unpin_host(lease, [node_id])
            else:
                self.core.update(node_id, device_pins=-1)
                lease.device_nodes.remove(node_id)
                lease.cursor = None

    def drop_failed_loads(self, lease: Lease, ids: list[int]) -> None:
        """Let go of device pins on pages whose load failed (they are gone from device)."""
        dropped = set(ids)
        self.core.touch([i for i in lease.device_nodes if i in dropped], -1)
        lease.device_nodes.discard(dropped)
        lease.cursor = None

    def drop_failed_part_loads(self, lease: Lease, part: int, ids: list[int]) -> None:
        """The same for one component's data whose load failed."""
        held = lease.parts.get(part)
        if held is None:
            return
        core = self.core
        dropped = set(ids)
        for node_id in held.device_nodes:
            if node_id in dropped:
                core.update(node_id, part=part, device_pins=-1)
        held.device_nodes = [i for i in held.device_nodes if i not in dropped]

    # ------------------------------------------------------------------ across an agreed flush

    def kept(self) -> list[Kept]:
        """What a flush keeps of the live leases: id, tokens, and the device pages and component
        slots each allocated (the engine may still be writing KV into them)."""
        return [
            (x.lease_id, x.tokens, list(x.pages), {c: list(h.pages) for c, h in x.parts.items() if h.pages})
            for x in self.table.values()
            if not x.releasing
        ]

    def take_back(self, kept: list[Kept]) -> None:
        """Re-open, in a fresh core, the leases a flush kept, holding their pages and slots again."""
        led = self.ledger
        for lease_id, tokens, pages, parts in kept:
            led.device.take(pages)
            lease = Lease(lease_id, tokens=tokens)
            lease.pages.extend(pages)
            for c, slots in parts.items():
                led.parts[c].device.take(slots)
                lease.parts[c] = LeasePart(pages=slots)
            self.table[lease_id] = lease
            self.refresh(lease)

    # ------------------------------------------------------------------ waits and release

    def wait_for(self, lease: Lease, op_id: int) -> None:
        lease.ops.append(op_id)
        self.waiters.setdefault(op_id, []).append(lease.lease_id)

    def waiting_for(self, op_id: int) -> list[Lease]:
        """The live leases that wait for ``op_id`` (forgetting the op's waiter list)."""
        waiting = self.waiters.pop(op_id, None)
        return [self.table[lid] for lid in waiting if lid in self.table] if waiting else []

    def op_done(self, lease: Lease, op_id: int) -> None:
        """``op_id`` retired: the lease no longer waits for it; a parked lease may finish now."""
        lease.ops.remove(op_id)
        self.refresh(lease)
        if lease.releasing and not lease.ops:
            self.finish(lease)

    def release(self, lease: Lease) -> bool:
        """Release now, or park until the ops the lease waits for retire. True when released now."""
        lease.releasing = True
        self.refresh(lease)
        if lease.ops:
            return False
        self.finish(lease)
        return True

    def finish(self, lease: Lease) -> None:
        led = self.ledger
        # The digests hold the lease's last folded records (``lease.record``, ``lease.kept``): take
        # those out, and whatever changed since with them.
        self.stale.pop(lease.lease_id, None)
        lease.walk = None
        led.forget_lease(lease)
        self._kept_digest = (self._kept_digest - lease.kept) & DIGEST_MASK
        lease.kept = 0
        core = self.core
        for c, held in lease.parts.items():  # component pins first: a full page outlives its components
            for node_id in held.device_nodes:
                core.update(node_id, part=c, device_pins=-1)
            for node_id in held.host_nodes:
                core.update(node_id, part=c, host_pins=-1)
            led.parts[c].device.free(held.pages)
        gone = core.touch(lease.device_nodes, -1, stamp=True)  # last used now: LRU by the end of use
        for node_id in lease.host_nodes:
            core.update(node_id, host_pins=-1)
        led.device.free(lease.pages)
        del self.table[lease.lease_id]
        # A copy keeps a node; the few with none (a failed copy) may go: those the touch found, and
        # the host pins' (filtered first: a path is long).
        for node_id in (gone + core.unresident(lease.host_nodes)) if lease.host_nodes else gone:
            if core.exists(node_id):
                core.remove_if_empty(node_id)
        self.outbox.released(lease.lease_id)
