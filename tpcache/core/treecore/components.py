"""Components beside the full-attention pages: a node's per-component record and each component's
pools, counters, mirror index, backlog and candidate heaps.

A hybrid model has layers of other kinds beside full attention: sliding-window attention (SWA, one
page of KV per node, needed only near a hit's boundary) and recurrent (Mamba) layers (one state per
node where kept, needed only at the boundary). Each such component has its own device and host
pools. A node of a hybrid configuration carries ``node.comp``: one flat list of ints with
``STRIDE`` fields per component, in component order (no Python object per component or page):
device state and slot, host state and slot, storage state, device pins, host pins, and the
component's own access stamp. A configuration with full attention only leaves ``node.comp`` None.

Only ``Ledger.update(node, part=c, ...)`` changes a record; the ledger keeps each ``Part`` equal to
the records (``invariants.check`` recomputes them).

Invariants:
- a component's copy on a tier needs the node's full page on that tier (device: valid or loading;
  host: any state): freeing a node's full copy on a tier frees its component copies there first;
- component copies are not ancestor-closed: any node's SWA data and an inner node's state may be
  missing while its full page stays (a tombstone); the hit rule (``hitrule``) decides what a hit
  needs;
- a component pinned on device has its node's full page pinned on device, so a full-page eviction
  candidate never holds a pinned component.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from tpcache.core.config import ComponentSpec
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.treecore.allocator import HostAllocator, PageAllocator

if TYPE_CHECKING:
    from tpcache.core.treecore.tree import Node, RadixTree

STRIDE = 8
DEV, DSLOT, HOST, HSLOT, STORE, DPINS, HPINS, STAMP = range(STRIDE)
FIELD_NAMES = ("device_state", "device_slot", "host_state", "host_slot", "storage_state", "device_pins")
FIELD_NAMES += ("host_pins", "stamp")

_VALID = int(DeviceState.VALID)
_HVALID = int(HostState.VALID)
_HWRITING = int(HostState.WRITING)
_DURABLE = int(StorageState.DURABLE)

Entry = tuple[tuple[int, ...], int]


def fresh_record(count: int, clock: int) -> list[int]:
    """The record of a node that holds no component data yet."""
    return [0, -1, 0, -1, 0, 0, 0, clock] * count


def on_device(rec: list[int], b: int) -> bool:
    return rec[b + DEV] != 0


def on_host(rec: list[int], b: int) -> bool:
    return rec[b + HOST] != 0


def readable_tier(rec: list[int], b: int) -> int:
    """1: readable on device, 2: readable on host (and not on device), 0: not readable now."""
    if rec[b + DEV] == _VALID:
        return 1
    if rec[b + HOST] == _HVALID and rec[b + DEV] == 0:
        return 2
    return 0


def is_part_evictable(rec: list[int], b: int) -> bool:
    """Device-valid and unpinned: its device copy can be freed now (the component's candidates)."""
    return rec[b + DEV] == _VALID and rec[b + DPINS] == 0


def is_part_host_candidate(rec: list[int], b: int) -> bool:
    """Host-valid, unpinned and not on device (as for full pages, a device copy's host copy goes
    only with its device copy or by an agreed mirror-release plan)."""
    return rec[b + HOST] == _HVALID and rec[b + HPINS] == 0 and rec[b + DEV] == 0


def is_part_mirror(rec: list[int], b: int) -> bool:
    """On device, on host and durable: the host copy is redundant."""
    return rec[b + DEV] == _VALID and rec[b + HOST] == _HVALID and rec[b + STORE] == _DURABLE


def host_parts_idle(node: Node) -> bool:
    """No component host copy of the node is being written or is pinned: its full host copy (which
    takes them along) may go."""
    rec = node.comp
    if rec is None:
        return True
    return not any(rec[b + HOST] == _HWRITING or rec[b + HPINS] for b in range(0, len(rec), STRIDE))


def host_parts_releasable(node: Node) -> bool:
    """Every component the node holds on host is itself a redundant mirror, unpinned: releasing the
    node's full host mirror (which frees them) loses nothing that is not on device and durable."""
    rec = node.comp
    if rec is None:
        return True
    for b in range(0, len(rec), STRIDE):
        if rec[b + HOST] and (rec[b + HPINS] or not is_part_mirror(rec, b)):
            return False
    return True


class Part:
    """One component's pools and the summaries the ledger keeps equal to the node records."""

    def __init__(self, spec: ComponentSpec, tree: RadixTree) -> None:
        self.spec = spec
        self.index = spec.index
        self.name = spec.name
        self.base = (spec.index - 1) * STRIDE
        self.tree = tree
        self.device = PageAllocator(spec.device_slots, f"{spec.name} device")
        self.host = HostAllocator(spec.host_slots, f"{spec.name} host")
        self.evictable = 0  # device-valid, unpinned
        self.mirrors: dict[int, Node] = {}  # by node id: on device, on host and durable
        self.backlog: dict[int, int] = {}  # nodes whose component waits for a host slot, oldest first
        # SWA data behind a request's window that a copy (or another request) still read when the
        # request let go of it: freed by the first commit that finds it unpinned.
        self.behind: dict[int, int] = {}
        self.device_heap: list[Entry] = []
        self.host_heap: list[Entry] = []

    # ------------------------------------------------------------------ candidate heaps

    def key(self, node: Node) -> tuple[int, ...]:
        """Least recently used first (the component's own stamp), deepest first, then by hash."""
        assert node.comp is not None
        return (node.comp[self.base + STAMP], -node.depth, node.hash)

    def offer(self, node: Node) -> None:
        """Push a heap entry for ``node`` if it is a candidate (stale entries are skipped on pop)."""
        rec, b = node.comp, self.base
        if rec is None or node.parent is None:
            return
        if len(self.device_heap) + len(self.host_heap) > 4 * len(self.tree.nodes) + 64:
            self.rebuild()
        if is_part_evictable(rec, b):
            heapq.heappush(self.device_heap, (self.key(node), node.node_id))
        if is_part_host_candidate(rec, b):
            heapq.heappush(self.host_heap, (self.key(node), node.node_id))

    def rebuild(self) -> None:
        """Drop stale entries; nodes in insertion order, so every rank rebuilds alike."""
        b = self.base
        nodes = [n for n in self.tree.nodes.values() if n.comp is not None and n.parent is not None]
        self.device_heap = [(self.key(n), n.node_id) for n in nodes if is_part_evictable(n.comp, b)]  # type: ignore[arg-type]
        self.host_heap = [(self.key(n), n.node_id) for n in nodes if is_part_host_candidate(n.comp, b)]  # type: ignore[arg-type]
        heapq.heapify(self.device_heap)
        heapq.heapify(self.host_heap)

    def live(self, entry: Entry, device: bool) -> Node | None:
        """The node of a heap entry if the entry is current (a candidate with that key)."""
        node = self.tree.nodes.get(entry[1])
        if node is None or node.comp is None:
            return None
        ok = is_part_evictable(node.comp, self.base) if device else is_part_host_candidate(node.comp, self.base)
        return node if ok and self.key(node) == entry[0] else None

    def pop(self, device: bool) -> Node | None:
        heap = self.device_heap if device else self.host_heap
        while heap:
            node = self.live(heapq.heappop(heap), device)
            if node is not None:
                return node
        return None
