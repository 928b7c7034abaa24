"""The shell: carries out the core's copies on this rank and reports what finished.

It is the only place that touches KV tensors and storage. Completions are local knowledge: they
are recorded here and reported to the round, and only the agreed ones are retired (removed from
the transfer engine's queues) after the commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from protocol.round_vector import HEALTH_TRANSFER_ERROR
from tpcache.core.cache import OpKind, Transfer
from tpcache.core.round import QueueObservation, observe_head
from tpcache.io.kv_pool import HostPool
from tpcache.io.storage import StorageKey, StorageWorker
from tpcache.io.transfer import D2H, H2D, LoadHandle, TransferEngine

log = logging.getLogger("tpcache.shell")


class Shell:
    """One rank's I/O. ``transfer`` None means metadata only: copies complete at once."""

    def __init__(
        self,
        transfer: TransferEngine | None = None,
        host_pool: HostPool | None = None,
        storage: StorageWorker | None = None,
        key_of: Callable[[int], StorageKey] | None = None,
    ) -> None:
        if storage is not None and (transfer is None or host_pool is None or key_of is None):
            raise ValueError("the storage tier needs KV pools (a transfer engine and a host pool)")
        self.transfer = transfer
        self.host_pool = host_pool
        self.storage = storage
        self.key_of = key_of
        self.results: dict[int, int] = {}  # op id -> pages that landed, once finished
        self.sizes: dict[int, int] = {}  # op id -> pages, while not finished
        self.handles: dict[int, LoadHandle] = {}
        self.in_engine: set[int] = set()  # op ids queued in the transfer engine, until retired
        self.health_bits = 0
        self.storage_errors = 0
        self.submitted = {kind: 0 for kind in OpKind}

    def submit(self, effects: Sequence[Transfer]) -> None:
        for op in effects:
            self.submitted[op.kind] += 1
            if self.transfer is None:
                self.results[op.op_id] = op.num_pages
                continue
            self.sizes[op.op_id] = op.num_pages
            try:
                self._start(op)
            except Exception as exc:  # a copy that cannot start failed on this rank: report it
                log.error("could not start %s op %d: %s", op.kind.name, op.op_id, exc)
                if op.kind in (OpKind.BACKUP, OpKind.LOAD):
                    # The core named pages the pools refuse: a bug, not an I/O fault. Close.
                    self.health_bits |= HEALTH_TRANSFER_ERROR
                else:
                    self.storage_errors += 1  # storage trouble is a miss or a failed write, agreed as such
                self.results[op.op_id] = 0
                self.sizes.pop(op.op_id, None)

    def _start(self, op: Transfer) -> None:
        assert self.transfer is not None
        if op.kind == OpKind.BACKUP:
            self.transfer.submit_backup(op.op_id, op.device_pages, op.host_slots)
            self.in_engine.add(op.op_id)
        elif op.kind == OpKind.LOAD:
            self.handles[op.op_id] = self.transfer.submit_load(op.op_id, op.host_slots, op.device_pages)
            self.in_engine.add(op.op_id)
        else:
            if self.storage is None:
                raise RuntimeError(f"{op.kind.name} issued without a storage tier")
            assert self.host_pool is not None and self.key_of is not None
            keys = [self.key_of(h) for h in op.page_hashes]
            if op.kind == OpKind.STORAGE_QUERY:
                self.storage.submit_exists(op.op_id, keys)
                return
            views = [self.host_pool.page_view(slot) for slot in op.host_slots]
            if op.kind == OpKind.STORAGE_WRITE:
                self.storage.submit_put(op.op_id, keys, views)
            else:
                self.storage.submit_get(op.op_id, keys, views)

    def poll(self) -> None:
        """Record every finished op (local knowledge, applied only once agreed)."""
        if self.transfer is not None:
            for direction in (D2H, H2D):
                for c in self.transfer.poll(direction):
                    if c.op_id in self.sizes:
                        size = self.sizes.pop(c.op_id)  # finished either way: no longer in flight
                        self.results[c.op_id] = size if c.ok else 0
                        if not c.ok:
                            log.warning("copy op %d (%s) failed on this rank: %s", c.op_id, direction, c.error)
        if self.storage is not None:
            for c in self.storage.poll():
                size = self.sizes.pop(c.op_id, None)
                if size is None:
                    continue
                landed = 0
                for ok in c.results:  # only the leading pages count: the tier stays prefix-closed
                    if not ok:
                        break
                    landed += 1
                self.results[c.op_id] = landed

    def observe(self, kind: OpKind, pending: Sequence[Transfer]) -> QueueObservation:
        return observe_head(self.results, pending)

    def health(self) -> int:
        return self.health_bits

    def drained(self) -> bool:
        """No copy is physically in flight on this rank."""
        return not self.sizes

    def retire(self, ops: Sequence[Transfer]) -> None:
        """Forget agreed ops; the transfer engine drops them from the head of its queues."""
        counts = {D2H: 0, H2D: 0}
        for op in ops:
            self.results.pop(op.op_id, None)
            self.handles.pop(op.op_id, None)
            if op.op_id in self.in_engine:
                self.in_engine.discard(op.op_id)
                counts[D2H if op.kind == OpKind.BACKUP else H2D] += 1
        if self.transfer is not None:
            for direction, n in counts.items():
                if n:
                    self.transfer.pop(direction, n)

    def reset(self) -> None:
        """After an agreed flush: nothing is in flight (that is what 'drained' agreed)."""
        if self.transfer is not None:
            for direction in (D2H, H2D):
                n = len(self.transfer.poll(direction))
                if n:
                    self.transfer.pop(direction, n)
        self.results.clear()
        self.handles.clear()
        self.in_engine.clear()
        self.health_bits = 0

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        if self.storage is not None:
            self.storage.close()


def storage_key_factory(namespace: str, layout_version: int, rank: int, world: int) -> Callable[[int], StorageKey]:
    def key_of(page_hash: int) -> StorageKey:
        return StorageKey(namespace, layout_version, rank, world, page_hash)

    return key_of
