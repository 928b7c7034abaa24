"""The shell: one rank's real I/O, as the driver sees it (``driver.IO``).

It is the only place that touches KV tensors and storage. It starts the core's ops on the transfer
engine and the storage worker and records, by op id, how many leading pages of each landed on this
rank: local knowledge that the round turns into agreed completions. It forgets an op when the round
retires it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from protocol.round_vector import HEALTH_IO_ERROR
from tpcache.core.records import OpKind, Transfer
from tpcache.io.kv_pool import HostPool
from tpcache.io.storage import StorageKey, StorageWorker
from tpcache.io.transfer import LoadHandle, TransferEngine

log = logging.getLogger("tpcache.shell")


class Shell:
    """One rank's I/O. ``transfer`` None means metadata only: copies land at once."""

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
        self.running: dict[int, Transfer] = {}  # started, not finished on this rank
        self.results: dict[int, int] = {}  # op id -> leading pages that landed, once finished
        self.handles: dict[int, LoadHandle] = {}  # loads, for the engine's per-layer waits
        self.health_bits = 0
        self.storage_errors = 0

    # ------------------------------------------------------------------ driver.IO

    def start(self, ops: Sequence[Transfer]) -> None:
        for op in ops:
            if self.transfer is None:
                self.results[op.op_id] = op.num_pages
                continue
            self.running[op.op_id] = op
            try:
                self._start(op)
            except Exception as exc:  # a copy that cannot start failed on this rank: report it
                log.error("could not start %s op %d: %s", op.kind.name, op.op_id, exc)
                if op.kind in (OpKind.BACKUP, OpKind.LOAD):
                    # The core named pages the pools refuse: a bug, not an I/O fault. Close.
                    self.health_bits |= HEALTH_IO_ERROR
                else:
                    self.storage_errors += 1  # storage trouble is a miss or a failed write, agreed as such
                del self.running[op.op_id]
                self.results[op.op_id] = 0

    def landed(self) -> Mapping[int, int]:
        self._collect()
        return self.results

    def retire(self, ops: Sequence[Transfer]) -> None:
        for op in ops:
            self.results.pop(op.op_id, None)
            self.handles.pop(op.op_id, None)

    def health(self) -> int:
        return self.health_bits

    def drained(self) -> bool:
        """No copy is physically in flight on this rank (as of the last ``landed``)."""
        return not self.running

    def reset(self) -> None:
        """After an agreed flush: nothing is in flight (that is what 'drained' agreed)."""
        self._collect()
        self.results.clear()
        self.handles.clear()
        self.health_bits = 0

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        if self.storage is not None:
            self.storage.close()

    # ------------------------------------------------------------------ internals

    def _start(self, op: Transfer) -> None:
        assert self.transfer is not None
        if op.kind == OpKind.BACKUP:
            self.transfer.submit_backup(op.op_id, op.device_pages, op.host_slots)
        elif op.kind == OpKind.LOAD:
            self.handles[op.op_id] = self.transfer.submit_load(op.op_id, op.host_slots, op.device_pages)
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

    def _collect(self) -> None:
        """Record every op that finished since the last look (local knowledge, agreed later)."""
        if self.transfer is not None:
            for c in self.transfer.finished():
                op = self.running.pop(c.op_id, None)
                if op is not None:
                    self.results[c.op_id] = op.num_pages if c.ok else 0
                    if not c.ok:
                        log.warning("copy op %d (%s) failed on this rank: %s", c.op_id, c.direction, c.error)
        if self.storage is not None:
            for s in self.storage.poll():
                if self.running.pop(s.op_id, None) is None:
                    continue
                landed = 0
                for ok in s.results:  # only the leading pages count: the tier stays prefix-closed
                    if not ok:
                        break
                    landed += 1
                self.results[s.op_id] = landed


def storage_key_factory(namespace: str, layout_version: int, rank: int, world: int) -> Callable[[int], StorageKey]:
    def key_of(page_hash: int) -> StorageKey:
        return StorageKey(namespace, layout_version, rank, world, page_hash)

    return key_of
