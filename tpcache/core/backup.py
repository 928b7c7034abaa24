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
from tpcache.core.treecore.accounting import is_mirror
from tpcache.core.treecore.components import DEV, HOST, HPINS, STORE, Part, host_parts_releasable, is_part_mirror
from tpcache.core.treecore.eviction import Evictor
from tpcache.core.treecore.ledger import Ledger
from tpcache.core.treecore.part_eviction import PartEvictor
from tpcache.core.treecore.tree import Node

if TYPE_CHECKING:
    from protocol.round_vector import Agreement


_VALID = int(DeviceState.VALID)
_HVALID = int(HostState.VALID)
_DURABLE = int(StorageState.DURABLE)


def _wants_backup(node: Node, p: Part) -> bool:
    """The node's component data is valid on device and has no host copy."""
    rec = node.comp
    return rec is not None and node.parent is not None and rec[p.base + DEV] == _VALID and not rec[p.base + HOST]


class Backup:
    def __init__(self, ledger: Ledger, evictor: Evictor, outbox: Outbox, parts: PartEvictor) -> None:
        self.ledger = ledger
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

    def on_insert(self, nodes: list[Node]) -> None:
        if self.policy == "write_through":
            self.back_up(nodes)

    def on_hit(self, nodes: list[Node]) -> None:
        if self.policy == "write_through_selective":
            self.back_up([n for n in nodes if n.hits >= self.threshold])

    def back_up(self, nodes: list[Node]) -> None:
        """Back up device-VALID pages that have no host copy, in the order given.

        Tiers are closed cumulatively (a host copy needs its parent on device or host), and every
        page backed up is on device, so each page can go on its own: no chain of ancestors, and no
        wait on a parent's copy in flight. Pages that find no host slot wait in the backlog."""
        led = self.ledger
        if not self.enabled or not led.host.num_pages:
            return
        todo: list[Node] = []
        seen: set[int] = set()
        for node in nodes:
            if (
                node.node_id in seen
                or node.parent is None
                or node.host_state != HostState.NONE
                or node.device_state != DeviceState.VALID
                or (self.buffer and node.storage_state != StorageState.NONE)
            ):
                continue
            seen.add(node.node_id)
            todo.append(node)
        if not todo and not led.parts:
            return
        todo = self._full_slots(todo)
        if led.parts:
            self._back_up_parts(todo, nodes)
            return
        if not todo:
            return
        self.outbox.issue(OpKind.BACKUP, todo, -1)
        led.stats.backups_issued_pages += len(todo)

    def _full_slots(self, todo: list[Node]) -> list[Node]:
        """Host slots for the full pages of ``todo`` (oldest first); the rest wait in the backlog."""
        led = self.ledger
        slots = self.evictor.alloc_host_upto(len(todo)) if todo else []
        for node in todo[len(slots) :]:
            if node.node_id not in led.backup_backlog:
                led.backup_backlog[node.node_id] = node
            led.stats.backup_deferred_host_full += 1
        for node, slot in zip(todo, slots, strict=False):
            led.backup_backlog.pop(node.node_id, None)  # backed up by another path: no longer waiting
            led.update(node, host=(HostState.WRITING, slot))
        return todo[: len(slots)]

    def _back_up_parts(self, todo: list[Node], nodes: list[Node]) -> None:
        """The backup op of a hybrid model: the full pages ``todo`` (their slots taken), each node's
        component copies with it, and component copies of nodes whose full host copy is valid."""
        led = self.ledger
        moving = {n.node_id for n in todo}
        rest = dict.fromkeys(n for n in nodes if n.node_id not in moving and n.host_state == HostState.VALID)
        order = list(todo) + list(rest)
        parts: dict[int, list[int]] = {}
        for p in led.parts.values():
            want = [i for i, n in enumerate(order) if _wants_backup(n, p)]
            slots = self.part_evictor.alloc_host_upto(p, len(want)) if want and p.host.num_pages else []
            for i in want[len(slots) :]:
                p.backlog.setdefault(order[i].node_id, order[i])
            for i, slot in zip(want, slots, strict=False):
                p.backlog.pop(order[i].node_id, None)
                led.update(order[i], part=p.index, host=(HostState.WRITING, slot), device_pins=+1)  # the op reads it
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
        led = self.ledger
        backlog = led.backup_backlog
        if not backlog or not self.enabled:
            return
        short = len(backlog) - led.host.available
        if short > 0:
            self.evictor.evict_host(short)
        retry: list[Node] = []
        while backlog and len(retry) < led.host.available:
            for node_id in list(itertools.islice(backlog, led.host.available - len(retry))):
                node = backlog.pop(node_id)
                if node.device_state == DeviceState.VALID and node.host_state == HostState.NONE:
                    retry.append(node)
        self.back_up(retry)

    def retry_part_backlogs(self) -> None:
        """Once per commit, per component: retry as many waiting component backups as slots can be
        freed for; those whose full host copy is still being written wait on."""
        if not self.enabled:
            return
        retry: list[Node] = []
        for p in self.ledger.parts.values():
            if not p.backlog:
                continue
            short = len(p.backlog) - p.host.available
            if short > 0:
                self.part_evictor.evict_host(p, short)
            for node_id, node in list(p.backlog.items())[: max(0, p.host.available)]:
                if not _wants_backup(node, p):
                    del p.backlog[node_id]
                elif node.host_state == HostState.VALID:
                    retry.append(node)
        if retry:
            self.back_up(list({n.node_id: n for n in retry}.values()))

    # ------------------------------------------------------------------ storage write-out

    def store(self, nodes: list[Node]) -> None:
        """Write host-VALID pages to storage; durable only once every rank acked (agreed)."""
        if not self.storage or not self.enabled:
            return
        todo = [n for n in nodes if n.host_state == HostState.VALID and n.storage_state == StorageState.NONE]
        if self.ledger.parts:
            self._store_hybrid(todo, nodes)
            return
        if not todo:
            return
        self.ledger.settle(todo, storage=StorageState.WRITING, host_pins=+1)  # the op reads the slot
        self.outbox.issue(OpKind.STORAGE_WRITE, todo, -1)
        self.ledger.stats.storage_write_issued_pages += len(todo)

    def _store_hybrid(self, todo: list[Node], nodes: list[Node]) -> None:
        led = self.ledger
        moving = {n.node_id for n in todo}
        order = todo + [n for n in dict.fromkeys(nodes) if n.node_id not in moving and n.host_state == HostState.VALID]
        parts: dict[int, list[int]] = {}
        for p in led.parts.values():
            b = p.base
            index = [i for i, n in enumerate(order) if n.comp[b + HOST] == _HVALID and not n.comp[b + STORE]]  # type: ignore[index]
            for i in index:
                led.update(order[i], part=p.index, storage=StorageState.WRITING, host_pins=+1)
            if index:
                parts[p.index] = index
        used = sorted({*range(len(todo)), *(i for index in parts.values() for i in index)})
        if not used:
            return
        for node in todo:
            led.update(node, storage=StorageState.WRITING, host_pins=+1)
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
        led = self.ledger
        forgotten = 0
        nodes = led.tree.nodes
        for node_id in sorted(nodes):  # id order: the same changes in the same order on every rank
            node = nodes.get(node_id)
            if node is None:
                continue
            rec = node.comp
            for p in led.parts.values():
                if rec is not None and rec[p.base + STORE] == _DURABLE:
                    led.update(node, part=p.index, storage=StorageState.NONE)
            if node.storage_state == StorageState.DURABLE:
                led.update(node, storage=StorageState.NONE)
                forgotten += 1
                led.remove_if_empty(node)
        return forgotten

    # ------------------------------------------------------------------ mirror release

    @staticmethod
    def is_releasable_mirror(node: Node) -> bool:
        """A host copy of a page that is also on device and durable in storage: redundant."""
        return (
            node.parent is not None
            and is_mirror(node)
            and node.host_pins == 0
            # a child only on host needs this page's device copy kept (it would become unevictable)
            and not any(c.on_host and not c.on_device for c in node.children.values())
            # its component copies on host go with it: only if each is a redundant mirror too
            and (node.comp is None or host_parts_releasable(node))
        )

    def release_mirror(self, node: Node) -> bool:
        if not self.is_releasable_mirror(node):
            return False
        self.ledger.free_host_copy(node)
        self.ledger.stats.mirrors_released_pages += 1
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
        led = self.backup.ledger
        if want <= 0 and not led.parts:  # the common case: no pool short of slots
            return None
        chosen: list[Node] = []
        if want > 0 and led.mirrors:
            # the mirror index holds every page that could qualify; the sort makes its order irrelevant
            candidates = [n for n in led.mirrors.values() if self.backup.is_releasable_mirror(n)]
            candidates.sort(key=self.backup.evictor.candidates.policy.key)
            chosen = candidates[:want]
        parts: list[int] = [0] * len(chosen)
        for p in led.parts.values():  # each component pool's own deficit, from its own mirrors
            short = agreement.lo[f"host_deficit.{p.name}"]
            if short > 0 and p.mirrors:
                found = sorted((n for n in p.mirrors.values() if _releasable_part(n, p)), key=p.key)[:short]
                chosen += found
                parts += [p.index] * len(found)
        if not chosen:
            return None
        ids = [n.node_id for n in chosen]
        hashes = [n.hash & ((1 << 63) - 1) for n in chosen]
        digest = mix_ids(ids + hashes + (parts if led.parts else []))
        return Plan(self.name, ids, len(ids) * led.page_size, digest, parts if led.parts else [])

    def execute(self, plan: Plan) -> int:
        """Re-checks every page: a plan that went stale between the rounds does less, never wrong."""
        led = self.backup.ledger
        released = 0
        for k, node_id in enumerate(plan.node_ids):
            node = led.tree.nodes.get(node_id)
            c = plan.parts[k] if plan.parts else 0
            if node is None:
                continue
            if c == 0 and self.backup.release_mirror(node):
                released += 1
            elif c and _releasable_part(node, led.parts[c]):
                led.free_part_host(node, led.parts[c])
                led.stats.mirrors_released_pages += 1
                released += 1
        return released


def _releasable_part(node: Node, p: Part) -> bool:
    """A component's host copy that is also on device and durable, and unpinned: redundant."""
    rec = node.comp
    return rec is not None and is_part_mirror(rec, p.base) and rec[p.base + HPINS] == 0
