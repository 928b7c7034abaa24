"""Ops in flight and the Ready batch of effects.

Every op gets one id at issue and keeps it until the round retires it. Ops wait in one completion
queue per kind, in issue order: the round agrees how many finished at the head of each queue and
only those are applied, so ranks whose copies finish in different orders still apply the same
completions. What the driver must act on collects here until it takes a ``Ready`` and advances.
"""

from __future__ import annotations

from collections import deque

from tpcache.core.hitrule import QueryPlan
from tpcache.core.records import OpKind, PartCopy, Ready, ReadyNotAdvanced, Transfer
from tpcache.core.treecore import TreeCore
from tpcache.core.treecore.components import DSLOT, HSLOT


class Outbox:
    def __init__(self, core: TreeCore) -> None:
        self.core = core
        self.next_op = 1
        self.inflight: dict[OpKind, deque[Transfer]] = {k: deque() for k in OpKind}
        self._ready = Ready()
        self._handed_out = False

    def issue(
        self,
        kind: OpKind,
        nodes: list[int],
        lease_id: int,
        page_hashes: list[int] | None = None,
        *,
        full_index: list[int] | None = None,
        parts: dict[int, list[int]] | None = None,
        query: QueryPlan | None = None,
        engine_pages: list[int] | None = None,
    ) -> Transfer:
        """A new op over the nodes ``nodes`` names (their slots as they are now). ``full_index``: the positions whose
        full page it moves (None: all); ``parts``: per component, the positions whose data it moves;
        ``engine_pages``: its device side is these engine blocks instead (full attention only)."""
        core = self.core
        ids = list(nodes)
        device_pages, host_slots, hashes = core.copy_sides(ids, full_index)
        op = Transfer(
            op_id=self.next_op,
            kind=kind,
            nodes=ids,
            device_pages=device_pages if engine_pages is None else list(engine_pages),
            host_slots=host_slots,
            page_hashes=hashes if page_hashes is None else list(page_hashes),
            lease_id=lease_id,
            full_index=full_index,
            query=query,
            engine_pages=engine_pages is not None,
        )
        for c, index in (parts or {}).items():
            base = core.ledger.parts[c].base
            recs = [core.component(ids[i]) for i in index]
            dev = [r[base + DSLOT] for r in recs]  # type: ignore[index]
            op.parts.append(PartCopy(c, index, dev, [r[base + HSLOT] for r in recs]))  # type: ignore[index]
        self.next_op += 1
        if kind in (OpKind.BACKUP, OpKind.STORAGE_WRITE):
            # A copy in flight protects the device pages along its pages' paths until its ack: they
            # stay, and count as protected rather than evictable meanwhile (the retention cap holds).
            op.pinned = core.path_on_device(ids)
            if op.pinned:
                core.touch(op.pinned, +1)  # let go of with touch(-1) at its ack (completions)
        self.inflight[kind].append(op)
        self._ready.transfers.append(op)
        return op

    def retire_head(self, kind: OpKind, acked: int) -> Transfer:
        """Remove the head op of ``kind`` with ``acked`` leading pages agreed landed."""
        op = self.inflight[kind].popleft()
        op.acked = acked
        self._ready.retired.append(op)
        return op

    def released(self, lease_id: int) -> None:
        self._ready.released.append(lease_id)

    def busy(self) -> bool:
        return any(self.inflight.values())

    # ------------------------------------------------------------------ Ready / Advance

    def ready(self) -> Ready:
        if self._handed_out:
            raise ReadyNotAdvanced("ready() called again before advance(): act on the last Ready first")
        self._handed_out = True
        return self._ready

    def advance(self) -> None:
        if not self._handed_out:
            raise ReadyNotAdvanced("advance() without a ready() to acknowledge")
        self._handed_out = False
        self._ready = Ready()

    def has_ready(self) -> bool:
        return bool(self._ready)
