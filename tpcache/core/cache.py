"""CacheCore: the deterministic state machine of one cache rank.

Sans-IO: inputs are sequenced operations (``lock``, ``alloc``, ``insert``, ``load``, ``release``,
...) and agreed completions (``complete``); outputs are replies and ``Transfer`` effects the shell
must carry out. The same inputs give the same state, page numbers, effects and digest on every
rank. Nothing here reads a clock, spawns a thread or talks to a socket.

Invariants (checked by ``invariants.check``):
- a node resident on a tier has its parent resident on that tier (ancestor-closed);
- every device page / host slot is owned by exactly one of: the free list, a tree node, a lease;
- ``node.device_pins`` == leases pinning it + in-flight ops reading it (same for host);
- ``evictable_device_pages`` counts device-VALID nodes with no pins; ``protected_device_pages``
  counts device-resident nodes with pins;
- a page is readable only in its final state (device/host VALID, storage DURABLE).
"""

from __future__ import annotations

import itertools
from collections import deque

from tpcache.core.allocator import OutOfPages
from tpcache.core.config import CacheConfig
from tpcache.core.hashing import TokenIds, as_token_bytes
from tpcache.core.ledger import Ledger, is_mirror
from tpcache.core.prefetch import Prefetcher
from tpcache.core.records import (
    CacheClosed,
    Lease,
    MatchResult,
    OpKind,
    Stats,
    Transfer,
    UnknownLease,
)
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.tree import Node

__all__ = ["CacheClosed", "CacheCore", "Lease", "MatchResult", "OpKind", "Stats", "Transfer", "UnknownLease"]


class CacheCore(Ledger):
    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)
        self.retention_cap_tokens = config.retention_cap_tokens
        self.leases: dict[int, Lease] = {}
        self.inflight: dict[OpKind, deque[Transfer]] = {k: deque() for k in OpKind}
        self.effects: list[Transfer] = []
        self.op_waiters: dict[int, list[int]] = {}  # op id -> leases that wait for it
        self.closed_reason: str | None = None
        self.flush_requested = False
        self._next_lease = 1
        self._next_op = 1
        self.prefetcher = Prefetcher(self)

    # ------------------------------------------------------------------ queries (pure)

    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    def match(self, tokens: TokenIds) -> MatchResult:
        """The longest cached prefix: device-VALID pages, then host-VALID pages. Pure."""
        walk = self.tree.walk(as_token_bytes(tokens))
        result = MatchResult(walk)
        if self.closed:
            return result
        nodes = walk.nodes
        valid = DeviceState.VALID
        n = len(nodes)
        if nodes and nodes[-1].device_state == valid:
            i = n  # a device-VALID page has only VALID ancestors (invariants.check): the whole path hits
        else:
            i = 0
            while i < n and nodes[i].device_state == valid:
                i += 1
        result.device_page_array = walk.device_page_ids(i)
        result.device_pages = i
        while i < n and nodes[i].host_state == HostState.VALID and nodes[i].device_state == DeviceState.NONE:
            i += 1
        result.host_pages = i - result.device_pages
        result.nodes = nodes if i == n else nodes[:i]
        return result

    def take_effects(self) -> list[Transfer]:
        """Copies issued since the last call, in issue order (raft's Ready)."""
        out, self.effects = self.effects, []
        return out

    def lease(self, lease_id: int) -> Lease:
        try:
            return self.leases[lease_id]
        except KeyError:
            raise UnknownLease(f"no lease {lease_id}") from None

    def _live_lease(self, lease_id: int) -> Lease:
        lease = self.lease(lease_id)
        if lease.releasing:
            raise ValueError(f"lease {lease_id} is being released")
        return lease

    # ------------------------------------------------------------------ sequenced operations

    def lock(self, tokens: TokenIds) -> tuple[int, MatchResult]:
        """Match, stamp the matched path, pin it (device prefix on device, host tail on host)."""
        self._tick()
        token_bytes = as_token_bytes(tokens)
        result = self.match(token_bytes)
        self.stats.lookups += 1
        self.stats.lookup_tokens += result.num_pages * self.page_size
        self.stats.device_hit_tokens += result.device_pages * self.page_size
        self.stats.host_hit_tokens += result.host_pages * self.page_size
        lease = self._new_lease()
        lease.tokens = token_bytes
        self._stamp(result.nodes, hit=True)
        for node in result.nodes[: result.device_pages]:
            self._pin_device(node, +1)
            lease.device_nodes.append(node)
        for node in result.nodes[result.device_pages :]:
            self._pin_host(node, +1)
            lease.host_nodes.append(node)
        self._account_lease(lease)
        if self.config.write_policy == "write_through_selective":
            self._backup_path([n for n in result.nodes if n.hits >= self.config.write_through_threshold])
        return lease.lease_id, result

    def alloc(self, lease_id: int, n: int) -> list[int]:
        """Give the lease ``n`` device pages, evicting unpinned pages as needed."""
        self._refuse_if_closed()
        lease = self._live_lease(lease_id)
        self._tick()
        pages = self._alloc_device(n)
        self._unaccount_lease(lease)
        lease.pages.extend(pages)
        self._account_lease(lease)
        return pages

    def insert(self, lease_id: int, tokens: TokenIds, pages: list[int]) -> tuple[int, int]:
        """Adopt the KV the engine wrote into ``pages`` for the full pages of ``tokens``.

        ``pages[i]`` holds page i of the tokens; it is either the cached node's own page or a page
        of this lease. Pages already cached are duplicates and go back to the lease. New nodes are
        pinned by the lease until it is released. Returns (inserted pages, duplicate pages).
        """
        self._refuse_if_closed()
        lease = self._live_lease(lease_id)
        walk = self.tree.walk(as_token_bytes(tokens))
        if len(pages) < walk.num_pages:
            raise ValueError(f"insert needs a device page for each of {walk.num_pages} full pages")
        # Validate everything before mutating anything: a refused insert changes nothing.
        owned = set(lease.pages)
        plan: list[tuple[int, Node | None, int]] = []  # (page index, existing node, page) to adopt
        duplicates = 0
        for i in range(walk.num_pages):
            node = walk.nodes[i] if i < len(walk.nodes) else None
            if node is not None and node.device_state == DeviceState.LOADING:
                # Nothing is inserted below a page still loading: if its load fails, the page is
                # dropped, and a device child under it would break ancestor closure.
                break
            page = pages[i]
            if node is not None and node.on_device:
                if page != node.device_page:
                    if page not in owned:
                        raise ValueError(f"page {page} is neither cached here nor held by lease {lease_id}")
                    duplicates += 1
                continue
            if page not in owned:
                raise ValueError(f"page {page} is not held by lease {lease_id}")
            owned.discard(page)
            plan.append((i, node, page))
        self._tick()
        hashes = walk.hashes if plan else []
        pinned = {n.node_id for n in lease.device_nodes}
        inserted: list[Node] = []
        self._unaccount_lease(lease)
        path = list(walk.nodes)
        for i, node, page in plan:
            lease.pages.remove(page)
            if node is None:
                parent = path[i - 1] if i else self.tree.root
                node = self.tree.add_child(parent, walk.pages[i], hashes[i], self.clock)
                path.append(node)
            else:
                self._unaccount(node)
            self._set_device(node, DeviceState.VALID, page)
            node.last_access = self.clock
            self._account(node)
            inserted.append(node)
        # The lease pins its whole device path, so nothing it holds has an evictable-looking ancestor.
        for node in path:
            if node.on_device and node.node_id not in pinned:
                self._pin_device(node, +1)
                lease.device_nodes.append(node)
                pinned.add(node.node_id)
        self._account_lease(lease)
        self._stamp(path, hit=False)
        self.stats.inserted_pages += len(inserted)
        self.stats.duplicate_pages += duplicates
        if self.config.write_policy == "write_through":
            self._backup_path(inserted)
        return len(inserted), duplicates

    def load(self, lease_id: int) -> list[int]:
        """Start loading the host pages along the lease's path back to device. Returns the device
        pages of the path's prefix, loading ones included, in page order.

        A page another request is already loading is shared: the lease pins it and waits for that
        load, and nothing below it is loaded here (if that load fails, a child loaded under it would
        hang from nothing). Loaded nodes become device-VALID only when agreed complete in a round.
        """
        self._refuse_if_closed()
        lease = self._live_lease(lease_id)
        self._tick()
        pinned = {n.node_id for n in lease.device_nodes}
        prefix: list[Node] = []
        todo: list[Node] = []
        shared_load = False
        for node in self.tree.walk(lease.tokens).nodes:
            if node.on_device and not todo:
                prefix.append(node)
                shared_load = shared_load or node.device_state == DeviceState.LOADING
            elif not shared_load and node.host_state == HostState.VALID and node.device_state == DeviceState.NONE:
                todo.append(node)
            else:
                break
        pages = self._alloc_device(len(todo)) if todo else []
        self._unaccount_lease(lease)
        for node in prefix:
            if node.node_id not in pinned:
                self._pin_device(node, +1)
                lease.device_nodes.append(node)
            if node.device_state == DeviceState.LOADING:
                for op in self.inflight[OpKind.LOAD]:
                    if node in op.nodes and op.op_id not in lease.ops:
                        self._lease_waits_for(lease, op.op_id)
        for node, page in zip(todo, pages, strict=True):
            self._unaccount(node)
            self._set_device(node, DeviceState.LOADING, page)
            node.device_pins += 1  # the lease's pin: a loading page is never evicted
            node.host_pins += 1  # the op's read of the host slot
            self._account(node)
            lease.device_nodes.append(node)
        if todo:
            op = self._issue(OpKind.LOAD, todo, lease_id)
            self._lease_waits_for(lease, op.op_id)
            self.stats.loads_issued_pages += len(todo)
        self._account_lease(lease)
        return [n.device_page for n in prefix + todo]

    def prefetch(self, lease_id: int, read: bool = True) -> bool:
        """Look up the continuation of the lease's tokens in storage; read the agreed hit to host
        (``read=False``: only agree on the hit).

        Returns False when there is nothing to fetch (no storage tier, or nothing missing)."""
        self._refuse_if_closed()
        lease = self._live_lease(lease_id)
        self._tick()
        if not self.config.storage:
            return False
        self._unaccount_lease(lease)
        started = self.prefetcher.start(lease, lease.tokens, read)
        self._account_lease(lease)
        return started

    def prefetch_status(self, lease_id: int) -> tuple[str, int]:
        """(status, pages landed in host) of the lease's prefetch. Pure."""
        state = self.lease(lease_id).prefetch
        return ("none", 0) if state is None else (state.status, state.ready_pages)

    def admissible(self, lease_id: int, policy: str = "best_effort", timeout_rounds: int = 8) -> bool:
        """Whether the lease's request may be admitted under the prefetch stop policy. Pure."""
        return self.prefetcher.admissible(self.lease(lease_id), policy, timeout_rounds)

    @property
    def host_deficit(self) -> int:
        return len(self.backup_backlog)

    def tick(self) -> None:
        """Once per round's commit: retry waiting backups, pace prefetches (agreed, every rank alike)."""
        # Make room first (free slots, then host evictions, as a retry of the whole backlog would),
        # then retry only as many pages as found a slot, oldest first: a full host tier with nothing
        # to evict costs a round nothing however long the backlog grows.
        backlog = self.backup_backlog
        if backlog and not self.closed:
            short = len(backlog) - self.host.available
            if short > 0:
                self.evict_host(short)
            retry: list[Node] = []
            while backlog and len(retry) < self.host.available:
                for node_id in list(itertools.islice(backlog, self.host.available - len(retry))):
                    node = backlog.pop(node_id)
                    if node.device_state == DeviceState.VALID and not node.on_host:
                        retry.append(node)
            self._backup_path(retry)
        for lease in list(self.leases.values()):
            if lease.prefetch is not None and lease.prefetch.status != "done":
                self._unaccount_lease(lease)
                self.prefetcher.tick_one(lease)
                if lease.lease_id in self.leases:
                    self._account_lease(lease)

    def release(self, lease_id: int) -> bool:
        """Release (finish or abort) a lease. Returns True when released now.

        If copies into the lease's pages are still in flight the lease is parked and released by
        the commit that completes its last copy (reference seed 004: never free what a copy writes).
        """
        self._tick()
        lease = self.lease(lease_id)
        self._unaccount_lease(lease)
        lease.releasing = True
        self._account_lease(lease)
        if lease.ops:
            return False
        self._finish_release(lease)
        return True

    def request_flush(self) -> None:
        """Ask for an agreed flush: the cache closes now and resets in the round where every rank
        has drained its in-flight copies."""
        self._tick()
        self.flush_requested = True
        self.close("flush requested")

    def set_retention_cap(self, tokens: int) -> None:
        if tokens < -1:
            raise ValueError("retention cap must be -1 (unlimited), 0 (none) or a token count")
        self._tick()
        self.retention_cap_tokens = tokens
        self.enforce_retention()

    def enforce_retention(self) -> int:
        """Evict until evictable device tokens <= the cap (reference seed 000). Returns pages freed."""
        cap = self.retention_cap_tokens
        freed = 0
        while cap >= 0 and self.evictable_device_tokens > cap:
            before = self.evictable_device_tokens
            # Under write_back an eviction may start a backup instead (which protects the page), so
            # go again until the count is under the cap or nothing more can move.
            freed += self.evict_device(-(-(before - cap) // self.page_size))
            if self.evictable_device_tokens >= before:
                break
        return freed

    def evict_device(self, n: int) -> int:
        """Free up to ``n`` device pages, least valuable first. Returns the pages freed now.

        Under write_back a page with no host copy is backed up first and freed by a later
        eviction, once its copy is agreed complete. The ancestors that would become candidates
        right after it go in the same backup, so a chain drains in one round trip, not one per page.
        """
        freed = 0
        backups: list[Node] = []
        while freed + len(backups) < n:
            node = self._pop_candidate(self._device_heap, self._device_candidate)
            if node is None:
                break
            if self._write_back and not node.on_host:
                chain = [node]
                cur = node.parent
                while freed + len(backups) + len(chain) < n and self._next_in_line(cur, chain[-1]):
                    chain.append(cur)
                    cur = cur.parent
                for x in chain:
                    self._pin_device(x, +1)  # hold it out of the heap while we look further
                backups.extend(chain)
                continue
            self._drop_device(node)
            freed += 1
        for node in backups:
            self._pin_device(node, -1)
        if backups:
            self._backup_path(backups)
            for node in backups:  # no host slot for its copy: evict it anyway, it is only a cache
                if node.node_id in self.backup_backlog and self._device_candidate(node):
                    self._drop_device(node)
                    freed += 1
        self.stats.device_evicted_pages += freed
        return freed

    @staticmethod
    def _next_in_line(node: Node | None, child: Node) -> bool:
        """Whether ``node`` becomes a write-back eviction candidate once ``child`` leaves device."""
        return (
            node is not None
            and node.parent is not None
            and node.device_state == DeviceState.VALID
            and not node.device_pins
            and not node.on_host
            and all(c is child or not c.on_device for c in node.children.values())
        )

    def evict_host(self, n: int) -> int:
        freed = 0
        while freed < n:
            node = self._pop_candidate(self._host_heap, self._host_candidate)
            if node is None:
                break
            self._unaccount(node)
            self.host.free([node.host_slot])
            self._set_host(node, HostState.NONE, -1)
            self._account(node)
            self._maybe_remove(node)
            freed += 1
        self.stats.host_evicted_pages += freed
        return freed

    # ------------------------------------------------------------------ agreed completions

    def complete(self, kind: OpKind, acked_pages: int | None = None) -> Transfer:
        """Apply the agreed completion of the head op of ``kind``.

        ``acked_pages`` is the agreed number of leading pages that succeeded on every rank (None:
        all of them). Pages past it are treated as failed: their target copy is dropped.
        """
        op = self.inflight[kind].popleft()
        ok = op.num_pages if acked_pages is None else max(0, min(acked_pages, op.num_pages))
        self.stats.failed_copy_pages += op.num_pages - ok
        waiters = [self.leases[lid] for lid in self.op_waiters.pop(op.op_id, ()) if lid in self.leases]
        for lease in waiters:
            self._unaccount_lease(lease)
        if kind == OpKind.STORAGE_QUERY:
            self.prefetcher.on_query(op, ok)
        elif kind == OpKind.STORAGE_READ:
            self.prefetcher.on_read(op, ok)
        for i, node in enumerate(op.nodes if kind < OpKind.STORAGE_READ else ()):
            self._unaccount(node)
            if kind == OpKind.BACKUP:
                if i < ok:
                    self._set_host(node, HostState.VALID, node.host_slot)
                else:
                    self.host.free([node.host_slot])
                    self._set_host(node, HostState.NONE, -1)
            elif kind == OpKind.LOAD:
                node.host_pins -= 1
                if i < ok:
                    self._set_device(node, DeviceState.VALID, node.device_page)
                else:
                    self.device.free([node.device_page])
                    self._set_device(node, DeviceState.NONE, -1)
            elif kind == OpKind.STORAGE_WRITE:
                node.host_pins -= 1
                self._set_storage(node, StorageState.DURABLE if i < ok else StorageState.NONE)
            self._account(node)
        for node in op.pinned:  # the path a backup protected, released with its ack (seed 000)
            self._pin_device(node, -1)
        if kind == OpKind.BACKUP:
            self.stats.backups_done_pages += ok
            if self.config.storage and not self.closed:
                self._store(op.nodes[:ok])
        elif kind == OpKind.STORAGE_WRITE:
            self.stats.storage_written_pages += ok
        elif kind == OpKind.LOAD:
            self.stats.loads_done_pages += ok
            for lease in waiters:  # every request sharing a failed load lets go of its pages
                self._drop_failed_loads(lease, op.nodes[ok:])
        for node in reversed(op.nodes):
            self._maybe_remove(node)
        for lease in waiters:
            lease.ops.remove(op.op_id)
            self._account_lease(lease)
            if lease.releasing and not lease.ops:
                self._finish_release(lease)
        return op

    # ------------------------------------------------------------------ whole-cache transitions

    def close(self, reason: str) -> None:
        """Fail closed: serve misses and refuse writes. Only an agreed flush reopens."""
        if self.closed_reason is None:
            self.closed_reason = reason

    def reset(self) -> None:
        """Drop the cached state (an agreed flush, once every rank has no copy in flight).

        What outlives it: lease and op ids keep counting (a stale id never names a new lease), the
        runtime retention cap, and every live lease with the pages it allocated, since the engine
        may still be writing KV into them; those pages are freed by the lease's own release.
        """
        next_lease, next_op, cap = self._next_lease, self._next_op, self.retention_cap_tokens
        held = [
            (lease.lease_id, lease.tokens, list(lease.pages)) for lease in self.leases.values() if not lease.releasing
        ]
        self.__init__(self.config)  # type: ignore[misc]
        self._next_lease, self._next_op, self.retention_cap_tokens = next_lease, next_op, cap
        for lease_id, tokens, pages in held:
            self.device.take(pages)
            lease = Lease(lease_id, tokens=tokens, pages=pages)
            self.leases[lease_id] = lease
            self._account_lease(lease)

    # ------------------------------------------------------------------ internals

    def _tick(self) -> None:
        self.clock += 1

    def _refuse_if_closed(self) -> None:
        if self.closed_reason is not None:
            raise CacheClosed(f"cache is closed: {self.closed_reason}")

    def _new_lease(self) -> Lease:
        lease = Lease(self._next_lease)
        self._next_lease += 1
        self.leases[lease.lease_id] = lease
        return lease

    def _finish_release(self, lease: Lease) -> None:
        self._unaccount_lease(lease)
        for node in lease.device_nodes:
            self._pin_device(node, -1)
        for node in lease.host_nodes:
            self._pin_host(node, -1)
        self.device.free(lease.pages)
        del self.leases[lease.lease_id]
        for node in lease.device_nodes + lease.host_nodes:
            if node.parent is not None:
                self._maybe_remove(node)

    # Lease helpers for the prefetcher; the caller holds the lease unaccounted.

    def _lease_waits_for(self, lease: Lease, op_id: int) -> None:
        lease.ops.append(op_id)
        self.op_waiters.setdefault(op_id, []).append(lease.lease_id)

    def _pin_lease_host(self, lease: Lease, nodes: list[Node]) -> None:
        for node in nodes:
            self._pin_host(node, +1)
            lease.host_nodes.append(node)

    def _pin_lease_anchor(self, lease: Lease, node: Node) -> list[tuple[str, Node]]:
        """Pin, for the lease, the node a fetch hangs from on the tier it is readable on (on
        device: with its path). Returns what was pinned here, for ``_unpin_lease_anchor``."""
        if node.parent is None:
            return []
        if node.host_state == HostState.VALID:
            if node in lease.host_nodes:
                return []
            self._pin_lease_host(lease, [node])
            return [("host", node)]
        pinned = {n.node_id for n in lease.device_nodes}
        added = [n for n in self._path_union([node]) if n.node_id not in pinned]
        for n in added:
            self._pin_device(n, +1)
            lease.device_nodes.append(n)
        return [("device", n) for n in added]

    def _unpin_lease_anchor(self, lease: Lease, pins: list[tuple[str, Node]]) -> None:
        for tier, node in pins:
            if tier == "host":
                self._unpin_lease_host(lease, [node])
            else:
                self._pin_device(node, -1)
                lease.device_nodes.remove(node)

    def _unpin_lease_host(self, lease: Lease, nodes: list[Node]) -> None:
        for node in nodes:
            self._pin_host(node, -1)
            lease.host_nodes.remove(node)

    def _drop_failed_loads(self, lease: Lease, nodes: list[Node]) -> None:
        dropped = {n.node_id for n in nodes}
        for node in lease.device_nodes:
            if node.node_id in dropped:
                self._pin_device(node, -1)
        lease.device_nodes = [n for n in lease.device_nodes if n.node_id not in dropped]  # caller: unaccounted

    def _alloc_device(self, n: int) -> list[int]:
        if n > self.device.available + self.evictable_device_pages:
            # Refuse before evicting: a request that cannot fit must not empty the cache first.
            raise OutOfPages(
                f"device pool: need {n} pages, {self.device.available} free and {self.evictable_device_pages} evictable"
            )
        short = n - self.device.available
        if short > 0:
            self.evict_device(short)
        return self.device.alloc(n)

    def _alloc_host_upto(self, n: int) -> list[int]:
        """As many of ``n`` host slots as eviction can make free."""
        short = n - self.host.available
        if short > 0:
            self.evict_host(short)
        return self.host.alloc(min(n, self.host.available))

    def _alloc_host(self, n: int) -> list[int] | None:
        short = n - self.host.available
        if short > 0:
            self.evict_host(short)
        if self.host.available < n:
            return None
        return self.host.alloc(n)

    def _backup_path(self, nodes: list[Node]) -> None:
        """Back up device-VALID pages that have no host copy, in the order given.

        Tiers are closed cumulatively (a host copy needs its parent on device or host), and every
        page backed up is on device, so each page can go on its own: no chain of ancestors, and
        no wait on a parent's copy in flight. Pages that find no host slot wait in the backlog.
        """
        if self.closed or not self.host.num_pages:
            return  # a closed cache starts no copies (it does not trust its own state); no host tier, none
        todo: list[Node] = []
        seen: set[int] = set()
        for node in nodes:
            if node.node_id in seen or node.parent is None or node.on_host or node.device_state != DeviceState.VALID:
                continue
            seen.add(node.node_id)
            todo.append(node)
        if not todo:
            return
        slots = self._alloc_host_upto(len(todo))
        for node in todo[len(slots) :]:
            if node.node_id not in self.backup_backlog:
                self.backup_backlog[node.node_id] = node
            self.stats.backup_deferred_host_full += 1
        todo = todo[: len(slots)]
        if not todo:
            return
        for node, slot in zip(todo, slots, strict=True):
            self.backup_backlog.pop(node.node_id, None)  # backed up by another path: no longer waiting
            self._unaccount(node)
            self._set_host(node, HostState.WRITING, slot)
            self._account(node)
        self._issue(OpKind.BACKUP, todo, -1)
        self.stats.backups_issued_pages += len(todo)

    def _store(self, nodes: list[Node]) -> None:
        """Write host-VALID pages to storage; durable only once every rank acked (agreed)."""
        if self.closed:
            return
        todo = [n for n in nodes if n.host_state == HostState.VALID and n.storage_state == StorageState.NONE]
        if not todo:
            return
        for node in todo:
            self._unaccount(node)
            self._set_storage(node, StorageState.WRITING)
            node.host_pins += 1  # the op reads the host slot
            self._account(node)
        self._issue(OpKind.STORAGE_WRITE, todo, -1)
        self.stats.storage_write_issued_pages += len(todo)

    def release_mirror(self, node: Node) -> bool:
        """Drop a redundant host copy: the page is on device and durable in storage."""
        if not self.is_releasable_mirror(node):
            return False
        self._unaccount(node)
        self.host.free([node.host_slot])
        self._set_host(node, HostState.NONE, -1)
        self._account(node)
        self.stats.mirrors_released_pages += 1
        return True

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

    def _issue(self, kind: OpKind, nodes: list[Node], lease_id: int, page_hashes: list[int] | None = None) -> Transfer:
        op = Transfer(
            op_id=self._next_op,
            kind=kind,
            nodes=list(nodes),
            device_pages=[n.device_page for n in nodes],
            host_slots=[n.host_slot for n in nodes],
            page_hashes=[n.hash for n in nodes] if page_hashes is None else list(page_hashes),
            lease_id=lease_id,
        )
        self._next_op += 1
        if kind in (OpKind.BACKUP, OpKind.STORAGE_WRITE):
            # A copy in flight protects the device pages along its pages' paths until its ack: they
            # stay, and count as protected rather than evictable meanwhile (reference seed 000).
            op.pinned = [n for n in self._path_union(op.nodes) if n.on_device]
            for node in op.pinned:
                self._pin_device(node, +1)
        self.inflight[kind].append(op)
        self.effects.append(op)
        return op
