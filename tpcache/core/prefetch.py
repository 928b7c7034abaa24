"""Storage prefetch: find a request's continuation in storage and read it to host.

Per lease, a state machine driven only by sequenced operations, agreed completions and the round
count; ``TRANSITIONS`` lists every state change it may make. The hit length is the minimum over
ranks, so a page present on only some ranks is a miss. Host slots are allocated only once the hit
is known. The lease pins the prefix the fetch hangs from and the pages it reads; its release waits
for the fetch's copies to land. Retries are paced in rounds and capped per request; a completion of
an op that is not the current attempt's is stale and ignored. Admission waits only as the stop
policy says (``admissible``). In buffer mode (host slots only stage) a hit larger than the free staging slots is
read in the part that fits, and the request computes the rest.

With components, a lookup asks for each page's full, SWA and state keys, and each rank answers with
the hit ``hitrule.hit_length`` allows over what its storage holds (``QueryPlan``); the read brings
the full pages of the agreed hit and the component data that hit reads. A rank whose read of any of
it fails lands fewer pages, agreed like any other short read, so a hit is never served on a guess.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpcache.core.config import CacheConfig
from tpcache.core.hitrule import QueryPlan, keeps_state, window_range
from tpcache.core.leases import Leases
from tpcache.core.outbox import Outbox
from tpcache.core.records import Lease, OpKind, PrefetchState, Transfer
from tpcache.core.tiers import HostState
from tpcache.core.treecore import TreeCore
from tpcache.core.treecore.components import readable_tier
from tpcache.core.treecore.core import ROOT
from tpcache.core.treecore.eviction import Evictor

if TYPE_CHECKING:
    from tpcache.core.hybrid import Hybrid

log = logging.getLogger("tpcache.prefetch")

STOP_POLICIES = ("best_effort", "wait_complete", "timeout")

# state -> event -> next state. "cancel": the lease is being released, the cache closed, or its
# admission stopped waiting for it. "reissue": the prefix it hangs from moved; ask again at once.
TRANSITIONS: dict[str, dict[str, str]] = {
    "querying": {
        "hit": "reading",
        "reissue": "querying",
        "looked_up": "done",
        "no_slots": "deferred",
        "give_up": "done",
        "miss": "done",
        "gone": "done",
        "cancel": "done",
    },
    "deferred": {
        "slots": "reading",
        "no_slots": "deferred",
        "give_up": "done",
        "gone": "done",
        "cancel": "done",
        "reissue": "querying",
    },
    "reading": {"landed": "done", "short": "retry_wait", "exhausted": "done", "cancel": "done"},
    "retry_wait": {"due": "querying", "gone": "done", "cancel": "done", "reissue": "querying"},
    "done": {"start": "querying"},
}


def _fetch_done(lease: Lease) -> bool:
    return lease.prefetch is None or lease.prefetch.status == "done"


class IllegalPrefetchEvent(RuntimeError):
    """A prefetch event its state does not accept: a bug, never user input."""


def _to(state: PrefetchState, event: str) -> None:
    try:
        state.status = TRANSITIONS[state.status][event]
    except KeyError:
        raise IllegalPrefetchEvent(f"prefetch in state {state.status!r} cannot take event {event!r}") from None


class Prefetcher:
    def __init__(
        self,
        config: CacheConfig,
        core: TreeCore,
        leases: Leases,
        outbox: Outbox,
        evictor: Evictor,
        closed: Callable[[], bool],
        hybrid: Hybrid | None = None,
    ) -> None:
        self.config = config
        self.core = core
        self.ledger = core.ledger  # its stats and pools (no node is read through it)
        self.leases = leases
        self.outbox = outbox
        self.evictor = evictor
        self.closed = closed
        self.hybrid = hybrid
        self.started: dict[int, Lease] = {}  # lease id -> lease, for every fetch started and not seen done
        self.storage_down = False  # agreed: storage is off (``CacheCore.storage_lost``)
        self.gave_up = 0  # fetches that found no host slot in time (paces the warning; not cache state)

    # ------------------------------------------------------------------ sequenced

    def start(self, lease: Lease, read: bool = True) -> bool:
        """Begin a prefetch of the lease's continuation (``read=False``: only agree on the hit).
        False when there is nothing to fetch."""
        if lease.prefetch is not None and lease.prefetch.status != "done":
            return True
        if self.storage_down:
            return False
        lease.prefetch = PrefetchState(lease.tokens, status="done", read=read)
        _to(lease.prefetch, "start")
        self.started[lease.lease_id] = lease
        return self._query(lease)

    def admissible(self, lease: Lease, policy: str, timeout_rounds: int) -> bool:
        """Whether the request may be admitted now under the stop policy."""
        if policy not in STOP_POLICIES:
            raise ValueError(f"unknown prefetch stop policy {policy!r}; choose one of {STOP_POLICIES}")
        state = lease.prefetch
        if state is None or state.status == "done" or policy == "best_effort" or self.closed():
            return True  # a closed cache serves misses: nothing is worth waiting for
        return policy == "timeout" and state.rounds >= timeout_rounds

    def anchor_moved(self, lease: Lease) -> bool:
        """Whether the prefix a waiting fetch hangs from changed since its lookup was issued (a page
        landed or went above it): the lookup asks for the wrong pages. Pure."""
        state = lease.prefetch
        if state is None or state.status not in ("querying", "deferred", "retry_wait"):
            return False
        found = self._continuation(state)
        return found is None or found[1] != state.start

    def reissue(self, lease: Lease) -> None:
        """Ask again at once from where the prefix ends now; the earlier lookup's ack becomes stale.
        Past the attempt cap, or with storage off, the fetch stops instead."""
        state = lease.prefetch
        assert state is not None
        if state.attempts >= self.config.prefetch_max_attempts or self.storage_down:
            self.abandon(lease)
            return
        _to(state, "reissue")
        state.op_id = -1  # stale from here on, even if nothing is left to ask for
        self.ledger.stats.prefetch_reissued += 1
        self._query(lease)

    def abandon(self, lease: Lease) -> None:
        """Stop waiting for the fetch: whatever it still brings is a stale completion (a read in
        flight still lands in its slots, which the lease holds until it ends)."""
        state = lease.prefetch
        if state is None or state.status == "done":
            return
        state.op_id = -1
        _to(state, "cancel")

    # ------------------------------------------------------------------ agreed completions

    def on_query(self, op: Transfer, hit: int) -> None:
        lease = self.leases.table.get(op.lease_id)
        state = lease.prefetch if lease is not None else None
        if lease is None or state is None or op.op_id != state.op_id:
            if not self.closed():
                self.ledger.stats.prefetch_stale_completions += 1
            return
        if lease.releasing or self.closed():
            if not self.closed():
                self.ledger.stats.prefetch_stale_completions += 1
            _to(state, "cancel")
            return
        if self.storage_down:  # agreed since the lookup was issued: nothing is read from storage any more
            _to(state, "cancel")
            return
        state.hit_pages = hit
        self.ledger.stats.prefetch_hit_pages += hit
        if hit == 0:
            _to(state, "miss")
            return
        if not state.read:
            _to(state, "looked_up")
            return
        self._read(lease)

    def on_read(self, op: Transfer, landed: int) -> None:
        """After the completion set the nodes' host state: unpin what failed, move the state on."""
        lease = self.leases.table.get(op.lease_id)
        if lease is None:
            self.ledger.stats.prefetch_stale_completions += 1
            return
        self.leases.unpin_host(lease, op.nodes[landed:])
        state = lease.prefetch
        if state is None or op.op_id != state.op_id:
            self.ledger.stats.prefetch_stale_completions += 1
            return
        # The new pages hold their parent on host now. The device path above them stays pinned until
        # the lease is released, as a lock pins its device prefix: a device page with no host copy
        # cannot go while pinned host pages hang from it (unpinned, it would count as evictable
        # without being so), and an insert meanwhile may have hung the lease's own pages from it.
        self.leases.unpin_anchor(lease, [(tier, node_id) for tier, node_id in state.anchor if tier == "host"])
        state.anchor = []
        state.ready_pages += landed
        state.nodes = []
        if landed == op.num_pages:
            _to(state, "landed")
        elif lease.releasing or self.closed():
            _to(state, "cancel")
        elif state.attempts < self.config.prefetch_max_attempts:
            _to(state, "short")
            state.retry_at = state.rounds + self.config.prefetch_retry_rounds
        else:
            _to(state, "exhausted")

    def running(self, table: dict[int, Lease]) -> list[Lease]:
        """The leases of ``table`` whose fetch is not done, in lease id order (the table's): each
        fetch leaves "done" only through ``start``, so looking at those started finds them all."""
        started = self.started
        if not started:  # most rounds: nothing to look at
            return []
        for lease_id in [i for i, lease in started.items() if table.get(i) is not lease or _fetch_done(lease)]:
            del started[lease_id]
        return [started[i] for i in sorted(started)]

    def tick(self, lease: Lease) -> None:
        """Once per commit: pace retries, retry deferred reads, advance the timeout clock."""
        state = lease.prefetch
        if state is None or state.status == "done":
            return
        state.rounds += 1
        if lease.releasing or self.storage_down:
            if state.status in ("deferred", "retry_wait"):
                _to(state, "cancel")  # storage off: neither a deferred read nor a retry goes to storage
        elif state.status == "deferred":
            state.deferrals += 1
            self._read(lease)
        elif state.status == "retry_wait" and state.rounds >= state.retry_at:
            self._query(lease, retry=True)

    def host_deficit(self) -> int:
        """Host slots the deferred reads lack, together (the same on every rank: sequenced state)."""
        started = self.started
        if not started:  # most rounds: nothing to look at
            return 0
        return sum(
            lease.prefetch.short
            for lease in started.values()
            if lease.prefetch is not None and lease.prefetch.status == "deferred"
        )

    def _gave_up(self, pages: int) -> None:
        self.ledger.stats.prefetch_rejected_host_full += pages
        self.gave_up += 1  # for the log alone: the 1st, 2nd, 4th, 8th ... time
        if self.gave_up & (self.gave_up - 1) == 0:
            log.warning(
                "a storage prefetch read %d pages it found in storage into no host slot: none came free in %d "
                "rounds (host pages pinned by requests, or mirror release off); %d such prefetches so far",
                pages,
                self.config.prefetch_max_deferrals,
                self.gave_up,
            )

    # ------------------------------------------------------------------ internals

    def _continuation(self, state: PrefetchState) -> tuple[int, int, list[int], list[bytes], list[int]] | None:
        """The node the fetch hangs from (its id), the index of the first missing page, every page's
        hash and tokens, and the ids of the resident pages before it. None when nothing is missing
        or the parent is not readable on device or host (the new host pages would hang from nothing)."""
        core = self.core
        walk = core.walk(state.tokens)
        ids = walk.ids
        k = core.resident_prefix(ids)
        if k == walk.num_pages:
            return None
        parent = ids[k - 1] if k else ROOT
        if not core.readable(parent):
            return None
        return parent, k, walk.hashes, walk.pages, ids[:k]

    def _query(self, lease: Lease, retry: bool = False) -> bool:
        state = lease.prefetch
        assert state is not None
        found = self._continuation(state)
        if found is None:
            _to(state, "gone")
            return False
        _, k, hashes, _, resident = found
        if retry:
            _to(state, "due")
        state.attempts += 1
        state.start = k
        looked = hashes[k : k + self.config.prefetch_max_pages]
        plan = self._query_plan(k, len(looked), resident) if self.hybrid is not None else None
        op = self.outbox.issue(OpKind.STORAGE_QUERY, [], lease.lease_id, page_hashes=looked, query=plan)
        state.op_id = op.op_id
        self.leases.wait_for(lease, op.op_id)
        return True

    def _read(self, lease: Lease) -> None:
        state = lease.prefetch
        assert state is not None
        found = self._continuation(state)
        end = state.start + state.hit_pages
        if found is None or found[1] >= end:
            _to(state, "gone")
            return
        parent, k, hashes, pages, _ = found
        anchor = self.leases.pin_anchor(lease, parent)
        if self.config.host_mode == "buffer":  # staging: read what the pool holds now, compute the rest
            slots = self.evictor.alloc_host_upto(end - k) or None
            end = k + len(slots) if slots else end
        else:
            slots = self.evictor.alloc_host(end - k)
        part_slots = self._part_slots(k, end) if slots is not None and self.hybrid is not None else {}
        if part_slots is None:
            self.ledger.host.free(slots)  # type: ignore[arg-type]
            slots = None
        if slots is None:
            self.leases.unpin_anchor(lease, anchor)
            # proceed with what the device holds once the deferrals are used up
            if state.deferrals >= self.config.prefetch_max_deferrals:
                state.short = 0
                _to(state, "give_up")
                self._gave_up(end - k)
                return
            # What the read lacks joins the host deficit: the round agrees on it and mirror release
            # frees that many durable host mirrors of device pages, which a host pool made only of
            # mirrors (host pages <= device pages) has plenty of, so a later tick finds its slots.
            state.short = max(1, end - k - self.ledger.host.available)
            _to(state, "no_slots")
            return
        state.short = 0
        core = self.core
        ids: list[int] = []
        parent_id = parent
        for i, slot in zip(range(k, end), slots, strict=True):
            parent_id = core.add_host_page(parent_id, pages[i], hashes[i], slot)
            ids.append(parent_id)
        self.leases.pin_host(lease, ids)
        parts: dict[int, list[int]] = {}
        for c, placed in (part_slots or {}).items():
            for page, slot in placed:
                core.update(ids[page - k], part=c, host=(HostState.WRITING, slot))
                parts.setdefault(c, []).append(page - k)
        op = self.outbox.issue(OpKind.STORAGE_READ, ids, lease.lease_id, parts=parts or None)
        self.leases.wait_for(lease, op.op_id)
        state.op_id = op.op_id
        state.nodes = ids
        state.anchor = anchor
        _to(state, "slots" if state.status == "deferred" else "hit")

    # ------------------------------------------------------------------ components

    def _query_plan(self, k: int, count: int, resident: list[int]) -> QueryPlan:
        """What each rank needs to compute its storage hit by the hit rule (see ``hitrule``)."""
        hy = self.hybrid
        assert hy is not None
        before: tuple[bool, ...] = ()
        if hy.window_part is not None:
            b = hy.window_part.base
            start = max(0, k - hy.window + 1)
            comps = [self.core.component(i) for i in resident[start:k]]
            before = tuple(readable_tier(comp, b) != 0 for comp in comps)  # type: ignore[arg-type]
        every = hy.state_part.spec.every if hy.state_part is not None else 0
        state_pages = tuple(every < 0 or keeps_state(every, k + i, -1) for i in range(count)) if every else ()
        return QueryPlan(k, hy.window, before, hy.state_part is not None, state_pages)

    def _part_slots(self, k: int, end: int) -> dict[int, list[tuple[int, int]]] | None:
        """Host slots for the component data a hit of ``end`` pages reads from pages ``k..end-1``:
        per component, (page, slot). None (nothing kept) when some component pool is short."""
        hy = self.hybrid
        assert hy is not None
        want: dict[int, list[int]] = {}
        if hy.window_part is not None:
            want[hy.window_part.index] = [i for i in window_range(end, hy.window) if i >= k]
        if hy.state_part is not None:
            want[hy.state_part.index] = [end - 1]
        out: dict[int, list[tuple[int, int]]] = {}
        for c, pages in want.items():
            part = self.ledger.parts[c]
            slots = hy.part_evictor.alloc_host(part, len(pages)) if pages else []
            if slots is None:
                for done, placed in out.items():
                    self.ledger.parts[done].host.free([s for _, s in placed])
                return None
            out[c] = list(zip(pages, slots, strict=True))
        return out
