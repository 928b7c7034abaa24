"""What the core hands out and keeps per request: ops (Transfer effects), leases, match results,
counters, and the errors of its operations."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpcache.core.prefetch import PrefetchState
    from tpcache.core.tree import Node, Walk


class OpKind(IntEnum):
    """The completion queues; each is applied in issue order."""

    BACKUP = 0  # device -> host
    LOAD = 1  # host -> device
    STORAGE_WRITE = 2  # host -> storage
    STORAGE_READ = 3  # storage -> host (prefetch)
    STORAGE_QUERY = 4  # which pages storage holds (prefetch lookup)


@dataclass
class Transfer:
    """An effect: a copy the shell must start. ``acked`` is filled from the agreed completion."""

    op_id: int
    kind: OpKind
    nodes: list[Node]
    device_pages: list[int]
    host_slots: list[int]
    page_hashes: list[int]
    lease_id: int = -1
    pinned: list[Node] = field(default_factory=list)  # device pins the op holds (a backup: its path)
    # The device side names the engine's own blocks, not tpcache's pages (tpcache/core/external.py).
    engine_pages: bool = False
    acked: int = -1  # pages agreed landed on every rank, set when the op completes (-1: not yet)

    @property
    def num_pages(self) -> int:
        return len(self.page_hashes)


@dataclass
class Lease:
    """Everything one request holds. Released only when no copy into its pages is in flight."""

    lease_id: int
    tokens: bytes = b""  # what the request locked: load and prefetch work along this path
    device_nodes: list[Node] = field(default_factory=list)  # pinned on device, one pin each
    host_nodes: list[Node] = field(default_factory=list)  # pinned on host, one pin each
    pages: list[int] = field(default_factory=list)  # device pages allocated to it, not in the tree
    ops: list[int] = field(default_factory=list)  # in-flight op ids this lease waits for
    releasing: bool = False
    prefetch: PrefetchState | None = None
    record: int = 0


@dataclass
class MatchResult:
    """What a lookup found; ``device_pages`` then ``host_pages`` form one contiguous prefix."""

    walk: Walk
    device_pages: int = 0
    host_pages: int = 0
    device_page_array: array = field(default_factory=lambda: array("i"))  # the device prefix's pages
    nodes: list[Node] = field(default_factory=list)  # device then host prefix nodes

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


class CacheClosed(RuntimeError):
    """The cache failed closed; it serves misses and refuses writes until an agreed flush."""


class UnknownLease(KeyError):
    pass
