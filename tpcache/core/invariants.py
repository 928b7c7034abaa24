"""Invariant checks, cheap enough to run after every operation in tests.

Each check recomputes from scratch what the cache maintains incrementally and compares.
"""

from __future__ import annotations

from collections.abc import Callable

from tpcache.core.cache import CacheCore, OpKind
from tpcache.core.digest import Digest
from tpcache.core.ledger import is_mirror
from tpcache.core.tiers import DeviceState, HostState, StorageState


class InvariantViolation(AssertionError):
    pass


def check(core: CacheCore) -> None:
    def fail(msg: str) -> None:
        raise InvariantViolation(msg)

    core.device.check()
    core.host.check()
    device_owner: dict[int, str] = {}
    host_owner: dict[int, str] = {}
    dev_pins: dict[int, int] = {}
    host_pins: dict[int, int] = {}

    def own(table: dict[int, str], page: int, who: str) -> None:
        if page in table:
            fail(f"page/slot {page} owned twice: by {table[page]} and {who}")
        table[page] = who

    for lease in core.leases.values():
        if lease.releasing and not lease.ops:
            fail(f"lease {lease.lease_id} is releasing with nothing in flight: leaked")
        ids = [n.node_id for n in lease.device_nodes]
        if len(set(ids)) != len(ids):
            fail(f"lease {lease.lease_id} pins a node twice on device")
        pinned = set(ids)
        for n in lease.device_nodes:  # a lease pins whole paths: no pinned page has an unpinned ancestor
            if n.parent is not None and n.parent.parent is not None and n.parent.node_id not in pinned:
                fail(f"lease {lease.lease_id} pins node {n.node_id} but not its parent {n.parent.node_id}")
        for op_id in lease.ops:
            if lease.lease_id not in core.op_waiters.get(op_id, ()):
                fail(f"lease {lease.lease_id} waits for op {op_id} but is not registered as its waiter")
        for p in lease.pages:
            own(device_owner, p, f"lease {lease.lease_id}")
        for n in lease.device_nodes:
            dev_pins[n.node_id] = dev_pins.get(n.node_id, 0) + 1
        for n in lease.host_nodes:
            host_pins[n.node_id] = host_pins.get(n.node_id, 0) + 1
        for op_id in lease.ops:
            if not any(op.op_id == op_id for q in core.inflight.values() for op in q):
                fail(f"lease {lease.lease_id} waits for op {op_id}, which is not in flight")
    for kind, queue in core.inflight.items():
        for op in queue:
            for n in op.pinned:
                dev_pins[n.node_id] = dev_pins.get(n.node_id, 0) + 1
            for n in op.nodes:
                if n.parent is None:
                    fail(f"op {op.op_id} references a removed node {n.node_id}")
                if kind == OpKind.BACKUP:
                    if n.host_state != HostState.WRITING:
                        fail(f"backup op {op.op_id}: node {n.node_id} host state {n.host_state.name}")
                elif kind == OpKind.LOAD and not op.engine_pages:  # an engine load reads under its lease's pins
                    host_pins[n.node_id] = host_pins.get(n.node_id, 0) + 1
                    if n.device_state != DeviceState.LOADING:
                        fail(f"load op {op.op_id}: node {n.node_id} device state {n.device_state.name}")
                elif kind == OpKind.STORAGE_READ:
                    if n.host_state != HostState.WRITING:
                        fail(f"storage read op {op.op_id}: node {n.node_id} is {n!r}")
                elif kind == OpKind.STORAGE_WRITE:
                    host_pins[n.node_id] = host_pins.get(n.node_id, 0) + 1
                    if n.storage_state != StorageState.WRITING or n.host_state != HostState.VALID:
                        fail(f"storage write op {op.op_id}: node {n.node_id} is {n!r}")

    digest = Digest()
    evictable = protected = 0
    mirrors: list[int] = []
    for node in core.tree.nodes.values():
        if node.parent is None:
            continue
        digest.add(node.record)
        if node.parent.children.get(node.tokens) is not node:
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
        if node.device_pins != dev_pins.get(node.node_id, 0):
            fail(
                f"node {node.node_id}: {node.device_pins} device pins, holders account for "
                f"{dev_pins.get(node.node_id, 0)}"
            )
        if node.host_pins != host_pins.get(node.node_id, 0):
            fail(
                f"node {node.node_id}: {node.host_pins} host pins, holders account for {host_pins.get(node.node_id, 0)}"
            )
        if not node.resident and not node.children and not node.device_pins and not node.host_pins:
            fail(f"node {node.node_id} holds nothing and should have been removed")
        if node.device_state == DeviceState.VALID and node.device_pins == 0:
            evictable += 1
        elif node.on_device and node.device_pins > 0:
            protected += 1
        if is_mirror(node):
            mirrors.append(node.node_id)
    for lease in core.leases.values():
        digest.add(lease.record)
    for page in device_owner:
        if not core.device.is_owned(page):
            fail(f"device page {page} is in use but marked free")
    if len(device_owner) != core.device.used:
        fail(f"device pool: {core.device.used} pages used, {len(device_owner)} accounted for (leak)")
    if len(host_owner) != core.host.used:
        fail(f"host pool: {core.host.used} slots used, {len(host_owner)} accounted for (leak)")
    if evictable != core.evictable_device_pages:
        fail(f"evictable counter {core.evictable_device_pages} != {evictable}")
    if protected != core.protected_device_pages:
        fail(f"protected counter {core.protected_device_pages} != {protected}")
    if sorted(mirrors) != sorted(core.mirrors) or any(core.tree.nodes.get(i) is not n for i, n in core.mirrors.items()):
        fail(f"mirror index {sorted(core.mirrors)} != {sorted(mirrors)}")
    _check_page_caches(core, fail)
    if digest.value != core.digest.value:
        fail("incremental digest differs from the recomputed digest")


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
