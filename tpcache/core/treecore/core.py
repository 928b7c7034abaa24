"""``TreeCore``: the one interface between a cache rank's orchestration and its per-node state.

The tree (``tree``), the one mutator of node state and what summarizes it (``ledger``: digest,
counters, mirror index, backlog, allocators, components' pools, change feed) and the eviction
candidates (``candidates``) are composed here. Orchestration (operations, leases, backup, prefetch,
admission, completions, the round) names a node by its id, an ``int`` that never changes and is
never reused, and reads and changes node state only through the methods below, which take ids and
return plain values. Which backend holds the nodes (``reference``: the Python of this package;
``native``: the C extension built from it) is chosen once by ``tpcache.core.backend``; every method
behaves the same on both, and ``tests/treecore`` holds both to it.

A lease's holdings, its cursor and an op's nodes hold ids too: no module outside this package
passes or receives a node handle (``tests/unit/test_architecture.py``). A ``Walk`` that ``walk``
returns is read outside by its ``ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tpcache.core.backend import NATIVE as _native
from tpcache.core.config import CacheConfig
from tpcache.core.records import Lease, Stats
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.treecore.accounting import is_mirror
from tpcache.core.treecore.bulk import BulkReads
from tpcache.core.treecore.components import HPINS, host_parts_releasable, is_part_mirror
from tpcache.core.treecore.eviction import Candidates
from tpcache.core.treecore.ledger import Ledger
from tpcache.core.treecore.tree import Node, RadixTree, Walk

_VALID = DeviceState.VALID
_HOST_VALID = HostState.VALID
_WRITING = StorageState.WRITING


def _host_only_child(node: Node) -> bool:
    """A child of ``node`` is on host but not on device: its host copy hangs from this node's page,
    so this node's host copy must stay (for a host-only parent, or a mirror whose device copy goes)."""
    return any(c.on_host and not c.on_device for c in node.child_nodes())


ROOT = 0  # the root's id: it holds no page and is never removed


class NodeView(NamedTuple):
    """One node's state as plain values (a snapshot: it does not follow later changes)."""

    node_id: int
    parent: int  # -1 for the root
    depth: int
    page_hash: int
    tokens: bytes
    device_state: int
    device_page: int
    device_pins: int
    host_state: int
    host_slot: int
    host_pins: int
    storage_state: int
    last_access: int
    hits: int
    component: tuple[int, ...] | None
    record: int


class TreeCore(BulkReads):
    """All per-node state of one cache rank, by node id.

    Invariants every method keeps (``invariants.check`` recomputes them from the nodes):
    - a node's id names it from its creation to its removal, and no other node after;
    - a node resident on a tier has its parent resident there (or on device, for a host copy);
    - every device page and host slot is free, or held by exactly one node or lease;
    - the digest is the sum of every node's and lease's record, and the counters, mirror index and
      candidate heaps equal what they summarize, after every call that returns.
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.tree = RadixTree(config.page_size, config.namespace)
        self.candidates = Candidates(config.eviction_policy, self.tree)
        self.ledger = Ledger(config, self.tree, self.candidates)

    # ------------------------------------------------------------------ reads: plain values

    @property
    def stats(self) -> Stats:
        """The rank's counters (plain ints)."""
        return self.ledger.stats

    @property
    def components(self) -> int:
        """How many components besides full attention each node records (0: not a hybrid model)."""
        return len(self.ledger.parts)

    @property
    def clock(self) -> int:
        """The logical clock: advanced once per sequenced operation, never by wall time."""
        return self.ledger.clock

    def __len__(self) -> int:
        """Nodes in the tree, the root excluded."""
        return len(self.tree)

    def ids(self) -> list[int]:
        """Every node's id, ascending (creation order), the root excluded."""
        return sorted(self.tree.nodes)[1:]

    def exists(self, node_id: int) -> bool:
        """The node is in the tree (the root always is)."""
        return node_id in self.tree.nodes

    def parent_of(self, node_id: int) -> int:
        """The parent's id; -1 for the root. A node's parent never changes while it lives."""
        parent = self.tree.nodes[node_id].parent
        return -1 if parent is None else parent.node_id

    def children_of(self, node_id: int) -> list[int]:
        """The children's ids, ascending (an order every rank and backend agrees on)."""
        return sorted(c.node_id for c in self.tree.nodes[node_id].child_nodes())

    def path_of(self, node_id: int) -> list[int]:
        """Ids from the first page down to this node, the root excluded (the root: empty)."""
        return [n.node_id for n in self.tree.nodes[node_id].path()]

    def view(self, node_id: int) -> NodeView:
        """Every field of the node as plain values."""
        n = self.tree.nodes[node_id]
        return NodeView(
            n.node_id,
            -1 if n.parent is None else n.parent.node_id,
            n.depth,
            n.hash,
            bytes(n.tokens),
            int(n.device_state),
            n.device_page,
            n.device_pins,
            int(n.host_state),
            n.host_slot,
            n.host_pins,
            int(n.storage_state),
            n.last_access,
            n.hits,
            None if n.comp is None else tuple(n.comp),
            n.record,
        )

    def device(self, node_id: int) -> tuple[int, int]:
        """(device state, device page); the page is -1 exactly when the state is NONE."""
        n = self.tree.nodes[node_id]
        return int(n.device_state), n.device_page

    def host(self, node_id: int) -> tuple[int, int]:
        """(host state, host slot); the slot is -1 exactly when the state is NONE."""
        n = self.tree.nodes[node_id]
        return int(n.host_state), n.host_slot

    def storage(self, node_id: int) -> int:
        """The storage state (durability is tracked only for pages the tree holds)."""
        return int(self.tree.nodes[node_id].storage_state)

    def pins(self, node_id: int) -> tuple[int, int]:
        """(device pins, host pins): leases holding the page plus copies in flight reading it."""
        n = self.tree.nodes[node_id]
        return n.device_pins, n.host_pins

    def component(self, node_id: int) -> tuple[int, ...] | None:
        """A hybrid model's per-component record of the node (``components.py``), None without one."""
        comp = self.tree.nodes[node_id].comp
        return None if comp is None else tuple(comp)

    def host_copy_idle(self, node_id: int) -> bool:
        """The node's host slot is no longer needed by anything: it is a page (not the root), valid on
        host, no lease or copy reads it, no write of it to storage is in flight, and no host-only page
        hangs from it (it would hang from nothing)."""
        node = self.tree.nodes[node_id]
        return (
            node.parent is not None
            and node.host_state == _HOST_VALID
            and node.host_pins == 0
            and node.storage_state != _WRITING
            and not _host_only_child(node)
        )

    def mirror_releasable(self, node_id: int) -> bool:
        """The node's host copy is a redundant mirror that may go (``free_host_copy``) losing
        nothing: it is a page (not the root) on device, on host and durable in storage, no lease or
        copy reads its slot, no host-only page hangs from it (it would need this device copy kept),
        and each component copy it holds on host is itself such a mirror, unpinned."""
        node = self.tree.nodes[node_id]
        return (
            node.parent is not None
            and is_mirror(node)
            and node.host_pins == 0
            and not _host_only_child(node)
            and (node.comp is None or host_parts_releasable(node))
        )

    def part_mirror_releasable(self, node_id: int, part: int) -> bool:
        """Component ``part``'s host copy of the node is a redundant mirror: on device, on host and
        durable, and unpinned on host (``free_part_host`` loses nothing)."""
        rec = self.tree.nodes[node_id].comp
        base = self.ledger.parts[part].base
        return rec is not None and is_part_mirror(rec, base) and rec[base + HPINS] == 0

    def releasable_mirrors(self, limit: int) -> list[int]:
        """The ids of at most ``limit`` pages whose host mirror may go (``mirror_releasable``), least
        valuable first by the eviction policy's key (ties: in the mirror index's order). Every such
        page is in the mirror index, so one pass over it finds them all. Pure."""
        mirrors = self.ledger.mirrors
        if limit <= 0 or not mirrors:
            return []
        found = [n for n in mirrors.values() if self.mirror_releasable(n.node_id)]
        found.sort(key=self.candidates.policy.key)
        return [n.node_id for n in found[:limit]]

    def releasable_part_mirrors(self, part: int, limit: int) -> list[int]:
        """The ids of at most ``limit`` nodes whose component ``part`` host copy may go
        (``part_mirror_releasable``), least valuable first by the component's own key. Pure."""
        p = self.ledger.parts[part]
        if limit <= 0 or not p.mirrors:
            return []
        found = sorted((n for n in p.mirrors.values() if self.part_mirror_releasable(n.node_id, part)), key=p.key)
        return [n.node_id for n in found[:limit]]

    # ------------------------------------------------------------------ changes

    def update(
        self,
        node_id: int,
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
        """Change one node: tier states with their page or slot, pin deltas, an access stamp (the
        clock now), a hit; ``part`` > 0: that component's data instead. Every transition is checked
        against the tier tables (IllegalTransition, nothing changed); the digest, counters, mirrors,
        candidates and feed follow."""
        self.ledger.update(
            self.tree.nodes[node_id],
            device=device,
            host=host,
            storage=storage,
            device_pins=device_pins,
            host_pins=host_pins,
            stamp=stamp,
            hit=hit,
            part=part,
        )

    def touch(self, ids: Sequence[int], device_pins: int, stamp: bool = False, hit: bool = False) -> list[int]:
        """``update(i, device_pins=..., stamp=..., hit=...)`` for each id in order, in one loop (in C
        where built): pins, stamps and hits change no tier, so no mirror and no neighbour's candidacy.
        Returns ``unresident(ids)``, found in the same pass (a release's next question)."""
        return self.ledger.touch(ids, device_pins, stamp, hit)

    def touch_walk(self, walk: Walk, count: int, device_pins: int, stamp: bool = False, hit: bool = False) -> None:
        """``touch(walk.ids[:count], ...)`` for a walk made by this operation (its nodes are in the
        tree), without looking its ids up: a lock's hit."""
        nodes = walk.nodes
        self.ledger.touch((), device_pins, stamp, hit, nodes if count == len(nodes) else nodes[:count])

    def settle(
        self,
        ids: Sequence[int],
        device: DeviceState | None = None,
        host: HostState | None = None,
        storage: StorageState | None = None,
        host_pins: int = 0,
    ) -> None:
        """``update(i, device=(device, its page), host=(host, its slot), storage=..., host_pins=...)``
        for each id in order (None: that tier unchanged): one agreed copy's change, in one loop."""
        nodes = self.tree.nodes
        self.ledger.settle([nodes[i] for i in ids], device, host, storage, host_pins)

    def free_host_copy(self, node_id: int) -> None:
        """Drop the node's host copy and free its slot (the node may then hold nothing: see
        ``remove_if_empty``). Its host pins must be 0."""
        self.ledger.free_host_copy(self.tree.nodes[node_id])

    def add_host_page(self, parent: int, tokens: bytes, page_hash: int, slot: int) -> int:
        """A new node under ``parent`` for one page (its ``tokens``, chain hash ``page_hash``), host
        WRITING into ``slot``, stamped now; returns its id, larger than every id before it. The parent
        must have no child for these tokens."""
        node = self.ledger.add(self.tree.nodes[parent], tokens, page_hash, host=(HostState.WRITING, slot))
        return node.node_id

    def dispose(self) -> None:
        """Drop every node (a reset): the tree is empty afterwards and this core is not used again."""
        self.tree.dispose()

    def add_pinned_chain(self, parent: int, data: bytes, offset: int, pages: list[int]) -> list[int]:
        """New nodes for the pages of ``data`` from byte ``offset`` on, one per page of ``pages``,
        each below the one before, the first below ``parent``; returns their ids, each larger than
        every id before it. Each is device VALID on its page, pinned once, stamped now and counted
        protected. ``parent`` must have no child for the first page."""
        led, tree = self.ledger, self.tree
        if _native is not None and not led.parts:  # the same nodes, hashes and records in C (_chain.c)
            at = tree.nodes, tree._next_id, self.page_size, tree.seed  # (ids from the tree's next on)
            made = _native.pinned_chain(*at, tree.nodes[parent], data, offset, pages, led.clock)
            if made is not None:
                nodes, records, ids = made
                led.count_chain(nodes, records)
                return ids
        return led.add_pinned_chain(tree.nodes[parent], data, offset, pages)

    def append_chain(self, lease: Lease, cursor: int, data: bytes, pages: list[int]) -> list[int] | None:
        """``add_pinned_chain`` below the lease's cursor for an append whose pages are all new and
        that the lease holds, with the clock ticked and the lease adopting them (its pages leave
        ``lease.pages``, their ids join ``lease.device_nodes``, its cursor moves to the last one if
        it pins exactly that path): the ids, in C where built. None, changing nothing, for any other
        append (the caller's own steps decide it)."""
        led, tree = self.ledger, self.tree
        if _native is None or led.parts:
            return None
        nodes, clock = tree.nodes, led.clock + 1
        made = _native.append_chain(
            nodes,
            tree._next_id,
            self.page_size,
            tree.seed,
            clock,
            lease.pages,
            lease.device_nodes,
            nodes[cursor],
            data,
            pages,
        )
        if made is None:
            return None
        ids, records, whole, chain = made
        led.clock = clock
        led.count_chain(chain, records)
        lease.cursor = ids[-1] if whole else None
        return ids

    def free_device_pages(self, pages: Sequence[int]) -> None:
        """Return device pages no node holds (a failed load's, a lease's unused ones) to the free list."""
        self.ledger.device.free(pages)

    def part_base(self, part: int) -> int:
        """Where component ``part``'s fields start in a node's ``component`` record."""
        return self.ledger.parts[part].base

    def free_part_device(self, node_id: int, part: int) -> None:
        """Drop component ``part``'s device copy of the node and free its slot (a tombstone if the
        node's full page stays). The component must be on device and unpinned there."""
        self.ledger.free_part_device(self.tree.nodes[node_id], self.ledger.parts[part])

    def free_part_host(self, node_id: int, part: int) -> None:
        """Drop component ``part``'s host copy of the node and free its slot."""
        self.ledger.free_part_host(self.tree.nodes[node_id], self.ledger.parts[part])

    def remove_if_empty(self, node_id: int) -> None:
        """Remove the node, and then each ancestor in turn, while it is a leaf that holds nothing on
        any tier and nothing pins; its id is never used again. The root stays."""
        self.ledger.remove_if_empty(self.tree.nodes[node_id])

    def remove_empty(self, ids: Sequence[int]) -> None:
        """``remove_if_empty`` for each id, last first, skipping ids already removed by an earlier one."""
        self.ledger.remove_empty(ids)
