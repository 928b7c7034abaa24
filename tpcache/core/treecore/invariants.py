"""Invariant checks, cheap enough to run after every operation in tests.

Each check recomputes from the nodes' own fields what the core maintains incrementally (records,
digest, counters, mirror index, candidate heaps, pins) and compares, with the same functions the
ledger uses: a field changed behind the ledger's back is caught here.
"""

from __future__ import annotations

from collections.abc import Callable

from tpcache.core.cache import CacheCore, OpKind
from tpcache.core.digest import Digest
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.treecore.accounting import is_evictable, is_mirror, is_protected, lease_record, reference_record_of
from tpcache.core.treecore.components import (
    DEV,
    DPINS,
    DSLOT,
    HOST,
    HPINS,
    HSLOT,
    STORE,
    Part,
    host_parts_idle,
    is_part_evictable,
    is_part_host_candidate,
    is_part_mirror,
)
from tpcache.core.treecore.eviction import is_device_candidate, is_host_candidate
from tpcache.core.treecore.tree import Node


class InvariantViolation(AssertionError):
    pass


def check(core: CacheCore) -> None:
    def fail(msg: str) -> None:
        raise InvariantViolation(msg)

    core.book.fold()  # a lease changed without a refresh stays stale, and the record check below sees it
    core.device.check()
    core.host.check()
    device_owner: dict[int, str] = {}
    host_owner: dict[int, str] = {}
    dev_pins: dict[int, int] = {}
    host_pins: dict[int, int] = {}
    inflight = {op.op_id for q in core.inflight.values() for op in q}

    def own(table: dict[int, str], page: int, who: str) -> None:
        if page in table:
            fail(f"page/slot {page} owned twice: by {table[page]} and {who}")
        table[page] = who

    digest = Digest()
    for lease in core.leases.values():
        if lease.releasing and not lease.ops:
            fail(f"lease {lease.lease_id} is releasing with nothing in flight: leaked")
        fetch = lease.prefetch
        if fetch is not None and fetch.status != "done" and core.prefetcher.started.get(lease.lease_id) is not lease:
            fail(f"lease {lease.lease_id}: its fetch is {fetch.status} but not among those a commit ticks")
        ids = list(lease.device_nodes)
        if len(set(ids)) != len(ids):
            fail(f"lease {lease.lease_id} pins a node twice on device")
        pinned = set(ids)
        for held in (lease.device_nodes, lease.host_nodes, lease.pages):
            if held.total != held.recount():
                fail(f"lease {lease.lease_id}: a holding's total is stale (changed around its methods)")
        for node_id in (*lease.device_nodes, *lease.host_nodes):
            if node_id not in core.tree.nodes:
                fail(f"lease {lease.lease_id} pins node {node_id}, which is not in the tree")
                return
        cursor = None if lease.cursor is None else core.tree.nodes.get(lease.cursor)
        if lease.cursor is not None and (
            cursor is None
            or len(ids) != cursor.depth
            or any(n.node_id not in pinned or not n.device_valid for n in cursor.path())
        ):
            fail(f"lease {lease.lease_id}: it does not pin exactly the valid path to its cursor {lease.cursor}")
        # A lease pins whole paths: no pinned page has an unpinned ancestor.
        for n in (core.tree.nodes[i] for i in lease.device_nodes):
            if n.parent is not None and n.parent.parent is not None and n.parent.node_id not in pinned:
                fail(f"lease {lease.lease_id} pins node {n.node_id} but not its parent {n.parent.node_id}")
        for op_id in lease.ops:
            if lease.lease_id not in core.book.waiters.get(op_id, ()):
                fail(f"lease {lease.lease_id} waits for op {op_id} but is not registered as its waiter")
            if op_id not in inflight:
                fail(f"lease {lease.lease_id} waits for op {op_id}, which is not in flight")
        for p in lease.pages:
            own(device_owner, p, f"lease {lease.lease_id}")
        for node_id in lease.device_nodes:
            dev_pins[node_id] = dev_pins.get(node_id, 0) + 1
        for node_id in lease.host_nodes:
            host_pins[node_id] = host_pins.get(node_id, 0) + 1
        fields = lease.state_fields()
        if lease.record != lease_record(lease, fields):
            fail(f"lease {lease.lease_id}: its digest record is stale (changed outside the ledger)")
        digest.add(lease_record(lease, fields))
    _check_ops(core, fail, dev_pins, host_pins)

    evictable = protected = 0
    mirrors: list[int] = []
    for node in core.tree.nodes.values():
        if node.parent is None:
            continue
        record = reference_record_of(node)
        if node.record != record:
            fail(f"node {node.node_id}: its digest record is stale (a field changed outside the ledger)")
        digest.add(record)
        if node.parent.child(node.tokens) is not node:
            fail(f"node {node.node_id} is not its parent's child")
        parent_root = node.parent.parent is None
        if node.device_state == DeviceState.VALID and not parent_root and node.parent.device_state != DeviceState.VALID:
            fail(f"node {node.node_id} is device-VALID under a parent that is not (match relies on it)")
        if node.on_device:
            own(device_owner, node.device_page, f"node {node.node_id}")
            if not parent_root and not node.parent.on_device:
                fail(f"node {node.node_id} on device but its parent is not (ancestor-closed)")
        elif node.device_page != -1:
            fail(f"node {node.node_id} has a device page without device state")
        if node.on_host:
            own(host_owner, node.host_slot, f"node {node.node_id}")
            if not parent_root and not (node.parent.on_host or node.parent.on_device):
                fail(f"node {node.node_id} on host but its parent is on neither device nor host (ancestor-closed)")
        elif node.host_slot != -1:
            fail(f"node {node.node_id} has a host slot without host state")
        if node.device_pins < 0 or node.host_pins < 0:
            fail(f"node {node.node_id} has negative pins")
        for name, have, want in (
            ("device", node.device_pins, dev_pins.get(node.node_id, 0)),
            ("host", node.host_pins, host_pins.get(node.node_id, 0)),
        ):
            if have != want:
                fail(f"node {node.node_id}: {have} {name} pins, holders account for {want}")
        if not node.resident and not node.num_children and not node.device_pins and not node.host_pins:
            fail(f"node {node.node_id} holds nothing and should have been removed")
        if is_evictable(node) and node.host_state == HostState.NONE and not _host_only_below_droppable(node):
            fail(f"node {node.node_id} counts as evictable but host pages below it hold it on device")
        evictable += is_evictable(node)
        protected += is_protected(node)
        if is_mirror(node):
            mirrors.append(node.node_id)
    for page in device_owner:
        if not core.device.is_owned(page):
            fail(f"device page {page} is in use but marked free")
    if len(device_owner) != core.device.used:
        fail(f"device pool: {core.device.used} pages used, {len(device_owner)} accounted for (leak)")
    if len(host_owner) != core.host.used:
        fail(f"host pool: {core.host.used} slots used, {len(host_owner)} accounted for (leak)")
    if evictable != core.ledger.evictable_device_pages:
        fail(f"evictable counter {core.ledger.evictable_device_pages} != {evictable}")
    if protected != core.ledger.protected_device_pages:
        fail(f"protected counter {core.ledger.protected_device_pages} != {protected}")
    if sorted(mirrors) != sorted(core.ledger.mirrors) or any(
        core.tree.nodes.get(i) is not n for i, n in core.ledger.mirrors.items()
    ):
        fail(f"mirror index {sorted(core.ledger.mirrors)} != {sorted(mirrors)}")
    if core.backup.storage_down:
        _check_storage_off(core, fail)
    _check_candidates(core, fail)
    _check_page_caches(core, fail)
    for part in core.ledger.parts.values():
        _check_part(core, part, fail)
    if digest.value != core.digest.value:
        fail("incremental digest differs from the digest recomputed from every node and lease")


def _check_storage_off(core: CacheCore, fail: Callable[[str], None]) -> None:
    """Storage agreed unusable: no page or component data counts as durable, and no storage op
    was issued since."""
    for kind in (OpKind.STORAGE_QUERY, OpKind.STORAGE_READ, OpKind.STORAGE_WRITE):
        for op in core.inflight[kind]:
            if op.op_id >= core.backup.down_from_op:
                fail(f"{kind.name} op {op.op_id} issued after storage was agreed unusable")
    parts = list(core.ledger.parts.values())
    for node in core.tree.nodes.values():
        if node.storage_state == StorageState.DURABLE:
            fail(f"node {node.node_id} is durable in storage, which was agreed unusable")
        rec = node.comp
        for p in parts if rec is not None else ():
            if rec[p.base + STORE] == StorageState.DURABLE:  # type: ignore[index]
                fail(f"node {node.node_id}'s {p.name} data is durable in storage, which was agreed unusable")


def _host_only_below_droppable(node: Node) -> bool:
    """The host-only pages hanging from ``node`` could go with it (so evicting it is possible)."""
    stack = [c for c in node.child_nodes() if c.on_host and not c.on_device]
    while stack:
        child = stack.pop()
        if child.host_state != HostState.VALID or child.host_pins or not host_parts_idle(child):
            return False
        stack.extend(c for c in child.child_nodes() if c.on_host)
    return True


def _check_ops(
    core: CacheCore, fail: Callable[[str], None], dev_pins: dict[int, int], host_pins: dict[int, int]
) -> None:
    """Each op's pins are counted, and its pages are in the in-flight state its kind implies."""
    expect = {
        OpKind.BACKUP: lambda n: n.host_state == HostState.WRITING,
        OpKind.LOAD: lambda n: n.device_state == DeviceState.LOADING,
        OpKind.STORAGE_READ: lambda n: n.host_state == HostState.WRITING,
        OpKind.STORAGE_WRITE: lambda n: n.storage_state == StorageState.WRITING and n.host_state == HostState.VALID,
        OpKind.STORAGE_QUERY: lambda n: True,
    }
    for kind, queue in core.inflight.items():
        for op in queue:
            for node_id in op.pinned:
                dev_pins[node_id] = dev_pins.get(node_id, 0) + 1
            nodes = core.tree.nodes
            for node_id in op.nodes:
                if node_id not in nodes or nodes[node_id].parent is None:
                    fail(f"op {op.op_id} references a removed node {node_id}")
                    return
            for _, node_id in op.full_moves():
                n = nodes[node_id]
                if op.engine_pages and kind == OpKind.LOAD:
                    if n.host_state != HostState.VALID:  # reads under its lease's pins, into engine blocks
                        fail(f"engine load op {op.op_id}: node {n.node_id} is {n!r}")
                    continue
                if kind in (OpKind.LOAD, OpKind.STORAGE_WRITE):
                    host_pins[n.node_id] = host_pins.get(n.node_id, 0) + 1  # the op reads the host slot
                if not expect[kind](n):
                    fail(f"{kind.name} op {op.op_id}: node {n.node_id} is {n!r}")


def _check_candidates(core: CacheCore, fail: Callable[[str], None]) -> None:
    """Every eviction candidate has a live entry (its current key) in its heap."""
    key = core.candidates.policy.key
    device = set(core.candidates.device_heap)
    host = set(core.candidates.host_heap)
    for node in core.tree.nodes.values():
        if is_device_candidate(node) and key(node) << 64 | node.node_id not in device:
            fail(f"node {node.node_id} is a device eviction candidate missing from the device heap")
        if is_host_candidate(node) and key(node) << 64 | node.node_id not in host:
            fail(f"node {node.node_id} is a host eviction candidate missing from the host heap")


def _check_page_caches(core: CacheCore, fail: Callable[[str], None]) -> None:
    """A run's cached device pages equal its nodes' pages, and each node is cached by one run."""
    for node in core.tree.nodes.values():
        run = node.pages_run
        if run is None or run.pages is None:
            continue
        index = [i for i, n in enumerate(run.nodes) if n is node]
        if len(index) != 1:
            fail(f"node {node.node_id} points at a page cache that does not hold it")
        elif run.pages[index[0]] != node.device_page:
            fail(f"node {node.node_id}: cached device page {run.pages[index[0]]} != {node.device_page}")
        for other in run.nodes:  # every node of a cache in the tree points back at it
            if core.tree.nodes.get(other.node_id) is other and other.pages_run is not run:
                fail(f"node {other.node_id} is cached by a run it does not point at")


def _check_part(core: CacheCore, p: Part, fail: Callable[[str], None]) -> None:
    """One component: slots owned once, pins accounted, data only beside its full page, counters,
    mirror index and heaps equal to the records (recomputed here, as for full pages)."""
    p.device.check()
    p.host.check()
    b, c = p.base, p.index
    dev_owner: dict[int, str] = {}
    host_owner: dict[int, str] = {}
    dpins: dict[int, int] = {}
    hpins: dict[int, int] = {}

    def own(table: dict[int, str], slot: int, who: str) -> None:
        if slot in table:
            fail(f"{p.name} slot {slot} owned twice: by {table[slot]} and {who}")
        table[slot] = who

    for lease in core.leases.values():
        held = lease.parts.get(c)
        if held is None:
            continue
        for slot in held.pages:
            own(dev_owner, slot, f"lease {lease.lease_id}")
        for node_id in held.device_nodes:
            dpins[node_id] = dpins.get(node_id, 0) + 1
        for node_id in held.host_nodes:
            hpins[node_id] = hpins.get(node_id, 0) + 1
    expect = {
        OpKind.BACKUP: (HOST, 1),  # (field that must be in flight, state)
        OpKind.LOAD: (DEV, 1),
        OpKind.STORAGE_WRITE: (STORE, 1),
        OpKind.STORAGE_READ: (HOST, 1),
    }
    for kind, queue in core.inflight.items():
        for op in queue:
            for pc in op.parts:
                if pc.part != c:
                    continue
                field, state = expect[kind]
                for i in pc.index:
                    n = core.tree.nodes[op.nodes[i]]
                    if n.comp is None or n.comp[b + field] != state:
                        fail(f"{kind.name} op {op.op_id}: node {n.node_id}'s {p.name} data is not in flight")
                    pins = dpins if kind == OpKind.BACKUP else hpins
                    if kind != OpKind.STORAGE_READ:
                        pins[n.node_id] = pins.get(n.node_id, 0) + 1
    evictable = 0
    mirrors: list[int] = []
    key = p.key
    device_heap, host_heap = set(p.device_heap), set(p.host_heap)
    for node in core.tree.nodes.values():
        if node.parent is None:
            continue
        rec = node.comp
        if rec is None:
            fail(f"node {node.node_id} has no component record in a hybrid configuration")
            continue
        for tier, state, slot, owner, full_on in (
            ("device", rec[b + DEV], rec[b + DSLOT], dev_owner, node.on_device),
            ("host", rec[b + HOST], rec[b + HSLOT], host_owner, node.on_host),
        ):
            if state and not full_on:
                fail(f"node {node.node_id}: {p.name} data on {tier} without its full page there")
            if bool(state) != (slot != -1):
                fail(f"node {node.node_id}: {p.name} {tier} state and slot disagree")
            if state:
                own(owner, slot, f"node {node.node_id}")
        for name, have, want in (
            ("device", rec[b + DPINS], dpins.get(node.node_id, 0)),
            ("host", rec[b + HPINS], hpins.get(node.node_id, 0)),
        ):
            if have != want:
                fail(f"node {node.node_id}: {have} {p.name} {name} pins, holders account for {want}")
        if rec[b + DPINS] and not node.device_pins:
            fail(f"node {node.node_id}: {p.name} pinned on device but its full page is not")
        evictable += is_part_evictable(rec, b)
        if is_part_mirror(rec, b):
            mirrors.append(node.node_id)
        if is_part_evictable(rec, b) and (key(node), node.node_id) not in device_heap:
            fail(f"node {node.node_id}: {p.name} device candidate missing from its heap")
        if is_part_host_candidate(rec, b) and (key(node), node.node_id) not in host_heap:
            fail(f"node {node.node_id}: {p.name} host candidate missing from its heap")
    for slot in dev_owner:
        if not p.device.is_owned(slot):
            fail(f"{p.name} device slot {slot} is in use but marked free")
    if len(dev_owner) != p.device.used or len(host_owner) != p.host.used:
        fail(f"{p.name} pools: {p.device.used}/{p.host.used} used, {len(dev_owner)}/{len(host_owner)} accounted for")
    if evictable != p.evictable:
        fail(f"{p.name} evictable counter {p.evictable} != {evictable}")
    if sorted(mirrors) != sorted(p.mirrors):
        fail(f"{p.name} mirror index {sorted(p.mirrors)} != {sorted(mirrors)}")
    for what, table in (("backlog", p.backlog), ("release queue", p.behind)):
        for node_id, value in table.items():
            if node_id not in core.tree.nodes or value != node_id:
                fail(f"{p.name} {what} holds node {node_id}, which is not in the tree")
