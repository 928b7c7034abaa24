"""The ledger: per-node tier state kept equal to everything that summarizes it.

Every change to a node goes through here, bracketed by ``_unaccount``/``_account``, which keep the
state digest, the evictable/protected counters and the eviction heaps equal to the nodes they
summarize. CacheCore builds its operations on these primitives.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from tpcache.core.allocator import HostAllocator, PageAllocator
from tpcache.core.config import CacheConfig
from tpcache.core.digest import Digest, mix, mix_ids
from tpcache.core.eviction import make_policy
from tpcache.core.prefetch import PrefetchState
from tpcache.core.records import Lease, Stats
from tpcache.core.tiers import DeviceState, HostState, StorageState, check_transition
from tpcache.core.tree import Node, RadixTree, drop_pages

_LEASE_TAG = 0x4C45415345  # keeps lease records apart from node records in the digest


def is_mirror(node: Node) -> bool:
    """On device, on host and durable in storage: the pages mirror release may free a copy of."""
    return (
        node.storage_state == StorageState.DURABLE
        and node.host_state == HostState.VALID
        and node.device_state == DeviceState.VALID
    )


class Ledger:
    def __init__(self, config: CacheConfig) -> None:
        config.validate()
        self.config = config
        self.page_size = config.page_size
        self.policy = make_policy(config.eviction_policy)
        self._write_back = config.write_policy == "write_back" and config.host_pages > 0
        self.tree = RadixTree(config.page_size, config.namespace)
        self.device = PageAllocator(config.device_pages, "device")
        self.host = HostAllocator(config.host_pages, "host")
        self.digest = Digest()
        self.clock = 0
        self.stats = Stats()
        self.evictable_device_pages = 0
        self.protected_device_pages = 0
        # Pages on device, on host and durable in storage, by node id: all that mirror release can
        # ever free, so its plan looks at these and not at the whole tree.
        self.mirrors: dict[int, Node] = {}
        # Pages waiting for a host slot to be backed up, oldest first. Retried every round; the
        # agreed minimum of its length is the host deficit a mirror-release plan works off.
        self.backup_backlog: dict[int, Node] = {}
        self._device_heap: list[tuple[tuple[int, ...], int]] = []
        self._host_heap: list[tuple[tuple[int, ...], int]] = []

    @property
    def evictable_device_tokens(self) -> int:
        return self.evictable_device_pages * self.page_size

    @property
    def protected_device_tokens(self) -> int:
        return self.protected_device_pages * self.page_size

    def _set_device(self, node: Node, state: DeviceState, page: int) -> None:
        check_transition(DeviceState, node.device_state, state)
        if page != node.device_page:
            drop_pages(node)  # the only place a device page changes: no cached copy outlives it
        node.device_state = state
        node.device_page = page

    def _set_host(self, node: Node, state: HostState, slot: int) -> None:
        check_transition(HostState, node.host_state, state)
        node.host_state = state
        node.host_slot = slot

    def _set_storage(self, node: Node, state: StorageState) -> None:
        check_transition(StorageState, node.storage_state, state)
        node.storage_state = state

    def _pin_device(self, node: Node, delta: int) -> None:
        self._unaccount(node)
        node.device_pins += delta
        self._account(node)

    def _pin_host(self, node: Node, delta: int) -> None:
        self._unaccount(node)
        node.host_pins += delta
        self._account(node)

    def _stamp(self, nodes: list[Node], hit: bool) -> None:
        for node in nodes:
            self._unaccount(node)
            node.last_access = self.clock
            if hit:
                node.hits += 1
            self._account(node)

    @staticmethod
    def _path_union(nodes: list[Node]) -> list[Node]:
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

    def _drop_device(self, node: Node) -> None:
        if not node.on_host:
            self._drop_host_subtree(node)
        if self.backup_backlog.pop(node.node_id, None) is not None:
            self.stats.backup_rejected_host_full += 1  # its only copy goes: never reached a lower tier
        self._unaccount(node)
        self.device.free([node.device_page])
        self._set_device(node, DeviceState.NONE, -1)
        self._account(node)  # re-offers the parent to the heaps too
        self._maybe_remove(node)

    def _maybe_remove(self, node: Node) -> None:
        """Remove nodes that hold nothing on any tier and are not pinned, leaf upwards."""
        while (
            node.parent is not None
            and node.parent is not node
            and not node.children
            and not node.resident
            and node.device_pins == 0
            and node.host_pins == 0
        ):
            parent = node.parent
            self._unaccount(node)
            self.backup_backlog.pop(node.node_id, None)
            self.tree.remove_leaf(node)
            if parent.parent is None:
                return
            self._push(parent)
            node = parent

    def _drop_host_subtree(self, node: Node) -> None:
        """Drop the host-only pages below a page that leaves device with no host copy, leaves first."""
        order: list[Node] = []
        stack = [c for c in node.children.values() if c.on_host]
        while stack:
            child = stack.pop()
            order.append(child)
            stack.extend(c for c in child.children.values() if c.on_host)
        for child in reversed(order):
            self._unaccount(child)
            self.host.free([child.host_slot])
            self._set_host(child, HostState.NONE, -1)
            self._account(child)
            self._maybe_remove(child)
            self.stats.host_evicted_pages += 1

    @staticmethod
    def _host_subtree_droppable(node: Node) -> bool:
        stack = [c for c in node.children.values() if c.on_host]
        while stack:
            child = stack.pop()
            if child.host_state != HostState.VALID or child.host_pins or child.on_device:
                return False
            stack.extend(c for c in child.children.values() if c.on_host)
        return True

    # A node's derived contributions (digest record, counters, heap entries) are removed before
    # any change to it and added back after: one place keeps them equal to what they summarize.

    def _unaccount(self, node: Node) -> None:
        self.digest.remove(node.record)
        node.record = 0
        if node.device_state == DeviceState.VALID and node.device_pins == 0:
            self.evictable_device_pages -= 1
        elif node.on_device and node.device_pins > 0:
            self.protected_device_pages -= 1
        if is_mirror(node):
            del self.mirrors[node.node_id]

    def _account(self, node: Node) -> None:
        node.record = mix(
            node.hash,
            node.device_state,
            node.device_page,
            node.host_state,
            node.host_slot,
            node.storage_state,
            (node.device_pins << 32) | node.host_pins,
            node.last_access,
        )
        self.digest.add(node.record)
        if node.device_state == DeviceState.VALID and node.device_pins == 0:
            self.evictable_device_pages += 1
        elif node.on_device and node.device_pins > 0:
            self.protected_device_pages += 1
        if is_mirror(node):
            self.mirrors[node.node_id] = node
        self._push(node)
        parent = node.parent
        if parent is not None and parent.parent is not None:
            self._push(parent)  # a child's tiers decide whether its parent is an eviction candidate

    def _unaccount_lease(self, lease: Lease) -> None:
        self.digest.remove(lease.record)
        lease.record = 0

    def _account_lease(self, lease: Lease) -> None:
        lease.record = mix(
            _LEASE_TAG,
            lease.lease_id,
            mix_ids([n.node_id for n in lease.device_nodes]),
            mix_ids([n.node_id for n in lease.host_nodes]),
            mix_ids(lease.pages),
            mix_ids(lease.ops),
            int(lease.releasing),
            0 if lease.prefetch is None else mix_ids(self._prefetch_fields(lease.prefetch)),
        )
        self.digest.add(lease.record)

    @staticmethod
    def _prefetch_fields(p: PrefetchState) -> list[int]:
        return [p.code(), p.attempts, p.op_id, p.hit_pages, p.ready_pages, p.rounds, p.deferrals, p.start]

    def _push(self, node: Node) -> None:
        if len(self._device_heap) + len(self._host_heap) > 4 * len(self.tree.nodes) + 64:
            self._rebuild_heaps()
        if self._device_candidate(node):
            heapq.heappush(self._device_heap, (self.policy.key(node), node.node_id))
        if self._host_candidate(node):
            heapq.heappush(self._host_heap, (self.policy.key(node), node.node_id))

    def _rebuild_heaps(self) -> None:
        """Drop stale entries. Iterates nodes in insertion order, so every rank rebuilds alike."""
        nodes = list(self.tree.nodes.values())
        self._device_heap = [(self.policy.key(n), n.node_id) for n in nodes if self._device_candidate(n)]
        self._host_heap = [(self.policy.key(n), n.node_id) for n in nodes if self._host_candidate(n)]
        heapq.heapify(self._device_heap)
        heapq.heapify(self._host_heap)

    def _device_candidate(self, node: Node) -> bool:
        """Device leaves not in use. A page with no host copy whose children live only on host
        goes only if those host copies can go with it (they would hang from nothing)."""
        if node.device_state != DeviceState.VALID or node.device_pins or node.parent is None:
            return False
        host_children = False
        for child in node.children.values():
            if child.on_device:
                return False
            host_children = host_children or child.on_host
        return not host_children or node.on_host or self._host_subtree_droppable(node)

    @staticmethod
    def _host_candidate(node: Node) -> bool:
        """Host leaves not in use and not on device. A device page's host copy makes its device
        eviction free (write-through) or is the copy a write-back eviction waits for, so it is not
        evicted from host: it goes only when its device copy goes, or by an agreed mirror-release
        plan once the page is durable in storage."""
        if node.host_state != HostState.VALID or node.host_pins or node.parent is None or node.on_device:
            return False
        return not any(c.on_host for c in node.children.values())

    def _pop_candidate(
        self, heap: list[tuple[tuple[int, ...], int]], is_candidate: Callable[[Node], bool]
    ) -> Node | None:
        """Pop the best live candidate; stale heap entries (changed key, gone, pinned) are skipped."""
        while heap:
            key, node_id = heapq.heappop(heap)
            node = self.tree.nodes.get(node_id)
            if node is not None and is_candidate(node) and self.policy.key(node) == key:
                return node
        return None
