"""The ledger: the one mutator of node state.

Every change to a node's tier state, pins, access stamp or hit count goes through ``update`` (for a
component of a hybrid model: ``update(node, part=c, ...)``; for the pins, stamps and hits of a whole
path: ``touch``, the same change in one loop), and nodes enter and leave the tree
through ``add``/``remove``. The ledger keeps what summarizes the nodes equal to them after every
call: the state digest (the sum of ``record_of`` over nodes and leases), the evictable/protected
counters, the mirror index and the eviction candidate heaps, and each component's (``Part``).
``invariants.check`` recomputes each of these from the nodes with the same functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from tpcache.core.backend import NATIVE
from tpcache.core.config import CacheConfig
from tpcache.core.digest import DIGEST_MASK, Digest
from tpcache.core.hashing import page_hash
from tpcache.core.records import Lease, Stats
from tpcache.core.tiers import TRANSITIONS, DeviceState, HostState, StorageState, check_transition
from tpcache.core.treecore.accounting import (
    EVICTABLE,
    MIRROR,
    PROTECTED,
    flags_of,
    fold_leases,
    record_of,
    touch_nodes,
    unresident,
)
from tpcache.core.treecore.allocator import AdoptedPages, HostAllocator, PageAllocator
from tpcache.core.treecore.components import (
    DEV,
    DPINS,
    DSLOT,
    HOST,
    HPINS,
    HSLOT,
    STAMP,
    STORE,
    Part,
    fresh_record,
    is_part_evictable,
    is_part_mirror,
)
from tpcache.core.treecore.feed import ChangeFeed
from tpcache.core.treecore.tree import Node, RadixTree, drop_pages

_native = NATIVE

_VALID = DeviceState.VALID
_NONE = DeviceState.NONE


class CandidateIndex(Protocol):
    """What the ledger tells the eviction candidates (``eviction.Candidates``)."""

    def offer(self, node: Node) -> None: ...

    def offer_around(self, node: Node) -> None: ...


class Ledger:
    def __init__(self, config: CacheConfig, tree: RadixTree, candidates: CandidateIndex) -> None:
        self.config = config
        self.page_size = config.page_size
        self.tree = tree
        self.device = (AdoptedPages if config.device_adopt else PageAllocator)(config.device_pages, "device")
        self.host = HostAllocator(config.host_pages, "host")
        self.candidates = candidates
        self.digest = Digest()
        self.clock = 0
        self.stats = Stats()
        self.evictable_device_pages = 0
        self.protected_device_pages = 0
        # Pages on device, on host and durable in storage, by node id: all that mirror release can
        # ever free, so its plan looks at these and not at the whole tree.
        self.mirrors: dict[int, Node] = {}
        # Pages waiting for a host slot to be backed up, oldest first; its length is the host deficit.
        self.backup_backlog: dict[int, int] = {}  # node id -> itself, oldest first
        # A hybrid model's other components, by index (1, 2, ...): pools and summaries of each.
        self.parts: dict[int, Part] = {spec.index: Part(spec, tree) for spec in config.components()}
        # Told about every node before its tiers change (``feed.py``); None: nobody reads the changes.
        self.feed: ChangeFeed | None = None

    @property
    def evictable_device_tokens(self) -> int:
        return self.evictable_device_pages * self.page_size

    @property
    def protected_device_tokens(self) -> int:
        return self.protected_device_pages * self.page_size

    def tick(self) -> None:
        """Advance the logical clock (once per sequenced operation)."""
        self.clock += 1

    # ------------------------------------------------------------------ the mutator

    def update(
        self,
        node: Node,
        *,
        device: tuple[DeviceState, int] | None = None,
        host: tuple[HostState, int] | None = None,
        storage: StorageState | None = None,
        device_pins: int = 0,
        host_pins: int = 0,
        stamp: bool = False,
        hit: bool = False,
        part: int = 0,
    ) -> None:
        """Change ``node``: tier states (with their page or slot), pin deltas, an access stamp (the
        current clock) and a hit. Transitions are checked against the tier tables. ``part`` > 0:
        the same changes to that component's data of the node (its own states, slots, pins, stamp)."""
        if part:
            self._update_part(node, self.parts[part], device, host, storage, device_pins, host_pins, stamp)
            return
        if self.feed is not None and (device is not None or host is not None or storage is not None):
            self.feed.before(node)
        was = flags_of(node)
        if device is not None:
            state, page = device
            check_transition(DeviceState, node.device_state, state)
            if page != node.device_page:
                drop_pages(node)  # the only place a device page changes: no cached copy outlives it
            node.device_state = state
            node.device_page = page
        if host is not None:
            check_transition(HostState, node.host_state, host[0])
            node.host_state, node.host_slot = host
        if storage is not None:
            check_transition(StorageState, node.storage_state, storage)
            node.storage_state = storage
        if device_pins:
            node.device_pins += device_pins
        if host_pins:
            node.host_pins += host_pins
        if stamp:
            node.last_access = self.clock
        if hit:
            node.hits += 1
        # Pins, a stamp or a hit change only the node's own candidacy; a tier change or a host pin
        # can also decide its parent's and the device page above a host-only chain.
        around = device is not None or host is not None or storage is not None or host_pins != 0
        self._refresh(node, was, around)

    def settle(
        self,
        nodes: list[Node],
        device: DeviceState | None = None,
        host: HostState | None = None,
        storage: StorageState | None = None,
        host_pins: int = 0,
    ) -> None:
        """``update(node, device=(device, its page), host=(host, its slot), storage=storage,
        host_pins=host_pins)`` for each node in order (None: that tier unchanged): one agreed copy's
        change to its pages, in one loop with the same records, counters, mirrors and offers."""
        if self.feed is not None:
            self.feed.before_all(nodes)
        if _native is not None:  # the same loop in C (_settle.c), up to a node it leaves to update
            heaps = self.candidates.native  # the C kernels' heaps (candidates.Candidates.native)
            value, evictable, protected, stopped = _native.settle(
                nodes, device, host, storage, host_pins, self.digest.value, heaps, self.mirrors, TRANSITIONS
            )
            self.digest.value = value
            self.evictable_device_pages += evictable
            self.protected_device_pages += protected
            if stopped < 0:
                return
            nodes = nodes[stopped:]
        for node in nodes:
            dev = None if device is None else (device, node.device_page)
            slot = None if host is None else (host, node.host_slot)
            self.update(node, device=dev, host=slot, storage=storage, host_pins=host_pins)

    def touch(
        self, ids: Sequence[int], pins: int, stamp: bool = False, hit: bool = False, nodes: Sequence[Node] | None = None
    ) -> list[int]:
        """``update(node, device_pins=pins, stamp=..., hit=...)`` for the node of each id in order
        (``nodes``: for those nodes, a walk's), in one loop: the same changes, records, counters and
        offers. A pin, a stamp or a hit changes no tier, so no mirror and no neighbour's candidacy: a
        lock or a release pays this per page, not more. Returns ``unresident`` of them, in the same pass."""
        where, items = (self.tree.nodes, ids) if nodes is None else (None, nodes)
        if _native is not None:  # the same loop in C (_account.c), each id found in the tree's dict
            args = (pins, stamp, hit, self.clock, self.digest.value, self.candidates.native)
            value, evictable, protected, gone = _native.touch(where, items, *args)  # offers read the heaps once
            self.digest.value = value
        else:
            found = items if where is None else [where[i] for i in items]
            args = (pins, stamp, hit, self.clock, self.digest.value, self.candidates.offer)
            value, evictable, protected, gone = touch_nodes(found, *args)
            self.digest.value = value & DIGEST_MASK
        self.evictable_device_pages += evictable
        self.protected_device_pages += protected
        return gone

    def add(self, parent: Node, tokens: bytes, hash_: int, host: tuple[HostState, int]) -> Node:
        """A new host-only node under ``parent`` (stamped now) with its host slot being written: one
        record and one offer for a node and its first state. An insert's device pages come through
        ``add_pinned_chain``."""
        node = self.tree.add_child(parent, tokens, hash_, self.clock)
        if self.parts:
            node.comp = fresh_record(len(self.parts), self.clock)
        check_transition(HostState, node.host_state, host[0])
        node.host_state, node.host_slot = host
        self._refresh(node, 0, False)
        if self.feed is not None:
            self.feed.fresh((node,))
        return node

    def count_chain(self, nodes: list[Node], records: int) -> None:
        """The tree's next id, digest, protected count and feed moved for a native chain of new pinned
        ``nodes`` (``records``: the sum of their records)."""
        self.tree._next_id += len(nodes)
        self.digest.value = (self.digest.value + records) & DIGEST_MASK
        self.protected_device_pages += len(nodes)
        if self.feed is not None:
            self.feed.fresh(nodes)

    def add_pinned_chain(self, parent: Node, token_bytes: bytes, offset: int, pages: list[int]) -> list[int]:
        """The ids of new nodes for the pages of ``token_bytes`` from byte ``offset`` on, one per page
        of ``pages``, each below the one before, the first below ``parent`` (an insert's new pages):
        each device VALID on its page, pinned once, stamped now, recorded, and counted protected.
        (The reference: ``TreeCore.add_pinned_chain`` calls the native kernel, which does the same.)"""
        step, seed, h = self.page_size * 4, self.tree.seed, parent.hash
        tokens, hashes = [], []
        for start in range(offset, offset + len(pages) * step, step):
            tokens.append(token_bytes[start : start + step])
            h = page_hash(h, tokens[-1], seed)
            hashes.append(h)
        nodes = self.tree.add_chain(parent, tokens, hashes, self.clock)
        comp = len(self.parts)
        value = self.digest.value
        for node, page in zip(nodes, pages, strict=True):
            if comp:
                node.comp = fresh_record(comp, self.clock)
            node.device_state, node.device_page, node.device_pins = _VALID, page, 1
            node.record = record_of(node)
            value += node.record
        self.digest.value = value & DIGEST_MASK
        self.protected_device_pages += len(nodes)
        if self.feed is not None:
            self.feed.fresh(nodes)
        return [node.node_id for node in nodes]

    def remove_empty(self, ids: Sequence[int]) -> None:
        """``remove_if_empty`` for the node of each id, last first, skipping ids no longer in the
        tree; a resident node stays, so only the rest are visited."""
        nodes = self.tree.nodes
        for node_id in reversed(unresident(nodes, ids)):
            node = nodes.get(node_id)  # (removed as an ancestor of one before)
            if node is not None:
                self.remove_if_empty(node)

    def remove_if_empty(self, node: Node) -> None:
        """Remove nodes that hold nothing on any tier and are not pinned, leaf upwards."""
        while (
            node.parent is not None
            and not node.num_children
            and not node.resident
            and node.device_pins == 0
            and node.host_pins == 0
        ):
            parent = node.parent
            if self.feed is not None:
                self.feed.before(node)
            self.digest.remove(node.record)
            node.record = 0
            self.backup_backlog.pop(node.node_id, None)
            for p in self.parts.values():
                p.backlog.pop(node.node_id, None)
                p.behind.pop(node.node_id, None)
            self.tree.remove_leaf(node)
            if parent.parent is None:
                return
            self.candidates.offer(parent)
            node = parent

    def _update_part(
        self,
        node: Node,
        p: Part,
        device: tuple[DeviceState, int] | None,
        host: tuple[HostState, int] | None,
        storage: StorageState | None,
        device_pins: int,
        host_pins: int,
        stamp: bool,
    ) -> None:
        rec, b = node.comp, p.base
        assert rec is not None, "a component change on a node of a configuration without components"
        was_evictable, was_mirror = is_part_evictable(rec, b), is_part_mirror(rec, b)
        if device is not None:
            check_transition(DeviceState, rec[b + DEV], device[0])
            rec[b + DEV], rec[b + DSLOT] = int(device[0]), device[1]
        if host is not None:
            check_transition(HostState, rec[b + HOST], host[0])
            rec[b + HOST], rec[b + HSLOT] = int(host[0]), host[1]
        if storage is not None:
            check_transition(StorageState, rec[b + STORE], storage)
            rec[b + STORE] = int(storage)
        rec[b + DPINS] += device_pins
        rec[b + HPINS] += host_pins
        if stamp:
            rec[b + STAMP] = self.clock
        self._rerecord(node)
        p.evictable += is_part_evictable(rec, b) - was_evictable
        mirror = is_part_mirror(rec, b)
        if mirror != was_mirror:
            if mirror:
                p.mirrors[node.node_id] = node
            else:
                del p.mirrors[node.node_id]
        p.offer(node)
        if host is not None or host_pins:
            self.candidates.offer_around(node)  # its host candidacy (and a device page above it) depends on them

    def _rerecord(self, node: Node) -> None:
        digest = self.digest
        digest.value = (digest.value - node.record) & DIGEST_MASK
        node.record = record_of(node)
        digest.value = (digest.value + node.record) & DIGEST_MASK

    def _refresh(self, node: Node, was: int, around: bool = True) -> None:
        """Re-record ``node`` and move the counters and the mirror index from its ``flags_of`` before
        the change (``was``) to now; offer it (``around``: and the nodes its change can decide)."""
        digest = self.digest
        digest.value = (digest.value - node.record) & DIGEST_MASK
        node.record = record_of(node)
        digest.value = (digest.value + node.record) & DIGEST_MASK
        now = flags_of(node)
        if now != was:
            self.evictable_device_pages += (now & EVICTABLE) - (was & EVICTABLE)
            self.protected_device_pages += ((now & PROTECTED) - (was & PROTECTED)) >> 1
            if (now ^ was) & MIRROR:
                if now & MIRROR:
                    self.mirrors[node.node_id] = node
                else:
                    del self.mirrors[node.node_id]
        if around:
            self.candidates.offer_around(node)
        else:
            self.candidates.offer(node)

    # ------------------------------------------------------------------ leases in the digest

    def record_leases(self, leases: list[Lease], kept_digest: int, records: Callable[[Lease], tuple[int, int]]) -> int:
        """Re-record leases after changes to them (a lease with ``record`` and ``kept`` 0 is new):
        ``records(lease)`` is (its record in the state digest, its record in the kept digest).
        Returns ``kept_digest`` with the leases' kept records replaced."""
        self.digest.value, kept_digest = fold_leases(leases, self.digest.value, kept_digest, records)
        return kept_digest

    def forget_lease(self, lease: Lease) -> None:
        self.digest.remove(lease.record)
        lease.record = 0

    # ------------------------------------------------------------------ shared node changes

    def free_host_copy(self, node: Node) -> None:
        """Drop a node's host copy (evicted, released as a mirror, or its copy failed), with its
        components' host copies (they need it)."""
        if node.comp is not None:
            for p in self.parts.values():
                if node.comp[p.base + HOST]:
                    self.free_part_host(node, p)
        self.host.free([node.host_slot])
        self.update(node, host=(HostState.NONE, -1))

    def drop_device_leaf(self, node: Node) -> bool:
        """``free_device_copy`` then ``remove_if_empty`` in one step, for the page eviction frees
        most: an unpinned device leaf with no other copy or component, below a device page or the
        root. The same end state (nodes, digest, counters, free pages; the parent offered once
        rather than twice). False, changing nothing, for any other node."""
        parent = node.parent
        if (
            node.num_children
            or node.comp is not None
            or node.device_state != _VALID
            or node.device_pins
            or node.host_state != HostState.NONE
            or node.host_pins
            or parent is None
            or (parent.parent is not None and parent.device_state != _VALID)
        ):
            return False
        if self.feed is not None:
            self.feed.before(node)
        self.device.free([node.device_page])
        drop_pages(node)
        node.device_state, node.device_page = _NONE, -1
        self.evictable_device_pages -= 1
        digest = self.digest
        digest.value = (digest.value - node.record) & DIGEST_MASK
        node.record = 0
        self.backup_backlog.pop(node.node_id, None)
        self.tree.remove_leaf(node)
        if parent.parent is not None:
            self.candidates.offer(parent)
        return True

    def free_device_copy(self, node: Node) -> None:
        """Drop a node's device page (evicted, or its load failed), with its components' device
        copies (they need it)."""
        if node.comp is not None:
            for p in self.parts.values():
                if node.comp[p.base + DEV]:
                    self.free_part_device(node, p)
        self.device.free([node.device_page])
        self.update(node, device=(DeviceState.NONE, -1))

    def free_part_device(self, node: Node, p: Part) -> None:
        """Drop one component's device copy of a node (a tombstone if its full page stays)."""
        assert node.comp is not None
        p.device.free([node.comp[p.base + DSLOT]])
        self.update(node, part=p.index, device=(DeviceState.NONE, -1))

    def free_part_host(self, node: Node, p: Part) -> None:
        assert node.comp is not None
        p.host.free([node.comp[p.base + HSLOT]])
        self.update(node, part=p.index, host=(HostState.NONE, -1))
