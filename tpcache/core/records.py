"""What the core hands out and keeps per request: ops (Transfer effects), the Ready batch of
effects, leases, match results, counters, and the errors of its operations."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from tpcache.core.treecore.holdings import DEVICE_PINS, HOST_PINS, PAGES, NodeHolding, PageHolding

if TYPE_CHECKING:
    from tpcache.core.hitrule import QueryPlan
    from tpcache.core.treecore.tree import Walk


class OpKind(IntEnum):
    """The completion queues; each is applied in issue order."""

    BACKUP = 0  # device -> host
    LOAD = 1  # host -> device
    STORAGE_WRITE = 2  # host -> storage
    STORAGE_READ = 3  # storage -> host (prefetch)
    STORAGE_QUERY = 4  # which pages storage holds (prefetch lookup)


@dataclass
class PartCopy:
    """One component's share of an op: the op's nodes (by position) that move this component's data,
    with its device slots and host slots (in the component's own pools)."""

    part: int
    index: list[int]
    device: list[int]
    host: list[int]


@dataclass
class Transfer:
    """One op: a copy or storage call the I/O layer carries out. Known by ``op_id`` from issue to
    retirement; ``acked`` is set when the round agrees how many leading pages landed on every rank.

    ``device_pages``/``host_slots`` are the full-attention pages it moves: those of every node, or of
    the nodes at ``full_index`` when some nodes move only component data (``parts``). A node counts
    as landed when every copy of it in the op landed; ``acked`` counts leading nodes."""

    op_id: int
    kind: OpKind
    nodes: list[int]  # the ids of the nodes it moves
    device_pages: list[int]
    host_slots: list[int]
    page_hashes: list[int]
    lease_id: int = -1
    pinned: list[int] = field(default_factory=list)  # ids of the nodes it pins on device (a backup: its path)
    acked: int = -1  # agreed pages landed on every rank, once retired
    full_index: list[int] | None = None  # positions of the nodes whose full page moves (None: all)
    parts: list[PartCopy] = field(default_factory=list)
    query: QueryPlan | None = None  # a hybrid storage lookup: how the I/O layer computes its hit
    engine_pages: bool = False  # the device side names the engine's own blocks (core/external.py)
    # A load under a lease opened by lock: the nodes it brings that were not the lock's hit (storage
    # reads landed since); each counts as a storage hit once the round agrees it landed.
    storage_hits: list[int] = field(default_factory=list)  # (node ids)

    @property
    def num_pages(self) -> int:
        return len(self.page_hashes)

    def full_moves(self) -> Iterable[tuple[int, int]]:
        """(position, node id) of every node whose full page the op moves."""
        if self.full_index is None:
            return enumerate(self.nodes)
        return ((i, self.nodes[i]) for i in self.full_index)


@dataclass
class Ready:
    """Everything the driver must act on since the last ``advance`` (raft's Ready).

    The core hands out one Ready at a time: a second ``ready()`` before ``advance()`` is an error, so
    no effect is ever acted on twice or lost."""

    transfers: list[Transfer] = field(default_factory=list)
    """Start each before the next round; its outcome comes back by op id (pages landed)."""
    retired: list[Transfer] = field(default_factory=list)
    """Agreed complete on every rank (``acked`` pages landed): the I/O layer forgets them."""
    released: list[int] = field(default_factory=list)
    """Leases whose release finished: nothing of theirs is pinned and no copy writes their pages."""

    def __bool__(self) -> bool:
        return bool(self.transfers or self.retired or self.released)


PREFETCH_STATES = ("querying", "deferred", "reading", "retry_wait", "done")


@dataclass
class PrefetchState:
    """One request's storage prefetch (``prefetch.py`` holds its transition table)."""

    tokens: bytes
    status: str = "querying"  # one of PREFETCH_STATES
    attempts: int = 0
    op_id: int = -1  # the current attempt's op; other completions are stale
    hit_pages: int = 0  # agreed storage hit of the current attempt
    ready_pages: int = 0  # pages landed in host over all attempts
    rounds: int = 0  # rounds since the prefetch started (the timeout policy's clock)
    deferrals: int = 0
    retry_at: int = 0
    start: int = 0  # page index the current attempt's hit starts at
    nodes: list[int] = field(default_factory=list)  # (node ids)
    anchor: list[tuple[str, int]] = field(default_factory=list)  # pins holding the fetch's parent (tier, node id)
    read: bool = True  # False: a lookup only (agree on the hit, read nothing to host)
    short: int = 0  # deferred: host slots its read lacks (part of the host deficit the round agrees on)

    def fields(self) -> list[int]:
        """What the state digest covers of it."""
        code = PREFETCH_STATES.index(self.status)
        counts = (self.attempts, self.hit_pages, self.ready_pages, self.rounds, self.deferrals, self.retry_at)
        return [code, self.op_id, *counts, self.start, int(self.read), self.short]


ADMISSION_STATES = ("queued", "parked", "ready", "committed")


@dataclass
class Admission:
    """One request's admission in phases (``admission.py`` holds its transition table); lives on
    its lease and ends with it."""

    locked_pages: int  # the cache's hit (device + host) when admitted: what storage did not bring
    state: str = "queued"  # one of ADMISSION_STATES
    deferrals: int = 0  # "again" answers so far
    no_staged: bool = False  # selected again after a short delivery: plan the device hit only
    load_from: int = -1  # pages [load_from, load_to) are what its own load brings (-1: none started)
    load_to: int = -1
    hit: int = 0  # once ready: the pages delivered

    def fields(self) -> list[int]:
        """What the state digest covers of it."""
        code = ADMISSION_STATES.index(self.state)
        return [code, self.locked_pages, self.deferrals, int(self.no_staged), self.load_from, self.load_to, self.hit]


@dataclass
class LeasePart:
    """What a lease holds of one component: nodes pinned on device or host (their ids), slots allocated to it."""

    device_nodes: list[int] = field(default_factory=list)
    host_nodes: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)


@dataclass
class Lease:
    """Everything one request holds. Released only when no copy into its pages is in flight."""

    lease_id: int
    tokens: bytes = b""  # what the request locked: load and prefetch work along this path
    device_nodes: NodeHolding = field(init=False)  # ids of the nodes pinned on device, one pin each
    host_nodes: NodeHolding = field(init=False)  # ids of the nodes pinned on host, one pin each
    pages: PageHolding = field(init=False)  # device pages allocated to it, not in the tree
    ops: list[int] = field(default_factory=list)  # in-flight op ids this lease waits for
    releasing: bool = False
    prefetch: PrefetchState | None = None
    record: int = 0  # its record in the state digest
    kept: int = 0  # its record in the digest of what a flush keeps (0 while releasing)
    kept_of: int = field(default=-1, compare=False, repr=False)  # the pages total ``kept`` was made of (-1: none)
    parts: dict[int, LeasePart] = field(default_factory=dict)  # by component (hybrid configurations)
    hit_pages: int = 0  # the hit its lock found: the protected prefix (hybrid configurations)
    locked_pages: int = 0  # the hit (device + host) its lock found: what a later load brings past it came from storage
    admission: Admission | None = None  # a request admitted in phases (``admission.py``)
    # The end of the sequence its last insert or append adopted, while ``append`` may continue it:
    # the lease pins every device node from the root to it and none below it.
    cursor: int | None = None  # (a node id)
    # The walk its lock made of ``tokens``, for the insert of the same bytes (a cache, used once and
    # checked before use; no digest covers it).
    walk: Walk | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.device_nodes = NodeHolding(self.lease_id, DEVICE_PINS)
        self.host_nodes = NodeHolding(self.lease_id, HOST_PINS)
        self.pages = PageHolding(self.lease_id, PAGES)

    def state_fields(self) -> list[int]:
        """What the state digest covers of its prefetch and its admission."""
        fields = [] if self.prefetch is None else self.prefetch.fields()
        return fields if self.admission is None else fields + self.admission.fields()


@dataclass
class MatchResult:
    """What a lookup found; ``device_pages`` then ``host_pages`` form one contiguous prefix.

    With components, ``device_pages`` is the hit the device serves now (every page, SWA window and
    state it needs valid on device) and ``device_pages + host_pages`` the hit once ``load`` brought
    back what is on host; ``parts`` lists, per component, the nodes whose data the latter reads."""

    walk: Walk
    device_pages: int = 0
    host_pages: int = 0
    device_page_array: array = field(default_factory=lambda: array("i"))  # the device prefix's pages
    nodes: list[int] = field(default_factory=list)  # device then host prefix nodes (their ids)
    parts: dict[int, list[int]] = field(default_factory=dict)  # per component: the nodes the hit reads (ids)

    @property
    def device_page_ids(self) -> list[int]:
        """The device prefix's pages as a list (``device_page_array`` is the same, without a copy)."""
        return self.device_page_array.tolist()

    @property
    def num_pages(self) -> int:
        """Full pages in the query (a partial last page is never cached)."""
        return self.walk.num_pages

    @property
    def page_hashes(self) -> list[int]:
        """The chain hash of every full page of the query (computed on first use)."""
        return self.walk.hashes


@dataclass
class Stats:
    lookups: int = 0
    lookup_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    inserted_pages: int = 0
    duplicate_pages: int = 0
    device_evicted_pages: int = 0
    host_evicted_pages: int = 0
    backups_issued_pages: int = 0
    backups_done_pages: int = 0
    backup_deferred_host_full: int = 0  # page-rounds a backup waited for a host slot
    backup_rejected_host_full: int = 0  # pages evicted from device before a host slot came free
    loads_issued_pages: int = 0
    loads_done_pages: int = 0
    failed_copy_pages: int = 0
    storage_write_issued_pages: int = 0
    storage_written_pages: int = 0
    mirrors_released_pages: int = 0
    prefetch_hit_pages: int = 0
    prefetch_read_pages: int = 0
    prefetch_stale_completions: int = 0
    prefetch_reissued: int = 0  # lookups issued again at once because the prefix they hang from moved
    prefetch_rejected_host_full: int = 0  # pages a prefetch found in storage and read not: no host slot in time
    storage_hit_tokens: int = 0  # tokens a committed admission loaded from pages read from storage
    # ... and, counted in storage_hit_tokens too, tokens a load under a lock brought to device from
    # pages read from storage (counted once the load is agreed landed)
    lock_storage_hit_tokens: int = 0
    admissions_committed: int = 0
    admission_retries: int = 0  # "try again" answers of materialize
    admission_reselects: int = 0  # fewer pages arrived than planned: selected again without staged hits
    admission_gave_up: int = 0  # past the deferral cap: admitted with what the device holds
    staging_freed_pages: int = 0  # buffer mode: host staging slots freed once their copy was agreed
    part_device_evicted: int = 0  # component device copies freed by eviction (tombstones or whole nodes)
    part_host_evicted: int = 0
    swa_released_pages: int = 0  # SWA pages behind a request's window freed after its insert
    part_loads_issued: int = 0  # component copies loaded back from host
    part_backups_issued: int = 0


class CacheClosed(RuntimeError):
    """The cache failed closed; it serves misses and refuses writes until an agreed flush."""


class UnknownLease(KeyError):
    """No live lease has this id (never issued, or already released)."""


class NoCursor(ValueError):
    """``append`` on a lease whose sequence cannot be continued (see ``Inserter.append``)."""


class ReadyNotAdvanced(RuntimeError):
    """``ready()`` was called again before ``advance()``: the driver would act on effects twice."""
