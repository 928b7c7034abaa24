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
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from tpcache.core.digest import mix_ids
from tpcache.core.eviction import Evictor
from tpcache.core.ledger import Ledger, is_mirror
from tpcache.core.outbox import Outbox
from tpcache.core.plans import Plan
from tpcache.core.records import OpKind
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.tree import Node

if TYPE_CHECKING:
    from protocol.round_vector import Agreement


class Backup:
    def __init__(self, ledger: Ledger, evictor: Evictor, outbox: Outbox) -> None:
        self.ledger = ledger
        self.evictor = evictor
        self.outbox = outbox
        config = ledger.config
        self.policy = config.write_policy if config.host_pages else "none"
        self.threshold = config.write_through_threshold
        self.storage = config.storage
        self.enabled = True  # a closed cache starts no copies (it does not trust its own state)

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
            ):
                continue
            seen.add(node.node_id)
            todo.append(node)
        if not todo:
            return
        slots = self.evictor.alloc_host_upto(len(todo))
        for node in todo[len(slots) :]:
            if node.node_id not in led.backup_backlog:
                led.backup_backlog[node.node_id] = node
            led.stats.backup_deferred_host_full += 1
        todo = todo[: len(slots)]
        if not todo:
            return
        for node, slot in zip(todo, slots, strict=True):
            led.backup_backlog.pop(node.node_id, None)  # backed up by another path: no longer waiting
            led.update(node, host=(HostState.WRITING, slot))
        self.outbox.issue(OpKind.BACKUP, todo, -1)
        led.stats.backups_issued_pages += len(todo)

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

    # ------------------------------------------------------------------ storage write-out

    def store(self, nodes: list[Node]) -> None:
        """Write host-VALID pages to storage; durable only once every rank acked (agreed)."""
        if not self.storage or not self.enabled:
            return
        todo = [n for n in nodes if n.host_state == HostState.VALID and n.storage_state == StorageState.NONE]
        if not todo:
            return
        for node in todo:
            self.ledger.update(node, storage=StorageState.WRITING, host_pins=+1)  # the op reads the slot
        self.outbox.issue(OpKind.STORAGE_WRITE, todo, -1)
        self.ledger.stats.storage_write_issued_pages += len(todo)

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
        if want <= 0 or not led.mirrors:
            return None
        # the mirror index holds every page that could qualify; the sort makes its order irrelevant
        candidates = [n for n in led.mirrors.values() if self.backup.is_releasable_mirror(n)]
        candidates.sort(key=self.backup.evictor.candidates.policy.key)
        chosen = candidates[:want]
        if not chosen:
            return None
        ids = [n.node_id for n in chosen]
        hashes = [n.hash & ((1 << 63) - 1) for n in chosen]
        return Plan(self.name, ids, len(ids) * led.page_size, mix_ids(ids + hashes))

    def execute(self, plan: Plan) -> int:
        """Re-checks every page: a plan that went stale between the rounds does less, never wrong."""
        released = 0
        for node_id in plan.node_ids:
            node = self.backup.ledger.tree.nodes.get(node_id)
            if node is not None and self.backup.release_mirror(node):
                released += 1
        return released
