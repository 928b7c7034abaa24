"""CacheCore: the deterministic state machine of one cache rank.

Sans-IO: inputs are sequenced operations (``lock``, ``alloc``, ``insert``, ``load``, ``prefetch``,
``release``, ...) and agreed completions (``complete``, from the round); outputs are replies and
one ``Ready`` at a time (ops to start, ops retired, leases released) that the driver acts on and
acknowledges with ``advance``. The same inputs give the same state, page numbers, effects and
digest on every rank. Nothing here reads a clock, spawns a thread or talks to a socket.

The layers, each in its module: ``ledger`` (the one mutator of node state and what summarizes it),
``eviction`` (candidates and the loops that free pages), ``leases`` (pins, waits, release),
``backup`` (write policies, backlog, storage write-out, mirror release), ``completions`` (one
applier per op kind), ``prefetch`` (storage prefetch's state machine), ``outbox`` (ops in flight,
Ready/Advance), ``loads`` (load-back). A hybrid model's components (SWA pages, Mamba states) add
``components`` (their records and pools), ``part_eviction`` and ``hybrid`` (where they change an
operation: the hit rule of ``hitrule``, window-only stamps, out-of-window release, chunk sizes).
Code outside the core reads its state only through ``queries`` (plain values), inherited here.

Invariants (checked by ``invariants.check``):
- a node resident on a tier has its parent resident on that tier, or on device for a host copy;
- every device page / host slot is owned by exactly one of: the free list, a tree node, a lease;
- ``node.device_pins`` == leases pinning it + in-flight ops reading it (same for host);
- a page is readable only in its final state (device/host VALID, storage DURABLE).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from tpcache.core.admission import Admitted, Admitter, Materialized, Shape
from tpcache.core.backup import Backup, MirrorRelease
from tpcache.core.completions import Completions
from tpcache.core.config import CacheConfig
from tpcache.core.digest import DIGEST_MASK, Digest, mix, mix_ids
from tpcache.core.engine_ops import EngineOps
from tpcache.core.external import EnginePages, check_blocks, require_engine_mode
from tpcache.core.hashing import TokenIds, as_token_bytes
from tpcache.core.hybrid import Hybrid
from tpcache.core.inserts import Inserter
from tpcache.core.leases import Leases
from tpcache.core.loads import Loader
from tpcache.core.outbox import Outbox
from tpcache.core.prefetch import Prefetcher
from tpcache.core.queries import Queries
from tpcache.core.records import CacheClosed, Lease, MatchResult, OpKind, Ready, Stats, Transfer
from tpcache.core.staging import Staging
from tpcache.core.treecore import TreeCore
from tpcache.core.treecore.allocator import HostAllocator, PageAllocator
from tpcache.core.treecore.eviction import Evictor
from tpcache.core.treecore.part_eviction import PartEvictor

_NO_BACKLOG = mix_ids([])


class CacheCore(Queries, EngineOps):
    def __init__(self, config: CacheConfig) -> None:
        config.validate()
        self.config = config
        self.page_size = config.page_size
        self.treecore = TreeCore(config)  # all per-node state; the layers below move onto it module by module
        self.tree, self.candidates, self.ledger = self.treecore.tree, self.treecore.candidates, self.treecore.ledger
        self.outbox = Outbox(self.treecore)
        write_back = config.write_policy == "write_back" and config.host_pages > 0
        self.evictor = Evictor(self.ledger, self.candidates, write_back)
        self.book = Leases(self.treecore, self.outbox)
        self.part_evictor = PartEvictor(self.ledger, self.evictor)
        self.backup = Backup(self.treecore, self.evictor, self.outbox, self.part_evictor)
        self.evictor.back_up = self.backup.back_up
        led, tc, closed = self.ledger, self.treecore, lambda: self.closed
        self.hybrid = Hybrid(tc, self.book, self.outbox, self.evictor, self.part_evictor) if led.parts else None
        self.loader = Loader(self.treecore, self.book, self.outbox, self.evictor, self.hybrid)
        self.inserter = Inserter(tc, self.book, self.backup, self.hybrid)
        self.prefetcher = Prefetcher(config, self.treecore, self.book, self.outbox, self.evictor, closed, self.hybrid)
        self.staging = Staging(self.treecore)
        self.completions = Completions(
            self.treecore, self.outbox, self.book, self.backup, self.prefetcher, self.staging
        )
        self.admitter = Admitter(config, self.treecore, self.book, self.outbox, self.loader, self.prefetcher, closed)
        self.engine_pages = EnginePages(self.treecore, self.book, self.outbox, self.evictor, self.inserter, self._live)
        self.plan_features = [MirrorRelease(self.backup)] if config.mirror_release else []
        self.closed_reason: str | None = None
        self.flush_requested = False

    # ------------------------------------------------------------------ state, read-only

    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    @property
    def leases(self) -> dict[int, Lease]:
        return self.book.table

    @property
    def inflight(self) -> dict[OpKind, deque[Transfer]]:
        return self.outbox.inflight

    @property
    def digest(self) -> Digest:
        """The state digest of every node and lease (leases changed since are folded in first)."""
        self.book.fold()
        return self.ledger.digest

    @property
    def clock(self) -> int:
        return self.ledger.clock

    @property
    def stats(self) -> Stats:
        return self.ledger.stats

    @property
    def device(self) -> PageAllocator:
        return self.ledger.device

    @property
    def host(self) -> HostAllocator:
        return self.ledger.host

    @property
    def backup_backlog(self) -> dict[int, int]:
        return self.ledger.backup_backlog

    @property
    def host_deficit(self) -> int:
        return len(self.ledger.backup_backlog) + self.prefetcher.host_deficit()

    @property
    def evictable_device_tokens(self) -> int:
        return self.ledger.evictable_device_tokens

    @property
    def protected_device_tokens(self) -> int:
        return self.ledger.protected_device_tokens

    @property
    def retention_cap_tokens(self) -> int:
        return self.evictor.retention_cap_tokens

    def lease(self, lease_id: int) -> Lease:
        return self.book.get(lease_id)

    def state_digest(self) -> int:
        """The digest of every node and lease plus the scalars that decide what happens next."""
        led = self.ledger
        self.book.fold()
        backlog = mix_ids(list(led.backup_backlog)) if led.backup_backlog else _NO_BACKLOG
        extra = mix(
            led.clock,
            self.outbox.next_op,
            self.book.next_lease,
            int(self.flush_requested),
            backlog,
            self.evictor.retention_cap_tokens,
        )
        if led.parts:  # each component's backlog and the SWA waiting to be freed decide what comes next
            ids = [v for p in led.parts.values() for v in (p.index, len(p.backlog), *p.backlog, *p.behind)]
            extra = mix(extra, mix_ids(ids))
        return (led.digest.value + extra) & DIGEST_MASK

    # ------------------------------------------------------------------ Ready / Advance

    def ready(self) -> Ready:
        """What to act on since the last ``advance`` (a second call before it raises)."""
        return self.outbox.ready()

    def advance(self) -> None:
        self.outbox.advance()

    def has_ready(self) -> bool:
        return self.outbox.has_ready()

    # ------------------------------------------------------------------ queries (pure)

    def match(self, tokens: TokenIds) -> MatchResult:
        """The longest cached prefix: device-VALID pages, then host-VALID pages; with components,
        the longest prefix the hit rule allows (``hitrule``). Pure."""
        walk = self.tree.walk(as_token_bytes(tokens))
        if self.closed:
            return MatchResult(walk)
        # buffer mode: host slots only stage, they are never a hit
        dev, host, pages = self.treecore.hit_prefix(walk, not self.staging.enabled)
        i = dev + host
        ids = walk.ids
        result = MatchResult(walk, dev, host, pages, ids if i == len(ids) else ids[:i])
        if self.hybrid is not None:
            self.hybrid.match(result, result.device_pages, i)
        return result

    def chunk_tokens(self, lease_id: int, start: int, want: int) -> int:
        """How many tokens (page-aligned, or all ``want``) of a prefill chunk starting at token
        ``start`` the pools can take now; 0: wait. Full attention only: ``want``. Pure."""
        lease = self.lease(lease_id)
        return want if self.hybrid is None else self.hybrid.chunk_tokens(lease, start, want)

    def part_slots(self, lease_id: int) -> dict[int, list[tuple[int, int]]]:
        """Per component, (page index, device slot) of the component data the lease holds on
        device (its hit's window and state, what it inserted), in page order. Pure."""
        return {} if self.hybrid is None else self.hybrid.part_slots(self.lease(lease_id))

    def admissible(self, lease_id: int, policy: str = "best_effort", timeout_rounds: int = 8) -> bool:
        """Whether the lease's request may be admitted under the prefetch stop policy. Pure."""
        return self.prefetcher.admissible(self.lease(lease_id), policy, timeout_rounds)

    # ------------------------------------------------------------------ sequenced operations

    def lock(self, tokens: TokenIds) -> tuple[int, MatchResult]:
        """Match, stamp the matched path, pin it (device prefix on device, host tail on host); count the hit."""
        return self._lock(tokens, count=True)

    def _lock(self, tokens: TokenIds, count: bool) -> tuple[int, MatchResult]:
        led = self.ledger
        led.tick()
        token_bytes = as_token_bytes(tokens)
        result = self.match(token_bytes)
        if count:
            stats, ps = led.stats, self.page_size
            stats.lookups += 1
            stats.lookup_tokens += result.num_pages * ps
            stats.device_hit_tokens += result.device_pages * ps
            stats.host_hit_tokens += result.host_pages * ps
        lease = self.book.new(token_bytes, result.walk, result.device_pages + result.host_pages)
        dev = result.device_pages if self.hybrid is None else self.hybrid.device_run(result)
        ids, core = result.nodes, self.treecore
        core.touch_walk(result.walk, dev, +1, stamp=True, hit=True)  # (the hit is the walk's first pages)
        for node_id in ids[dev:]:
            core.update(node_id, stamp=True, hit=True, host_pins=+1)
        lease.device_nodes.extend(ids if dev == len(ids) else ids[:dev])  # most hits are all on device: no copy
        lease.host_nodes.extend(ids[dev:])
        if self.hybrid is not None:
            self.hybrid.pin_hit(lease, result)
        self.book.refresh(lease)
        self.backup.on_hit(result.nodes)
        return lease.lease_id, result

    # ------------------------------------------------------------------ admission in phases (admission.py)

    def admit(self, tokens: TokenIds, prefetch: bool = True) -> tuple[int, MatchResult]:
        """``lock`` without counting a hit (``commit`` counts it); with storage, start its prefetch."""
        self.admitter.check_supported()
        lease_id, result = self._lock(tokens, count=False)
        self.admitter.admit(self.book.get(lease_id), result.device_pages + result.host_pages, prefetch)
        return lease_id, result

    def select(self, lease_id: int) -> Shape:
        return self.admitter.select(self.book.live(lease_id))

    def materialize(self, lease_id: int, planned: Shape) -> Materialized:
        lease = self.book.live(lease_id)
        self.ledger.tick()
        return self.admitter.materialize(lease, planned)

    def commit(self, lease_id: int) -> Admitted:
        return self.admitter.commit(self.book.live(lease_id))

    def alloc(self, lease_id: int, n: int, part: int = 0) -> list[int]:
        """Give the lease ``n`` device pages, evicting unpinned pages as needed (or refuse first);
        ``part`` > 0: ``n`` device slots of that component."""
        lease = self._live(lease_id)
        self.ledger.tick()
        if part:
            if self.hybrid is None or part not in self.ledger.parts:
                raise ValueError(f"no component {part} in this configuration")
            pages = self.part_evictor.alloc_device(self.ledger.parts[part], n)
            self.hybrid.held(lease, part).pages.extend(pages)
        else:
            pages = self.ledger.device.try_alloc(n)  # most allocations: enough pages are free
            if pages is None:
                pages = self.evictor.alloc_device(n)
            lease.pages.extend(pages)
        self.book.refresh(lease)
        return pages

    def insert(
        self, lease_id: int, tokens: TokenIds, pages: list[int], parts: Mapping[int, Sequence[int]] | None = None
    ) -> tuple[int, int]:
        """Adopt the KV the engine wrote into ``pages`` (and, per component, into the slots of
        ``parts``) for the full pages of ``tokens``; see ``inserts``. Returns (inserted pages,
        duplicate pages)."""
        return self.inserter.insert(self._live(lease_id), tokens, pages, parts)

    def append(
        self, lease_id: int, tokens: TokenIds, pages: list[int], parts: Mapping[int, Sequence[int]] | None = None
    ) -> tuple[int, int]:
        """``insert`` of the pages that follow the lease's last insert or append, given alone (a
        running request's new pages): costs what it adds, not its context; see ``Inserter.append``."""
        return self.inserter.append(self._live(lease_id), tokens, pages, parts)

    def load(self, lease_id: int) -> list[int]:
        """Start loading the host pages along the lease's path (and the component data its hit
        reads) back to device; see ``loads``. Returns the device pages of the hit's prefix, loading
        ones included, in page order. Loaded data is device-VALID only once agreed complete."""
        lease = self._live(lease_id)
        self.ledger.tick()
        return self.loader.load(lease)

    def prefetch(self, lease_id: int, read: bool = True) -> bool:
        """Look up the continuation of the lease's tokens in storage; read the agreed hit to host
        (``read=False``: only agree on the hit).

        Returns False when there is nothing to fetch (no storage tier, or nothing missing)."""
        lease = self._live(lease_id)
        self.ledger.tick()
        if not self.config.storage or self.backup.storage_down:
            return False
        started = self.prefetcher.start(lease, read)
        self.book.refresh(lease)
        return started

    def hit_pages(self, lease_id: int) -> int:
        """Leading pages of the lease's tokens it holds on host (its hit, prefetched pages included). Pure."""
        return len(self.engine_pages.hit_nodes(self.lease(lease_id)))

    def hit_host_slots(self, lease_id: int) -> tuple[int, ...]:
        """The host slots of the lease's hit pages, in page order. Pure."""
        core = self.treecore
        return tuple(core.host_slots(self.engine_pages.hit_nodes(self.lease(lease_id))))

    def release(self, lease_id: int) -> bool:
        """Release (finish or abort) a lease: True when now; with copies into its pages in flight it is
        parked and released by the commit that completes the last."""
        self.ledger.tick()
        lease = self.book.get(lease_id)
        self.staging.note(lease.host_nodes)  # buffer mode: slots it held may be done with
        done = self.book.release(lease)
        self.staging.release()
        return done

    def request_flush(self) -> None:
        """Ask for an agreed flush: the cache closes now and resets in the round where every rank
        has drained its in-flight copies."""
        self.ledger.tick()
        self.flush_requested = True
        self.close("flush requested")

    def set_retention_cap(self, tokens: int) -> None:
        if tokens < -1:
            raise ValueError("retention cap must be -1 (unlimited), 0 (none) or a token count")
        self.ledger.tick()
        self.evictor.retention_cap_tokens = tokens
        self.enforce_retention()

    # ------------------------------------------------------------------ driven by the round

    def complete(self, kind: OpKind, acked_pages: int | None = None) -> Transfer:
        """Apply the agreed completion of the head op of ``kind``: ``acked_pages`` leading pages
        landed on every rank (None: all); the rest failed somewhere and are dropped."""
        return self.completions.apply(kind, acked_pages)

    def after_commit(self) -> None:
        """Once per round's commit, alike on every rank: retry waiting backups, pace prefetches."""
        self.staging.release()
        self.backup.retry_backlog()
        if self.hybrid is not None:
            self.backup.retry_part_backlogs()
            self.hybrid.free_behind()
        for lease in self.prefetcher.running(self.book.table):  # not every lease: most fetch nothing
            self.prefetcher.tick(lease)
            if lease.lease_id in self.book.table:
                self.book.refresh(lease)

    def evict_device(self, n: int) -> int:
        return self.evictor.evict_device(n)

    def evict_host(self, n: int) -> int:
        return self.evictor.evict_host(n)

    def enforce_retention(self) -> int:
        """The retention cap, on the full pages and on each component's device pool."""
        freed = self.evictor.enforce_retention()
        if self.ledger.parts:
            freed += self.part_evictor.enforce_retention(self.evictor.retention_cap_tokens)
        return freed

    def close(self, reason: str) -> None:
        """Fail closed: serve misses, refuse writes, start no copies. Only an agreed flush reopens."""
        if self.closed_reason is None:
            self.closed_reason = reason
        self.backup.enabled = False

    def reset(self, next_op: int, next_lease: int) -> None:
        """Drop the cached state (an agreed flush, once every rank has no copy in flight).

        What outlives it: lease and op ids keep counting from the given (agreed) values, the
        runtime retention cap, and every live lease with the pages it allocated, since the engine
        may still be writing KV into them; those pages are freed by the lease's own release."""
        cap, kept, feed = self.evictor.retention_cap_tokens, self.book.kept(), self.ledger.feed
        gone = self.engine_pages.drop_tree()  # now, not at the collection that finds the old core
        self.__init__(self.config)  # type: ignore[misc]
        self.ledger.feed = feed.clear() if feed is not None else None  # its next drain says: cleared
        self.book.next_lease, self.outbox.next_op, self.evictor.retention_cap_tokens = next_lease, next_op, cap
        self.book.take_back(kept)
        self.engine_pages.hand_back(gone)

    def _engine_op(self, lease_id: int, blocks: list[int]) -> tuple[Lease, list[int]]:
        self._refuse_if_closed()
        require_engine_mode(self.config)
        return self.book.live(lease_id), check_blocks(blocks)  # the op ticks once it is valid

    def _live(self, lease_id: int) -> Lease:
        """``_refuse_if_closed`` then ``Leases.live``, in one call on the running requests' path."""
        lease = self.book.table.get(lease_id)
        if lease is None or lease.releasing or self.closed_reason is not None:
            self._refuse_if_closed()
            return self.book.live(lease_id)  # raises
        return lease

    def _refuse_if_closed(self) -> None:
        if self.closed_reason is not None:
            raise CacheClosed(f"cache is closed: {self.closed_reason}")
