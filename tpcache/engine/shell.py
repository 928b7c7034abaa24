"""The shell: one rank's real I/O, as the driver sees it (``driver.IO``).

It is the only place that touches KV tensors and storage. It starts the core's ops on the transfer
engine and the storage worker and records, by op id, how many leading pages of each landed on this
rank: local knowledge that the round turns into agreed completions. It forgets an op when the round
retires it.

A hybrid model's components each have their own pools and transfer engine (``PartIO``); an op's
component copies start beside its full-page copy, under the same op id, and the op counts as landed
on this rank only when every one of them did. In storage, a component's data lives under its own
keys (its layout version names the component), so a lookup or read of a node covers each key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from protocol.round_vector import HEALTH_IO_ERROR, HEALTH_STORAGE_DOWN
from tpcache.comm.parallel import Shard
from tpcache.core.records import OpKind, Transfer
from tpcache.io.kv_pool import HostPool
from tpcache.io.storage import StorageKey, StorageWorker
from tpcache.io.transfer import LoadHandle, TransferEngine

log = logging.getLogger("tpcache.shell")


@dataclass
class PartIO:
    """One component's I/O: its transfer engine (over its device and host pools) and storage keys."""

    transfer: TransferEngine
    host_pool: HostPool
    key_of: Callable[[int], StorageKey] | None = None
    window: bool = False  # sliding-window data (a key per page) rather than a recurrent state


class Shell:
    """One rank's I/O. ``transfer`` None means metadata only: copies land at once."""

    def __init__(
        self,
        transfer: TransferEngine | None = None,
        host_pool: HostPool | None = None,
        storage: StorageWorker | None = None,
        key_of: Callable[[int], StorageKey] | None = None,
        parts: Mapping[int, PartIO] | None = None,
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
        self.parts: dict[int, PartIO] = dict(parts or {})
        self.part_handles: dict[int, list[LoadHandle]] = {}  # component loads, by op id
        self.copies_left: dict[int, int] = {}  # op id -> copies (full and components) not finished
        self.copies_ok: dict[int, bool] = {}
        self.storage_layout: dict[int, list[tuple[int, int]]] = {}  # op id -> (node, component) per key

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
                self.copies_left.pop(op.op_id, None)
                self.copies_ok.pop(op.op_id, None)
                self.storage_layout.pop(op.op_id, None)
                self.results[op.op_id] = 0

    def landed(self) -> Mapping[int, int]:
        self._collect()
        return self.results

    def retire(self, ops: Sequence[Transfer]) -> None:
        for op in ops:
            self.results.pop(op.op_id, None)
            self.handles.pop(op.op_id, None)
            self.part_handles.pop(op.op_id, None)

    def health(self) -> int:
        if self.storage is not None and self.storage.unusable() is not None:
            return self.health_bits | HEALTH_STORAGE_DOWN  # not a closing bit: storage goes off everywhere
        return self.health_bits

    def drained(self) -> bool:
        """No copy is physically in flight on this rank (as of the last ``landed``)."""
        return not self.running

    def reset(self) -> None:
        """After an agreed flush: nothing is in flight (that is what 'drained' agreed)."""
        self._collect()
        self.results.clear()
        self.handles.clear()
        self.part_handles.clear()
        self.health_bits = 0

    def close(self) -> None:
        for part in self.parts.values():
            part.transfer.close()
        if self.transfer is not None:
            self.transfer.close()
        if self.storage is not None:
            self.storage.close()

    # ------------------------------------------------------------------ internals

    def _start(self, op: Transfer) -> None:
        assert self.transfer is not None
        if op.kind in (OpKind.BACKUP, OpKind.LOAD):
            copies = [(self.transfer, op.device_pages, op.host_slots)] if op.device_pages or not op.parts else []
            for pc in op.parts:
                copies.append((self.parts[pc.part].transfer, pc.device, pc.host))
            self.copies_left[op.op_id] = len(copies)
            self.copies_ok[op.op_id] = True
            for k, (engine, device, host) in enumerate(copies):
                if op.kind == OpKind.BACKUP:
                    engine.submit_backup(op.op_id, device, host)
                    continue
                handle = engine.submit_load(op.op_id, host, device)
                if k == 0 and engine is self.transfer:
                    self.handles[op.op_id] = handle
                else:
                    self.part_handles.setdefault(op.op_id, []).append(handle)
            return
        if self.storage is None:
            raise RuntimeError(f"{op.kind.name} issued without a storage tier")
        assert self.host_pool is not None and self.key_of is not None
        if op.kind == OpKind.STORAGE_QUERY:
            keys = [self.key_of(h) for h in op.page_hashes]
            if op.query is not None:
                keys += self._query_keys(op)
            self.storage.submit_exists(op.op_id, keys)
            return
        keys, views, layout = [], [], []
        for i, node_slot in zip(op.full_index or range(op.num_pages), op.host_slots, strict=True):
            keys.append(self.key_of(op.page_hashes[i]))
            views.append(self.host_pool.page_view(node_slot))
            layout.append((i, 0))
        for pc in op.parts:
            part = self.parts[pc.part]
            assert part.key_of is not None
            for i, slot in zip(pc.index, pc.host, strict=True):
                keys.append(part.key_of(op.page_hashes[i]))
                views.append(part.host_pool.page_view(slot))
                layout.append((i, pc.part))
        if op.parts or op.full_index is not None:
            self.storage_layout[op.op_id] = layout
        if op.kind == OpKind.STORAGE_WRITE:
            self.storage.submit_put(op.op_id, keys, views)
        else:
            self.storage.submit_get(op.op_id, keys, views)

    def _query_keys(self, op: Transfer) -> list[StorageKey]:
        """A hybrid lookup's component keys: every page's SWA key, then the state keys where a state
        may be kept (see ``hitrule.QueryPlan``)."""
        plan = op.query
        assert plan is not None
        keys: list[StorageKey] = []
        window, state = self._window_io(), self._state_io()
        if plan.window and window is not None:
            keys += [window.key_of(h) for h in op.page_hashes]  # type: ignore[misc]
        if plan.state and state is not None:
            keys += [state.key_of(h) for h, kept in zip(op.page_hashes, plan.state_pages, strict=True) if kept]  # type: ignore[misc]
        return keys

    def _window_io(self) -> PartIO | None:
        return next((p for p in self.parts.values() if p.window), None)

    def _state_io(self) -> PartIO | None:
        return next((p for p in self.parts.values() if not p.window), None)

    def _collect(self) -> None:
        """Record every op that finished since the last look (local knowledge, agreed later)."""
        engines = [self.transfer] + [p.transfer for p in self.parts.values()] if self.transfer is not None else []
        for engine in engines:
            for c in engine.finished():
                op = self.running.get(c.op_id)
                if op is None:
                    continue
                if not c.ok:
                    self.copies_ok[c.op_id] = False
                    log.warning("copy op %d (%s) failed on this rank: %s", c.op_id, c.direction, c.error)
                self.copies_left[c.op_id] -= 1
                if self.copies_left[c.op_id] == 0:
                    del self.running[c.op_id], self.copies_left[c.op_id]
                    self.results[c.op_id] = op.num_pages if self.copies_ok.pop(c.op_id) else 0
        if self.storage is not None:
            for s in self.storage.poll():
                op = self.running.pop(s.op_id, None)
                if op is None:
                    continue
                layout = self.storage_layout.pop(s.op_id, None)
                if op.kind == OpKind.STORAGE_QUERY and op.query is not None:
                    self.results[s.op_id] = self._query_answer(op, s.results)
                    continue
                if layout is not None:  # a node landed when every key of it did
                    ok = [True] * op.num_pages
                    for (i, _), good in zip(layout, s.results, strict=True):
                        ok[i] = ok[i] and good
                    results: Sequence[bool] = ok
                else:
                    results = s.results
                landed = 0
                for good in results:  # only the leading pages count: the tier stays prefix-closed
                    if not good:
                        break
                    landed += 1
                self.results[s.op_id] = landed

    def _query_answer(self, op: Transfer, found: Sequence[bool]) -> int:
        """This rank's storage hit of a hybrid lookup: the hit rule over the keys it found."""
        plan = op.query
        assert plan is not None
        n = op.num_pages
        full = next((i for i, good in enumerate(found[:n]) if not good), n)
        rest = list(found[n:])
        swa = rest[:n] if plan.window else []
        kept = rest[n:] if plan.window else rest
        states, it = [], iter(kept)
        for may in plan.state_pages:
            states.append(bool(next(it)) if may else False)
        return plan.answer(full, swa, states)


def storage_key_factory(namespace: str, layout_version: int, shard: Shard) -> Callable[[int], StorageKey]:
    """The storage key of this rank's slice (``shard``: tensor rank, stage, context rank) of a page."""

    def key_of(page_hash: int) -> StorageKey:
        return StorageKey.of(namespace, layout_version, shard, page_hash)

    return key_of
