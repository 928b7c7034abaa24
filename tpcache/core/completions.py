"""Agreed completions: one applier per op kind.

The round decides that the head op of a queue completed and how many of its leading pages landed on
every rank (``acked``); pages past that count failed somewhere and their target copy is dropped.
A node counts as landed only with every copy the op made of it (its full page and component data),
so a component's copy becomes readable in the same agreed completion as the rest of its node's.
Nothing here runs for an op the round did not agree on.
"""

from __future__ import annotations

from collections.abc import Callable

from tpcache.core.backup import Backup
from tpcache.core.leases import Leases
from tpcache.core.outbox import Outbox
from tpcache.core.prefetch import Prefetcher
from tpcache.core.records import Lease, OpKind, Transfer
from tpcache.core.staging import Staging
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.treecore.components import DSLOT, HOST, HSLOT
from tpcache.core.treecore.ledger import Ledger
from tpcache.core.treecore.tree import Node


class Completions:
    def __init__(
        self, ledger: Ledger, outbox: Outbox, leases: Leases, backup: Backup, prefetch: Prefetcher, staging: Staging
    ) -> None:
        self.ledger = ledger
        self.staging = staging
        self.outbox = outbox
        self.leases = leases
        self.backup = backup
        self.prefetch = prefetch
        self._appliers: dict[OpKind, Callable[[Transfer, int, list[Lease]], None]] = {
            OpKind.BACKUP: self._backup,
            OpKind.LOAD: self._load,
            OpKind.STORAGE_WRITE: self._storage_write,
            OpKind.STORAGE_READ: self._storage_read,
            OpKind.STORAGE_QUERY: self._storage_query,
        }

    def apply(self, kind: OpKind, acked_pages: int | None = None) -> Transfer:
        """Apply the agreed completion of the head op of ``kind`` (None: every page landed)."""
        pages = len(self.outbox.inflight[kind][0].page_hashes)  # the head op's num_pages
        ok = pages if acked_pages is None else max(0, min(acked_pages, pages))
        if kind == OpKind.STORAGE_WRITE and self.backup.storage_down:
            ok = 0  # storage was agreed unusable meanwhile: nothing written there counts as durable
        op = self.outbox.retire_head(kind, ok)
        led = self.ledger
        if ok < pages:
            led.stats.failed_copy_pages += pages - ok
        waiters = self.leases.waiting_for(op.op_id)
        if op.parts:
            self._parts(op, ok, waiters)
        self._appliers[kind](op, ok, waiters)
        if op.pinned:
            led.touch(op.pinned, -1)  # the path a copy protected, released with its ack
        led.remove_empty(op.nodes)
        for lease in waiters:
            self.leases.op_done(lease, op.op_id)
        if self.staging.enabled:  # buffer mode: an agreed copy may end these pages' staging
            self.staging.note(op.nodes)
        return op

    def _parts(self, op: Transfer, ok: int, waiters: list[Lease]) -> None:
        """The op's component copies: landed ones become valid (or durable), the rest are dropped,
        and the op's pins on them go. Before the full pages, which a component copy needs."""
        led = self.ledger
        kind = op.kind
        for pc in op.parts:
            c, part = pc.part, led.parts[pc.part]
            dslot, hslot, host = part.base + DSLOT, part.base + HSLOT, part.base + HOST
            failed: list[Node] = []
            for i in pc.index:
                node = op.nodes[i]
                rec = node.comp
                assert rec is not None
                if kind == OpKind.BACKUP:
                    led.update(node, part=c, device_pins=-1)
                    if i < ok:
                        led.update(node, part=c, host=(HostState.VALID, rec[hslot]))
                    else:
                        led.free_part_host(node, part)
                elif kind == OpKind.LOAD:
                    led.update(node, part=c, host_pins=-1)
                    if i < ok:
                        led.update(node, part=c, device=(DeviceState.VALID, rec[dslot]))
                    else:
                        led.free_part_device(node, part)
                        failed.append(node)
                elif kind == OpKind.STORAGE_WRITE:
                    led.update(
                        node, part=c, storage=StorageState.DURABLE if i < ok else StorageState.NONE, host_pins=-1
                    )
                elif i < ok:  # STORAGE_READ (with storage agreed off meanwhile, the copy is no longer durable)
                    led.update(node, part=c, host=(HostState.VALID, rec[hslot]), storage=self._read_storage())
                elif rec[host]:
                    led.free_part_host(node, part)
            for lease in waiters if failed else ():
                self.leases.drop_failed_part_loads(lease, c, failed)

    def _backup(self, op: Transfer, ok: int, waiters: list[Lease]) -> None:
        led = self.ledger
        landed, failed = _split(op, ok)
        led.settle(landed, host=HostState.VALID)
        for node in failed:
            led.free_host_copy(node)
        led.stats.backups_done_pages += ok
        self.backup.store(op.nodes[:ok])

    def _load(self, op: Transfer, ok: int, waiters: list[Lease]) -> None:
        led = self.ledger
        if op.engine_pages:  # into the engine's blocks: no tier state changes, the lease holds the slots
            led.stats.loads_done_pages += ok
            return
        landed, failed = _split(op, ok)
        led.settle(landed, device=DeviceState.VALID, host_pins=-1)
        for node in failed:
            led.device.free([node.device_page])
            led.update(node, device=(DeviceState.NONE, -1), host_pins=-1)
        led.stats.loads_done_pages += len(landed)
        if op.storage_hits:  # a lock's storage hit, served now that every rank holds it on device
            from_storage = {n.node_id for n in op.storage_hits}
            served = led.page_size * sum(1 for n in landed if n.node_id in from_storage)
            led.stats.storage_hit_tokens += served
            led.stats.lock_storage_hit_tokens += served
        if self.staging.enabled:  # a staged page that reached device needs no host slot: its leases let go
            arrived = {n.node_id for n in op.nodes[:ok]}  # with nodes that moved only component data
            for lease in waiters:
                held = lease.prefetch.anchor if lease.prefetch is not None else []
                anchors = {n.node_id for tier, n in held if tier == "host"}
                mine = [n for n in lease.host_nodes if n.node_id in arrived and n.node_id not in anchors]
                self.leases.unpin_host(lease, mine)
        for lease in waiters if failed else ():  # every request sharing a failed load lets go of its pages
            self.leases.drop_failed_loads(lease, failed)

    def _storage_write(self, op: Transfer, ok: int, waiters: list[Lease]) -> None:
        led = self.ledger
        landed, failed = _split(op, ok)
        led.settle(landed, storage=StorageState.DURABLE, host_pins=-1)
        led.settle(failed, storage=StorageState.NONE, host_pins=-1)
        led.stats.storage_written_pages += ok

    def _storage_read(self, op: Transfer, ok: int, waiters: list[Lease]) -> None:
        led = self.ledger
        led.settle(op.nodes[:ok], host=HostState.VALID, storage=self._read_storage())
        for node in op.nodes[ok:]:
            led.free_host_copy(node)
        led.stats.prefetch_read_pages += ok
        lease = self.leases.table.get(op.lease_id)
        if lease is not None and lease.prefetch is not None:  # the anchor it lets go of may be done staging
            self.staging.note(n for _, n in lease.prefetch.anchor)
        self.prefetch.on_read(op, ok)

    def _read_storage(self) -> StorageState | None:
        """The storage state a page read from storage lands with: durable, unless storage was agreed
        unusable since the read was issued (nothing counts as durable then; None: left as it is)."""
        return None if self.backup.storage_down else StorageState.DURABLE

    def _storage_query(self, op: Transfer, ok: int, waiters: list[Lease]) -> None:
        self.prefetch.on_query(op, ok)


def _split(op: Transfer, ok: int) -> tuple[list[Node], list[Node]]:
    """The nodes whose full page the op moves: those among its ``ok`` leading pages (landed on every
    rank), and the rest (the copy failed somewhere), each in op order."""
    if op.full_index is None:
        return op.nodes[:ok], op.nodes[ok:]
    nodes = op.nodes
    return [nodes[i] for i in op.full_index if i < ok], [nodes[i] for i in op.full_index if i >= ok]
