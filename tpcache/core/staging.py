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

from tpcache.core.tiers import HostState
from tpcache.core.treecore import TreeCore


class Staging:
    """The buffer mode's slot release. ``enabled`` is False in cache mode, where every call is a no-op."""

    def __init__(self, core: TreeCore) -> None:
        self.core = core
        self.enabled = core.config.host_mode == "buffer"
        self.candidates: dict[int, None] = {}  # ids of host-resident nodes whose slot may be freed soon

    def note(self, ids: Iterable[int]) -> None:
        """Nodes (their ids) whose staging may have ended (an agreed copy over them, a lease letting go)."""
        if self.enabled:
            self.candidates.update(dict.fromkeys(ids))

    def release(self) -> int:
        """Once per commit (and after a release): free every staging slot that is done."""
        if not self.enabled or not self.candidates:
            return 0
        core = self.core
        freed = 0
        changed = True
        while changed:  # freeing a child can make its parent free: iterate to the fixed point
            changed = False
            for node_id in list(self.candidates):
                if not core.exists(node_id) or core.host(node_id)[0] == HostState.NONE:
                    del self.candidates[node_id]
                elif core.host_copy_idle(node_id):
                    del self.candidates[node_id]
                    parent = core.parent_of(node_id)
                    core.free_host_copy(node_id)
                    core.remove_if_empty(node_id)
                    if parent > 0 and core.exists(parent) and core.host(parent)[0] == HostState.VALID:
                        self.candidates[parent] = None
                    freed += 1
                    changed = True
        core.stats.staging_freed_pages += freed
        return freed
