"""The ledger: the one mutator of node state.

Every change to a node's tier state, pins, access stamp or hit count goes through ``update``, and
nodes enter and leave the tree through ``add``/``remove``. The ledger keeps what summarizes the
nodes equal to them after every call: the state digest (the sum of ``record_of`` over nodes and
leases), the evictable/protected counters, the mirror index and the eviction candidate heaps.
``invariants.check`` recomputes each of these from the nodes with the same functions.
"""

from __future__ import annotations

import struct
from typing import Protocol

import xxhash

from tpcache.core.allocator import HostAllocator, PageAllocator
from tpcache.core.config import CacheConfig
from tpcache.core.digest import DIGEST_MASK, Digest, mix, mix_ids
from tpcache.core.records import Lease, Stats
from tpcache.core.tiers import DeviceState, HostState, StorageState, check_transition
from tpcache.core.tree import Node, RadixTree, drop_pages

_RECORD = struct.Struct("<QqqqqqqQ")
_LEASE_TAG = 0x4C45415345  # keeps lease records apart from node records in the digest
_VALID = DeviceState.VALID
_NONE = DeviceState.NONE
_MIRROR = (DeviceState.VALID, HostState.VALID, StorageState.DURABLE)


def record_of(node: Node) -> int:
    """A node's contribution to the state digest: every field that decides a hit, a page number or
    an eviction (tier states, device page, host slot, pins, stamp, hits, creation time)."""
    return (
        xxhash.xxh3_64_intdigest(
            _RECORD.pack(
                node.hash,
                node.device_state | node.host_state << 2 | node.storage_state << 4,
                node.device_page,
                node.host_slot,
                node.device_pins << 32 | node.host_pins,
                node.last_access,
                node.hits,
                node.created_at,
            )
        )
        & DIGEST_MASK
    )


def lease_record(lease: Lease, prefetch_fields: list[int]) -> int:
    """A lease's contribution to the state digest: what it pins, holds and waits for."""
    return mix(
        _LEASE_TAG,
        lease.lease_id,
        mix_ids([n.node_id for n in lease.device_nodes]),
        mix_ids([n.node_id for n in lease.host_nodes]),
        mix_ids(lease.pages),
        mix_ids(lease.ops),
        int(lease.releasing),
        mix_ids(prefetch_fields),
    )


def is_mirror(node: Node) -> bool:
    """On device, on host and durable in storage: the pages mirror release may free a copy of."""
    return (node.device_state, node.host_state, node.storage_state) == _MIRROR


def is_evictable(node: Node) -> bool:
    """Device-VALID with no pins: counted as evictable device tokens (the retention cap's measure)."""
    return node.device_state == _VALID and node.device_pins == 0


def is_protected(node: Node) -> bool:
    """On device (valid or loading) and pinned by a lease or an op."""
    return node.device_state != _NONE and node.device_pins > 0


class CandidateIndex(Protocol):
    """What the ledger tells the eviction candidates (``eviction.Candidates``)."""

    def offer(self, node: Node) -> None: ...

    def offer_around(self, node: Node) -> None: ...


class Ledger:
    def __init__(self, config: CacheConfig, tree: RadixTree, candidates: CandidateIndex) -> None:
        self.config = config
        self.page_size = config.page_size
        self.tree = tree
        self.device = PageAllocator(config.device_pages, "device")
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
        self.backup_backlog: dict[int, Node] = {}

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
    ) -> None:
        """Change ``node``: tier states (with their page or slot), pin deltas, an access stamp (the
        current clock) and a hit. Transitions are checked against the tier tables."""
        was_evictable, was_protected, was_mirror = is_evictable(node), is_protected(node), is_mirror(node)
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
        self._refresh(node, was_evictable, was_protected, was_mirror)

    def add(self, parent: Node, tokens: bytes, hash_: int, host: tuple[HostState, int] | None = None) -> Node:
        """A new node under ``parent`` (stamped now), optionally with a host slot being written."""
        node = self.tree.add_child(parent, tokens, hash_, self.clock)
        if host is not None:
            check_transition(HostState, node.host_state, host[0])
            node.host_state, node.host_slot = host
        self._refresh(node, False, False, False)
        return node

    def remove_if_empty(self, node: Node) -> None:
        """Remove nodes that hold nothing on any tier and are not pinned, leaf upwards."""
        while (
            node.parent is not None
            and not node.children
            and not node.resident
            and node.device_pins == 0
            and node.host_pins == 0
        ):
            parent = node.parent
            self.digest.remove(node.record)
            node.record = 0
            self.backup_backlog.pop(node.node_id, None)
            self.tree.remove_leaf(node)
            if parent.parent is None:
                return
            self.candidates.offer(parent)
            node = parent

    def _refresh(self, node: Node, was_evictable: bool, was_protected: bool, was_mirror: bool) -> None:
        digest = self.digest
        digest.value = (digest.value - node.record) & DIGEST_MASK
        node.record = record_of(node)
        digest.value = (digest.value + node.record) & DIGEST_MASK
        evictable, protected, mirror = is_evictable(node), is_protected(node), is_mirror(node)
        self.evictable_device_pages += evictable - was_evictable
        self.protected_device_pages += protected - was_protected
        if mirror != was_mirror:
            if mirror:
                self.mirrors[node.node_id] = node
            else:
                del self.mirrors[node.node_id]
        self.candidates.offer_around(node)

    # ------------------------------------------------------------------ leases in the digest

    def refresh_lease(self, lease: Lease, prefetch_fields: list[int]) -> None:
        """Re-record a lease after any change to it (or, with ``lease.record`` 0, record a new one)."""
        self.digest.remove(lease.record)
        lease.record = lease_record(lease, prefetch_fields)
        self.digest.add(lease.record)

    def forget_lease(self, lease: Lease) -> None:
        self.digest.remove(lease.record)
        lease.record = 0

    # ------------------------------------------------------------------ shared node changes

    def free_host_copy(self, node: Node) -> None:
        """Drop a node's host copy (evicted, released as a mirror, or its copy failed)."""
        self.host.free([node.host_slot])
        self.update(node, host=(HostState.NONE, -1))

    def free_device_copy(self, node: Node) -> None:
        """Drop a node's device page (evicted, or its load failed)."""
        self.device.free([node.device_page])
        self.update(node, device=(DeviceState.NONE, -1))

    def path_union(self, nodes: list[Node]) -> list[Node]:
        """Every node on the paths from the root to ``nodes``, each once, in a fixed order."""
        seen: set[int] = set()
        out: list[Node] = []
        for node in nodes:
            cur: Node | None = node
            while cur is not None and cur.parent is not None and cur.node_id not in seen:
                seen.add(cur.node_id)
                out.append(cur)
                cur = cur.parent
        return out
