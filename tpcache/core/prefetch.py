"""Storage prefetch (reference seed 003): find a request's continuation in storage, read it to host.

Per lease, a small state machine driven only by agreed completions and the round count:

    querying --(agreed hit h > 0)--> reading --(all landed)--> done
        |            \\--(no host slots)--> deferred --(slots | max deferrals)--> reading | done
        \\--(h == 0)--> done          reading --(short read)--> retry_wait --(paced)--> querying
                                                       (attempts exhausted) --> done

The hit length is the minimum over ranks, so a page present on only some ranks is a miss. Host
slots are allocated only once the hit is known. The lease pins the prefix the fetch hangs from and
the pages it reads; its release waits for the fetch's copies to land (seed 004). Retries are paced
in rounds and capped per request; a completion for an op that is not the current attempt's is
stale and ignored. Admission waits only as the stop policy says (``admissible``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpcache.core.records import OpKind
from tpcache.core.tiers import HostState, StorageState

if TYPE_CHECKING:
    from tpcache.core.cache import CacheCore
    from tpcache.core.records import Lease, Transfer
    from tpcache.core.tree import Node

STOP_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass
class PrefetchState:
    tokens: bytes
    status: str = "querying"  # querying | deferred | reading | retry_wait | done
    attempts: int = 0
    op_id: int = -1  # the current attempt's op; other completions are stale
    hit_pages: int = 0  # agreed storage hit of the current attempt
    ready_pages: int = 0  # pages landed in host over all attempts
    rounds: int = 0  # rounds since the prefetch started (the timeout policy's clock)
    deferrals: int = 0
    retry_at: int = 0
    start: int = 0  # page index the current attempt's hit starts at
    nodes: list[Node] = field(default_factory=list)
    anchor: list[tuple[str, Node]] = field(default_factory=list)  # pins holding the fetch's parent
    read: bool = True  # False: a lookup only (the agreed hit, nothing read to host)

    def code(self) -> int:
        return ("querying", "deferred", "reading", "retry_wait", "done").index(self.status)


class Prefetcher:
    def __init__(self, core: CacheCore) -> None:
        self.core = core

    # ------------------------------------------------------------------ sequenced

    def start(self, lease: Lease, token_bytes: bytes, read: bool = True) -> bool:
        """Begin a prefetch for the lease's continuation (``read=False``: only look it up). False
        when there is nothing to fetch."""
        if lease.prefetch is not None and lease.prefetch.status != "done":
            return True
        lease.prefetch = PrefetchState(token_bytes, read=read)
        return self._query(lease)

    def admissible(self, lease: Lease, policy: str, timeout_rounds: int) -> bool:
        """Whether the request may be admitted now under the stop policy."""
        if policy not in STOP_POLICIES:
            raise ValueError(f"unknown prefetch stop policy {policy!r}; choose one of {STOP_POLICIES}")
        state = lease.prefetch
        if state is None or state.status == "done" or policy == "best_effort" or self.core.closed:
            return True  # a closed cache serves misses: nothing is worth waiting for
        return policy == "timeout" and state.rounds >= timeout_rounds

    # ------------------------------------------------------------------ agreed completions

    def on_query(self, op: Transfer, hit: int) -> None:
        lease = self.core.leases.get(op.lease_id)
        state = lease.prefetch if lease is not None else None
        if state is None or op.op_id != state.op_id or lease.releasing or self.core.closed:
            if not self.core.closed:
                self.core.stats.prefetch_stale_completions += 1
            if state is not None and op.op_id == state.op_id:
                state.status = "done"
            return
        state.hit_pages = hit
        self.core.stats.prefetch_hit_pages += hit
        if hit == 0 or not state.read:
            state.status = "done"
            return
        self._read(lease)

    def on_read(self, op: Transfer, landed: int) -> None:
        core = self.core
        lease = core.leases.get(op.lease_id)
        for i, node in enumerate(op.nodes):
            core._unaccount(node)
            if i < landed:
                core._set_host(node, HostState.VALID, node.host_slot)
                node.storage_state = StorageState.DURABLE
            else:
                core.host.free([node.host_slot])
                core._set_host(node, HostState.NONE, -1)
            core._account(node)
        failed = op.nodes[landed:]
        if lease is not None:
            core._unpin_lease_host(lease, failed)
            if lease.prefetch is not None and lease.prefetch.op_id == op.op_id:
                core._unpin_lease_anchor(lease, lease.prefetch.anchor)  # the new pages hold their parent now
                lease.prefetch.anchor = []
        for node in reversed(failed):
            core._maybe_remove(node)
        core.stats.prefetch_read_pages += landed
        state = lease.prefetch if lease is not None else None
        if state is None or op.op_id != state.op_id:
            core.stats.prefetch_stale_completions += 1
            return
        state.ready_pages += landed
        state.nodes = []
        if landed == op.num_pages or lease.releasing or core.closed:
            state.status = "done"
        elif state.attempts < core.config.prefetch_max_attempts:
            state.status = "retry_wait"
            state.retry_at = state.rounds + core.config.prefetch_retry_rounds
        else:
            state.status = "done"

    def tick_one(self, lease: Lease) -> None:
        """Once per commit: pace retries, retry deferred admissions, advance the timeout clock."""
        state = lease.prefetch
        if state is not None and state.status != "done":
            state.rounds += 1
            if lease.releasing:
                if state.status in ("deferred", "retry_wait"):
                    state.status = "done"
            elif state.status == "deferred":
                state.deferrals += 1
                self._read(lease)
            elif state.status == "retry_wait" and state.rounds >= state.retry_at:
                self._query(lease)

    # ------------------------------------------------------------------ internals

    def _continuation(self, lease: Lease) -> tuple[Node, int, list[int], list[bytes]] | None:
        """The node the fetch hangs from, the index of the first missing page, and every page's
        hash and tokens. None when nothing is missing or the parent is not readable on device or
        host (the new host pages would hang from nothing)."""
        core = self.core
        state = lease.prefetch
        assert state is not None
        walk = core.tree.walk(state.tokens)
        k = 0
        while k < len(walk.nodes) and (walk.nodes[k].on_device or walk.nodes[k].on_host):
            k += 1
        if k == walk.num_pages:
            return None
        parent = walk.nodes[k - 1] if k else core.tree.root
        if parent.parent is not None and parent.host_state != HostState.VALID and not parent.device_valid:
            return None
        return parent, k, walk.hashes, walk.pages

    def _query(self, lease: Lease) -> bool:
        core = self.core
        state = lease.prefetch
        assert state is not None
        found = self._continuation(lease)
        if found is None:
            state.status = "done"
            return False
        _, k, hashes, _ = found
        limit = core.config.prefetch_max_pages
        state.attempts += 1
        state.start = k
        state.status = "querying"
        op = core._issue(OpKind.STORAGE_QUERY, [], lease.lease_id, page_hashes=hashes[k : k + limit])
        state.op_id = op.op_id
        core._lease_waits_for(lease, op.op_id)
        return True

    def _read(self, lease: Lease) -> None:
        core = self.core
        state = lease.prefetch
        assert state is not None
        found = self._continuation(lease)
        end = state.start + state.hit_pages
        if found is None or found[1] >= end:
            state.status = "done"
            return
        parent, k, hashes, pages = found
        n = end - k
        anchor = core._pin_lease_anchor(lease, parent)
        slots = core._alloc_host(n)
        if slots is None:
            core._unpin_lease_anchor(lease, anchor)
            if state.deferrals >= core.config.prefetch_max_deferrals:
                state.status = "done"  # proceed with what the device holds
            else:
                state.status = "deferred"
            return
        nodes: list[Node] = []
        for i, slot in zip(range(k, end), slots, strict=True):
            node = core.tree.add_child(parent, pages[i], hashes[i], core.clock)
            core._set_host(node, HostState.WRITING, slot)
            core._account(node)
            nodes.append(node)
            parent = node
        core._pin_lease_host(lease, nodes)
        op = core._issue(OpKind.STORAGE_READ, nodes, lease.lease_id)
        core._lease_waits_for(lease, op.op_id)
        state.op_id = op.op_id
        state.nodes = nodes
        state.anchor = anchor
        state.status = "reading"
