"""Backups: the write policies, the backlog, storage write-out and mirror release.

- write_through: a page is backed up to host when inserted (host includes device, so evicting a
  device page that has its host copy is free);
- write_through_selective: once a page has ``write_through_threshold`` hits;
- write_back: when a dirty page is evicted from device (``Evictor`` calls ``back_up``);
- no host tier: nothing is backed up.
A page that finds no host slot waits in the agreed backlog (``Ledger.backup_backlog``), retried each
round only as far as slots can be freed; its length is the host deficit the round agrees on. With a
storage tier, every host copy that lands is written to storage, durable once every rank acked.
Mirror release frees host copies of pages that are on device and durable in storage under host
pressure, by a plan every rank agreed on.

Components move with their node: a backup, a storage write-out copies every component copy of the
node that is on the source tier and missing on the target, in the same op (so it lands, or fails,
with the node). A component copy on host needs the node's full host copy, so a component is backed
up alone only once its full page's host copy is valid. Each component pool has its own backlog (its
length is that component's host deficit) and its own share of mirror release.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from tpcache.core.digest import mix_ids
from tpcache.core.outbox import Outbox
from tpcache.core.plans import Plan
from tpcache.core.records import OpKind
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.treecore import TreeCore
from tpcache.core.treecore.components import DEV, HOST, STORE, Part
from tpcache.core.treecore.core import ROOT
from tpcache.core.treecore.eviction import Evictor
from tpcache.core.treecore.part_eviction import PartEvictor

if TYPE_CHECKING:
    from protocol.round_vector import Agreement


_VALID = int(DeviceState.VALID)
_HVALID = int(HostState.VALID)
_DURABLE = int(StorageState.DURABLE)
_NONE = int(HostState.NONE)  # NONE is 0 on every tier


def _wants_backup(core: TreeCore, node_id: int, p: Part) -> bool:
    """The node's component data is valid on device and has no host copy."""
    rec = core.component(node_id) if node_id != ROOT else None
    return rec is not None and rec[p.base + DEV] == _VALID and not rec[p.base + HOST]


class Backup:
    def __init__(self, core: TreeCore, evictor: Evictor, outbox: Outbox, parts: PartEvictor) -> None:
        self.core = core
        self.ledger = ledger = core.ledger  # pools, backlogs and counters (no node is read through it)
        self.evictor = evictor
        self.outbox = outbox
        self.part_evictor = parts
        config = ledger.config
        self.policy = config.write_policy if config.host_pages else "none"
        self.threshold = config.write_through_threshold
        self.storage = config.storage
        self.buffer = config.host_mode == "buffer"  # host only stages: a page durable in storage needs no copy
        self.enabled = True  # a closed cache starts no copies (it does not trust its own state)
        self.storage_down = False  # agreed: a rank's storage can no longer be used (``storage_lost``)
        self.down_from_op = 0  # the first op id issued with storage down (no storage op from it on)

    # ------------------------------------------------------------------ write policies

    def on_insert(self, ids: list[int]) -> None:
        if self.policy == "write_through":
            self.back_up(ids)

    def on_hit(self, ids: list[int]) -> None:
        if self.policy == "write_through_selective":
            hits = self.core.hit_counts(ids)
            self.back_up([i for i, h in zip(ids, hits, strict=True) if h >= self.threshold])

    def back_up(self, ids: list[int]) -> None:
        """Back up device-VALID pages that have no host copy, in the order given.

        Tiers are closed cumulatively (a host copy needs its parent on device or host), and every
        page backed up is on device, so each page can go on its own: no chain of ancestors, and no
        wait on a parent's copy in flight. Pages that find no host slot wait in the backlog."""
        led = self.ledger
        if not self.enabled or not led.host.num_pages:
            return
        core = self.core
        todo: list[int] = []
        seen: set[int] = set()
        for node_id, (device, host, storage) in zip(ids, core.tier_states(ids), strict=True):
            if (
                node_id in seen
                or node_id == ROOT
                or host != _NONE
                or device != _VALID
                or (self.buffer and storage != _NONE)
            ):
                continue
            seen.add(node_id)
            todo.append(node_id)
        if not todo and not led.parts:
            return
        todo = self._full_slots(todo)
        if led.parts:
            self._back_up_parts(todo, ids)
            return
        if not todo:
            return
        self.outbox.issue(OpKind.BACKUP, todo, -1)
        led.stats.backups_issued_pages += len(todo)

    def _full_slots(self, todo: list[int]) -> list[int]:
        """Host slots for the full pages of ``todo`` (oldest first); the rest wait in the backlog."""
        core, led = self.core, self.ledger
        slots = self.evictor.alloc_host_upto(len(todo)) if todo else []
        for node_id in todo[len(slots) :]:
            if node_id not in led.backup_backlog:
                led.backup_backlog[node_id] = node_id
            led.stats.backup_deferred_host_full += 1
        for node_id, slot in zip(todo, slots, strict=False):
            led.backup_backlog.pop(node_id, None)  # backed up by another path: no longer waiting
            core.update(node_id, host=(HostState.WRITING, slot))
        return todo[: len(slots)]

    def _back_up_parts(self, todo: list[int], ids: list[int]) -> None:
        """The backup op of a hybrid model: the full pages ``todo`` (their slots taken), each node's
        component copies with it, and component copies of nodes whose full host copy is valid."""
        core, led = self.core, self.ledger
        moving = set(todo)
        hosts = core.tier_states(ids)
        rest = dict.fromkeys(
            i for i, (_, host, _) in zip(ids, hosts, strict=True) if i not in moving and host == _HVALID
        )
        order = order_ids = list(todo) + list(rest)
        parts: dict[int, list[int]] = {}
        for p in led.parts.values():
            want = [i for i, node_id in enumerate(order_ids) if _wants_backup(core, node_id, p)]
            slots = self.part_evictor.alloc_host_upto(p, len(want)) if want and p.host.num_pages else []
            for i in want[len(slots) :]:
                p.backlog.setdefault(order_ids[i], order_ids[i])
            for i, slot in zip(want, slots, strict=False):
                p.backlog.pop(order_ids[i], None)
                # the op reads it
                core.update(order_ids[i], part=p.index, host=(HostState.WRITING, slot), device_pins=+1)
            if slots:
                parts[p.index] = want[: len(slots)]
        used = sorted({*range(len(todo)), *(i for index in parts.values() for i in index)})
        if not used:
            return
        at = {i: k for k, i in enumerate(used)}
        full_index = None if len(used) == len(todo) else list(range(len(todo)))
        op_parts = {c: [at[i] for i in index] for c, index in parts.items()}
        self.outbox.issue(OpKind.BACKUP, [order[i] for i in used], -1, full_index=full_index, parts=op_parts)
        led.stats.backups_issued_pages += len(todo)
        led.stats.part_backups_issued += sum(len(index) for index in parts.values())

    def retry_backlog(self) -> None:
        """Once per commit: make room (free slots, then host evictions, as a retry of the whole
        backlog would), then retry only as many pages as found a slot, oldest first. A full host
        tier with nothing to evict costs a round nothing however long the backlog grows."""
        core, led = self.core, self.ledger
        backlog = led.backup_backlog
        if not backlog or not self.enabled:
            return
        short = len(backlog) - led.host.available
        if short > 0:
            self.evictor.evict_host(short)
        retry: list[int] = []
        while backlog and len(retry) < led.host.available:
            for node_id in list(itertools.islice(backlog, led.host.available - len(retry))):
                del backlog[node_id]
                if core.device(node_id)[0] == _VALID and core.host(node_id)[0] == _NONE:
                    retry.append(node_id)
        self.back_up(retry)

    def retry_part_backlogs(self) -> None:
        """Once per commit, per component: retry as many waiting component backups as slots can be
        freed for; those whose full host copy is still being written wait on."""
        if not self.enabled:
            return
        core = self.core
        retry: list[int] = []
        for p in self.ledger.parts.values():
            if not p.backlog:
                continue
            short = len(p.backlog) - p.host.available
            if short > 0:
                self.part_evictor.evict_host(p, short)
            for node_id in list(p.backlog)[: max(0, p.host.available)]:
                if not _wants_backup(core, node_id, p):
                    del p.backlog[node_id]
                elif core.host(node_id)[0] == _HVALID:
                    retry.append(node_id)
        if retry:
            self.back_up(list(dict.fromkeys(retry)))

    # ------------------------------------------------------------------ storage write-out

    def store(self, ids: list[int]) -> None:
        """Write host-VALID pages to storage; durable only once every rank acked (agreed)."""
        if not self.storage or not self.enabled:
            return
        states = self.core.tier_states(ids)
        todo = [i for i, (_, host, storage) in zip(ids, states, strict=True) if host == _HVALID and storage == _NONE]
        if self.ledger.parts:
            self._store_hybrid(todo, ids)
            return
        if not todo:
            return
        self.core.settle(todo, storage=StorageState.WRITING, host_pins=+1)  # the op reads the slot
        self.outbox.issue(OpKind.STORAGE_WRITE, todo, -1)
        self.ledger.stats.storage_write_issued_pages += len(todo)

    def _store_hybrid(self, todo: list[int], ids: list[int]) -> None:
        core, led = self.core, self.ledger
        moving = set(todo)
        others = list(dict.fromkeys(ids))
        hosts = core.tier_states(others)
        order = order_ids = todo + [
            i for i, (_, host, _) in zip(others, hosts, strict=True) if i not in moving and host == _HVALID
        ]
        recs = [core.component(i) for i in order_ids]
        parts: dict[int, list[int]] = {}
        for p in led.parts.values():
            b = p.base
            index = [i for i, rec in enumerate(recs) if rec[b + HOST] == _HVALID and not rec[b + STORE]]  # type: ignore[index]
            for i in index:
                core.update(order_ids[i], part=p.index, storage=StorageState.WRITING, host_pins=+1)
            if index:
                parts[p.index] = index
        used = sorted({*range(len(todo)), *(i for index in parts.values() for i in index)})
        if not used:
            return
        for node_id in order_ids[: len(todo)]:
            core.update(node_id, storage=StorageState.WRITING, host_pins=+1)
        at = {i: k for k, i in enumerate(used)}
        full_index = None if len(used) == len(todo) else list(range(len(todo)))
        op_parts = {c: [at[i] for i in index] for c, index in parts.items()}
        self.outbox.issue(OpKind.STORAGE_WRITE, [order[i] for i in used], -1, full_index=full_index, parts=op_parts)
        led.stats.storage_write_issued_pages += len(todo)

    def storage_lost(self) -> int:
        """Agreed (the round's ``storage_down``): a rank's storage tier can no longer be used, so a
        page stored there can no longer be read on every rank. Storage is off from here on, alike
        on every rank: no write-out, and no page counts as durable (a host mirror of one is no
        longer redundant; a page only in storage is gone); writes in flight land as failures, a read
        in flight lands on host but not as durable, and the prefetcher looks nothing up and reads
        nothing (a fetch under way stops at its next step). Returns the pages forgotten. A flush
        starts over with storage on; a rank whose storage is still unusable says so again in the
        next round."""
        if self.storage_down:
            return 0
        self.storage_down = True
        self.storage = False
        self.down_from_op = self.outbox.next_op
        core, led = self.core, self.ledger
        forgotten = 0
        for node_id in core.ids():  # id order: the same changes in the same order on every rank
            if not core.exists(node_id):
                continue  # removed with a descendant just now
            rec = core.component(node_id)
            for p in led.parts.values():
                if rec is not None and rec[p.base + STORE] == _DURABLE:
                    core.update(node_id, part=p.index, storage=StorageState.NONE)
            if core.storage(node_id) == _DURABLE:
                core.update(node_id, storage=StorageState.NONE)
                forgotten += 1
                core.remove_if_empty(node_id)
        return forgotten

    # ------------------------------------------------------------------ mirror release

    def release_mirror(self, node_id: int) -> bool:
        if not self.core.mirror_releasable(node_id):
            return False
        self.core.free_host_copy(node_id)
        self.core.stats.mirrors_released_pages += 1
        return True


class MirrorRelease:
    """Release redundant host mirrors under host pressure, as an agreed plan.

    When the ranks agree the host pool fell short (``host_deficit``, the minimum over ranks), release
    up to that many mirrors, least valuable first, so backups and storage write-out can proceed."""

    name = "mirror_release"

    def __init__(self, backup: Backup) -> None:
        self.backup = backup

    def prepare(self, agreement: Agreement) -> Plan | None:
        want = agreement.lo["host_deficit"]
        core, led = self.backup.core, self.backup.ledger
        if want <= 0 and not led.parts:  # the common case: no pool short of slots
            return None
        ids = core.releasable_mirrors(want) if want > 0 else []
        parts: list[int] = [0] * len(ids)
        for p in led.parts.values():  # each component pool's own deficit, from its own mirrors
            short = agreement.lo[f"host_deficit.{p.name}"]
            if short > 0:
                found = core.releasable_part_mirrors(p.index, short)
                ids += found
                parts += [p.index] * len(found)
        if not ids:
            return None
        hashes = [h & ((1 << 63) - 1) for h in core.page_hashes(ids)]
        digest = mix_ids(ids + hashes + (parts if led.parts else []))
        return Plan(self.name, ids, len(ids) * led.page_size, digest, parts if led.parts else [])

    def execute(self, plan: Plan) -> int:
        """Re-checks every page: a plan that went stale between the rounds does less, never wrong."""
        core = self.backup.core
        released = 0
        for k, node_id in enumerate(plan.node_ids):
            c = plan.parts[k] if plan.parts else 0
            if not core.exists(node_id):
                continue
            if c == 0 and self.backup.release_mirror(node_id):
                released += 1
            elif c and core.part_mirror_releasable(node_id, c):
                core.free_part_host(node_id, c)
                core.stats.mirrors_released_pages += 1
                released += 1
        return released
