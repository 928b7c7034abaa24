"""What code outside the core may ask of it: named queries that return plain values.

The service, the engine, the integrations and the event stream read the core's state only through
these (and ``CacheCore``'s own pure queries: ``match``, ``prefetch_status``, ``admissible``, ...):
never its tree, its nodes' fields, its lease table or its queues of ops in flight, which the
architecture test holds. Each answer is ints, strings, tuples or sets of them, built fresh: a
caller keeps nothing that changes under it, and nothing it holds keeps a node alive.

All of them are pure (they change nothing, so they need no sequencing) and read only what every
rank holds alike once a round has passed open; ``valid_device_pages`` and ``device_valid_prefix``
read only agreed (VALID) state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from tpcache.core.hashing import TokenIds, as_token_bytes
from tpcache.core.records import OpKind
from tpcache.core.tiers import HostState
from tpcache.core.treecore.feed import on_tiers

if TYPE_CHECKING:
    from tpcache.core.admission import Admitter
    from tpcache.core.backup import Backup
    from tpcache.core.leases import Leases
    from tpcache.core.outbox import Outbox
    from tpcache.core.staging import Staging
    from tpcache.core.treecore import TreeCore
    from tpcache.core.treecore.allocator import HostAllocator, PageAllocator
    from tpcache.core.treecore.feed import ChangeFeed
    from tpcache.core.treecore.ledger import Ledger
    from tpcache.core.treecore.tree import RadixTree


class PrefetchProgress(NamedTuple):
    """Where a lease's storage prefetch stands (``prefetch.py`` holds its transition table)."""

    status: str  # "querying", "reading", "done", ...
    start: int  # the page its current attempt's storage hit starts at
    hit_pages: int  # the current attempt's agreed storage hit, in pages from ``start``
    ready_pages: int  # pages landed in host over every attempt
    deferrals: int  # times its read waited for host slots


class Queries:
    """The core's queries for callers outside it (``CacheCore`` inherits them)."""

    tree: RadixTree
    treecore: TreeCore
    book: Leases
    outbox: Outbox
    ledger: Ledger
    backup: Backup
    staging: Staging
    admitter: Admitter
    device: PageAllocator
    host: HostAllocator

    # ------------------------------------------------------------------ the cache as a whole

    def is_empty(self) -> bool:
        """No lease, no page in the tree and no op in flight: nothing a new device pool would lose."""
        return not self.book.table and len(self.tree.nodes) <= 1 and not any(self.outbox.inflight.values())

    def ops_in_flight(self) -> int:
        """Ops issued and not yet retired by an agreed completion, over every kind (0: no round
        has a copy or a storage call left to agree on)."""
        return sum(map(len, self.outbox.inflight.values()))

    def ops_in_flight_by_kind(self) -> dict[str, int]:
        """Per op kind's name, its ops in flight; kinds with none are left out."""
        return {kind.name: len(queue) for kind, queue in self.outbox.inflight.items() if queue}

    def op_in_flight(self, kind: OpKind, op_id: int) -> bool:
        """Whether op ``op_id`` of ``kind`` is still in flight (issued, not yet retired). Op ids
        are never reused, an agreed flush included, so an op it dropped answers False."""
        return any(op.op_id == op_id for op in self.outbox.inflight[kind])

    def pages_in_use(self) -> tuple[int, int, int]:
        """(device pages, host pages holding cached KV, host slots staging a copy) in use. In buffer
        mode every host slot in use stages a copy and none is a cached page."""
        host = self.host.used
        return (self.device.used, 0, host) if self.staging.enabled else (self.device.used, host, 0)

    def adopted_pages(self) -> tuple[int, ...]:
        """With ``device_adopt``: the engine's pages the device tier holds now, in page order."""
        dev = self.device
        return tuple(p for p in range(dev.num_pages) if dev.is_owned(p))

    def storage_down(self) -> bool:
        """Whether the storage tier is off on every rank (agreed in a round: a miss, never a wait)."""
        return self.backup.storage_down

    def admission_queue(self) -> list[int]:
        """Leases waiting for admission (queued or parked), oldest first: the order to materialize them in."""
        return self.admitter.queue()

    def lease_count(self) -> int:
        """Leases alive, those parked until copies into their pages land included."""
        return len(self.book.table)

    def has_lease(self, lease_id: int) -> bool:
        """Whether ``lease_id`` is alive (not yet released, or parked until its copies land)."""
        return lease_id in self.book.table

    # ------------------------------------------------------------------ one lease (UnknownLease if gone)

    def lease_pages(self, lease_id: int) -> tuple[int, ...]:
        """Device pages allocated to the lease that the tree has not adopted, in allocation order:
        the pages its owner may still write."""
        return tuple(self.book.get(lease_id).pages)

    def lease_ops(self, lease_id: int) -> tuple[int, ...]:
        """Ids of the ops in flight the lease waits for (its loads and copies into its pages),
        oldest first; its release waits until none is left."""
        return tuple(self.book.get(lease_id).ops)

    def lease_loading(self, lease_id: int) -> bool:
        """Whether a load the lease waits for (its own, or one it shares) is still in flight."""
        ops = self.book.get(lease_id).ops
        return bool(ops) and any(op.op_id in ops for op in self.outbox.inflight[OpKind.LOAD])

    def prefetch_progress(self, lease_id: int) -> PrefetchProgress | None:
        """The lease's storage prefetch (None: it started none)."""
        state = self.book.get(lease_id).prefetch
        if state is None:
            return None
        return PrefetchProgress(state.status, state.start, state.hit_pages, state.ready_pages, state.deferrals)

    def prefetch_status(self, lease_id: int) -> tuple[str, int]:
        """(status, pages landed in host) of the lease's prefetch ("none", 0 without one)."""
        state = self.book.get(lease_id).prefetch
        return ("none", 0) if state is None else (state.status, state.ready_pages)

    def device_valid_prefix(self, lease_id: int, limit: int) -> tuple[int, ...]:
        """The device pages of the leading pages of the lease's tokens that are device-VALID (agreed
        landed on every rank), at most ``limit`` of them, in page order."""
        return tuple(self.treecore.device_prefix(self.book.get(lease_id).tokens, limit)[1])

    # ------------------------------------------------------------------ pages

    def valid_device_pages(self) -> set[int]:
        """Device pages that hold agreed cached KV (device-VALID in the tree); a new set."""
        return self.treecore.valid_device_pages()

    def host_filling(self, tokens: TokenIds, page: int) -> bool:
        """Whether page ``page`` of ``tokens`` is in the tree with its host copy being written (a
        save, or a storage read): it may become a host hit once a round agrees it landed."""
        ids = self.treecore.walk_ids(as_token_bytes(tokens))
        return page < len(ids) and self.treecore.host(ids[page])[0] == HostState.WRITING

    def tier_hashes(self) -> tuple[set[int], set[int], set[int]]:
        """Per tier (device, host, storage), the page hashes the tree holds on it: what the change
        feed's drains add up to since it was attached or cleared."""
        return on_tiers(self.tree.nodes.values())

    # ------------------------------------------------------------------ the change feed

    @property
    def feed(self) -> ChangeFeed | None:
        """The change feed the core records into (None: none attached). An observer attaches one and
        reads only what it drains; an agreed flush keeps it, cleared."""
        return self.ledger.feed

    @feed.setter
    def feed(self, feed: ChangeFeed | None) -> None:
        self.ledger.feed = feed
