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
from tpcache.core.treecore import TreeCore
from tpcache.core.treecore.components import DSLOT, HOST, HSLOT


class Completions:
    def __init__(
        self, core: TreeCore, outbox: Outbox, leases: Leases, backup: Backup, prefetch: Prefetcher, staging: Staging
    ) -> None:
        self.core = core
        self.staging = staging
        self.outbox = outbox
        self.leases = leases
        self.backup = backup
        self.prefetch = prefetch
        self._appliers: dict[OpKind, Callable[[Transfer, list[int], int, list[Lease]], None]] = {
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
        core = self.core
        if ok < pages:
            core.stats.failed_copy_pages += pages - ok
        waiters = self.leases.waiting_for(op.op_id)
        ids = op.nodes
        if op.parts:
            self._parts(op, ids, ok, waiters)
        self._appliers[kind](op, ids, ok, waiters)
        if op.pinned:
            core.touch(op.pinned, -1)  # the path a copy protected, released with its ack
        core.remove_empty(ids)
        for lease in waiters:
            self.leases.op_done(lease, op.op_id)
        if self.staging.enabled:  # buffer mode: an agreed copy may end these pages' staging
            self.staging.note(op.nodes)
        return op

    def _parts(self, op: Transfer, ids: list[int], ok: int, waiters: list[Lease]) -> None:
        """The op's component copies: landed ones become valid (or durable), the rest are dropped,
        and the op's pins on them go. Before the full pages, which a component copy needs."""
        core = self.core
        kind = op.kind
        for pc in op.parts:
            c, base = pc.part, core.part_base(pc.part)
            dslot, hslot, host = base + DSLOT, base + HSLOT, base + HOST
            failed: list[int] = []
            for i in pc.index:
                node_id = ids[i]
                rec = core.component(node_id)
                assert rec is not None
                if kind == OpKind.BACKUP:
                    core.update(node_id, part=c, device_pins=-1)
                    if i < ok:
                        core.update(node_id, part=c, host=(HostState.VALID, rec[hslot]))
                    else:
                        core.free_part_host(node_id, c)
                elif kind == OpKind.LOAD:
                    core.update(node_id, part=c, host_pins=-1)
                    if i < ok:
                        core.update(node_id, part=c, device=(DeviceState.VALID, rec[dslot]))
                    else:
                        core.free_part_device(node_id, c)
                        failed.append(node_id)
                elif kind == OpKind.STORAGE_WRITE:
                    core.update(
                        node_id, part=c, storage=StorageState.DURABLE if i < ok else StorageState.NONE, host_pins=-1
                    )
                elif i < ok:  # STORAGE_READ (with storage agreed off meanwhile, the copy is no longer durable)
                    core.update(node_id, part=c, host=(HostState.VALID, rec[hslot]), storage=self._read_storage())
                elif rec[host]:
                    core.free_part_host(node_id, c)
            for lease in waiters if failed else ():
                self.leases.drop_failed_part_loads(lease, c, failed)

    def _backup(self, op: Transfer, ids: list[int], ok: int, waiters: list[Lease]) -> None:
        core = self.core
        landed, failed = _split(ids, op.full_index, ok)
        core.settle(landed, host=HostState.VALID)
        for node_id in failed:
            core.free_host_copy(node_id)
        core.stats.backups_done_pages += ok
        self.backup.store(op.nodes[:ok])

    def _load(self, op: Transfer, ids: list[int], ok: int, waiters: list[Lease]) -> None:
        core = self.core
        if op.engine_pages:  # into the engine's blocks: no tier state changes, the lease holds the slots
            core.stats.loads_done_pages += ok
            return
        landed, failed = _split(ids, op.full_index, ok)
        core.settle(landed, device=DeviceState.VALID, host_pins=-1)
        for node_id in failed:
            core.free_device_pages(core.device_pages([node_id]))
            core.update(node_id, device=(DeviceState.NONE, -1), host_pins=-1)
        core.stats.loads_done_pages += len(landed)
        if op.storage_hits:  # a lock's storage hit, served now that every rank holds it on device
            from_storage = set(op.storage_hits)
            served = core.page_size * sum(1 for i in landed if i in from_storage)
            core.stats.storage_hit_tokens += served
            core.stats.lock_storage_hit_tokens += served
        if self.staging.enabled:  # a staged page that reached device needs no host slot: its leases let go
            arrived = set(ids[:ok])  # with nodes that moved only component data
            for lease in waiters:
                held = lease.prefetch.anchor if lease.prefetch is not None else []
                anchors = {i for tier, i in held if tier == "host"}
                mine = [i for i in lease.host_nodes if i in arrived and i not in anchors]
                self.leases.unpin_host(lease, mine)
        for lease in waiters if failed else ():  # every request sharing a failed load lets go of its pages
            self.leases.drop_failed_loads(lease, failed)

    def _storage_write(self, op: Transfer, ids: list[int], ok: int, waiters: list[Lease]) -> None:
        core = self.core
        landed, failed = _split(ids, op.full_index, ok)
        core.settle(landed, storage=StorageState.DURABLE, host_pins=-1)
        core.settle(failed, storage=StorageState.NONE, host_pins=-1)
        core.stats.storage_written_pages += ok

    def _storage_read(self, op: Transfer, ids: list[int], ok: int, waiters: list[Lease]) -> None:
        core = self.core
        core.settle(ids[:ok], host=HostState.VALID, storage=self._read_storage())
        for node_id in ids[ok:]:
            core.free_host_copy(node_id)
        core.stats.prefetch_read_pages += ok
        lease = self.leases.table.get(op.lease_id)
        if lease is not None and lease.prefetch is not None:  # the anchor it lets go of may be done staging
            self.staging.note(n for _, n in lease.prefetch.anchor)
        self.prefetch.on_read(op, ok)

    def _read_storage(self) -> StorageState | None:
        """The storage state a page read from storage lands with: durable, unless storage was agreed
        unusable since the read was issued (nothing counts as durable then; None: left as it is)."""
        return None if self.backup.storage_down else StorageState.DURABLE

    def _storage_query(self, op: Transfer, ids: list[int], ok: int, waiters: list[Lease]) -> None:
        self.prefetch.on_query(op, ok)


def _split(ids: list[int], full_index: list[int] | None, ok: int) -> tuple[list[int], list[int]]:
    """The ids of the nodes whose full page an op over ``ids`` moves: those among its ``ok`` leading
    pages (landed on every rank), and the rest (the copy failed somewhere), each in op order."""
    if full_index is None:
        return ids[:ok], ids[ok:]
    return [ids[i] for i in full_index if i < ok], [ids[i] for i in full_index if i >= ok]
