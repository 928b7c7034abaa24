"""Buffer-only host mode: host slots stage storage traffic and are never a cached tier.

With ``host_mode = "buffer"`` a host slot holds a page only on its way somewhere else:

- a storage read (prefetch) lands in host and waits there for the load that takes it to device;
- a backup copies a device page to host and waits there for its storage write.

Invariants (on top of the cache's):
- ``match`` never reports a host page as a hit, so ``lock`` pins none and nothing is counted as a
  host hit; a staged page reaches a request only through its load, counted at admission commit;
- a staging slot is freed in the commit that makes it redundant, by agreed state only: the load
  that took it to device, or the storage write that made it durable, was agreed complete on every
  rank, and nothing pins it (no lease, no copy reading it). A write that failed frees it too: host
  never keeps what storage does not;
- what to free is a fixed point over the candidates, so the order they were noted in never
  changes the outcome (every rank notes the same ones anyway: sequenced ops, agreed completions).
"""

from __future__ import annotations

from collections.abc import Iterable

from tpcache.core.tiers import HostState, StorageState
from tpcache.core.treecore.ledger import Ledger
from tpcache.core.treecore.tree import Node


def staging_done(node: Node) -> bool:
    """The node's host slot is no longer needed: its page is valid there, nothing reads it, no write
    of it to storage is in flight, and no host-only page hangs from it (it would hang from nothing)."""
    return (
        node.parent is not None
        and node.host_state == HostState.VALID
        and node.host_pins == 0
        and node.storage_state != StorageState.WRITING
        and not any(c.on_host and not c.on_device for c in node.children.values())
    )


class Staging:
    """The buffer mode's slot release. ``enabled`` is False in cache mode, where every call is a no-op."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.enabled = ledger.config.host_mode == "buffer"
        self.candidates: dict[int, Node] = {}  # host-resident nodes whose slot may be freed soon

    def note(self, nodes: Iterable[Node]) -> None:
        """Nodes whose staging may have ended (an agreed copy over them, a lease letting go)."""
        if self.enabled:
            for node in nodes:
                self.candidates[node.node_id] = node

    def release(self) -> int:
        """Once per commit (and after a release): free every staging slot that is done."""
        if not self.enabled or not self.candidates:
            return 0
        led = self.ledger
        freed = 0
        changed = True
        while changed:  # freeing a child can make its parent free: iterate to the fixed point
            changed = False
            for node_id, node in list(self.candidates.items()):
                if led.tree.nodes.get(node_id) is not node or node.host_state == HostState.NONE:
                    del self.candidates[node_id]
                elif staging_done(node):
                    del self.candidates[node_id]
                    parent = node.parent
                    led.free_host_copy(node)
                    led.remove_if_empty(node)
                    if parent is not None and parent.parent is not None and parent.host_state == HostState.VALID:
                        self.candidates[parent.node_id] = parent
                    freed += 1
                    changed = True
        led.stats.staging_freed_pages += freed
        return freed
