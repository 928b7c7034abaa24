"""Admission in phases: select a prefill shape, materialize its hit, commit.

The contract an engine's scheduler follows for each waiting request (``admit`` opened its lease,
and with a storage tier started its prefetch):

    shape = cache.select(lease)            # pure: the shape if admitted now; allocates nothing
    out = cache.materialize(lease, shape)  # sequenced: bring the planned hit to device, under the prefix's pin
    "again": keep the request queued, in its turn; its hold (the pin on its device prefix) is kept
    "short": fewer pages arrived than planned; select again (the new shape has no staged hit)
    "ready": out.shape is the hit that arrived (more than planned: the extend range shrank)
    admitted = cache.commit(lease)         # sequenced: the hit is counted now, and only now

Invariants:
- every state change of an admission is a row of ``TRANSITIONS``, made by ``_to`` alone; an event
  its state does not take raises ``IllegalAdmissionEvent`` (a caller's bug, never a guess);
- a hit is counted in stats (and so in metrics) and reported to the engine only by ``commit``, and
  only as pages that are device-valid on every rank and pinned by the lease: nothing planned and
  then not delivered is ever counted (no phantom host-hit tokens);
- a parked request keeps its turn: ``queue`` orders waiting admissions by lease id, which a retry
  never changes, so a newer request never overtakes a parked one;
- waiting is bounded: past ``admission_max_deferrals`` "again" answers (or a prefetch past its
  retry cap) the request is admitted with what the device holds, and its fetch's later acks are
  stale;
- every field here that decides a later answer is in the lease's digest record (``fields``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpcache.core.records import Admission, Lease, OpKind
from tpcache.core.treecore.allocator import OutOfPages

if TYPE_CHECKING:
    from collections.abc import Callable

    from tpcache.core.config import CacheConfig
    from tpcache.core.leases import Leases
    from tpcache.core.loads import Loader
    from tpcache.core.outbox import Outbox
    from tpcache.core.prefetch import Prefetcher
    from tpcache.core.treecore import TreeCore

# state -> event -> next state
TRANSITIONS: dict[str, dict[str, str]] = {
    "queued": {"again": "parked", "short": "queued", "ready": "ready"},
    "parked": {"again": "parked", "short": "queued", "ready": "ready"},
    "ready": {"commit": "committed"},
    "committed": {},
}


class AdmissionError(ValueError):
    """An admission call its request's state does not allow."""


class NotAdmitted(AdmissionError):
    """The lease was opened by ``lock``, not ``admit``: it has no admission to advance."""


class IllegalAdmissionEvent(AdmissionError):
    """An event the admission's state does not take (e.g. ``commit`` before ``materialize`` said ready)."""


@dataclass(frozen=True)
class Shape:
    """A prefill shape, in pages: the first ``device_pages`` are on device, the next ``staged_pages``
    are to be loaded (host hits, or pages staged from storage), the rest is computed."""

    num_pages: int
    device_pages: int = 0
    staged_pages: int = 0
    waiting: bool = False  # a storage prefetch is still running: materialize answers "again"

    @property
    def planned_pages(self) -> int:
        return self.device_pages + self.staged_pages

    @property
    def extend_pages(self) -> int:
        return self.num_pages - self.planned_pages


@dataclass(frozen=True)
class Materialized:
    status: str  # "ready", "again" or "short"
    shape: Shape  # ready: as delivered (staged_pages 0); else as planned
    reason: str = ""  # again/short: prefetch, loading, device_full, fewer_arrived


@dataclass(frozen=True)
class Admitted:
    """What commit tells the engine: the first ``hit_pages`` pages are on device (``device_page_ids``,
    pinned by the lease); compute from token ``hit_pages * page_size`` on."""

    hit_pages: int
    device_page_ids: list[int] = field(default_factory=list)
    device_tokens: int = 0  # of the hit, by where it came from
    host_tokens: int = 0
    storage_tokens: int = 0


def _to(adm: Admission, event: str) -> None:
    try:
        adm.state = TRANSITIONS[adm.state][event]
    except KeyError:
        raise IllegalAdmissionEvent(f"admission in state {adm.state!r} cannot take {event!r}") from None


def _overlap(a: int, b: int, c: int, d: int) -> int:
    return max(0, min(b, d) - max(a, c))


class Admitter:
    def __init__(
        self,
        config: CacheConfig,
        core: TreeCore,
        leases: Leases,
        outbox: Outbox,
        loader: Loader,
        prefetcher: Prefetcher,
        closed: Callable[[], bool],
    ) -> None:
        self.config = config
        self.core = core
        self.leases = leases
        self.outbox = outbox
        self.loader = loader
        self.prefetcher = prefetcher
        self.closed = closed
        self.buffer = config.host_mode == "buffer"

    def check_supported(self) -> None:
        """Phased admission plans full-attention pages; a hybrid model's hit also needs its window
        and states (the hit rule), which ``lock`` and ``load`` apply: refuse rather than over-count."""
        if self.core.components:
            raise AdmissionError("admission in phases covers full-attention models; use lock and load for hybrid ones")

    def admit(self, lease: Lease, locked_pages: int, prefetch: bool) -> None:
        """Give a freshly locked lease its admission (and, with storage, start its prefetch)."""
        lease.admission = Admission(locked_pages)
        if prefetch and self.config.storage and not self.closed() and not self.prefetcher.storage_down:
            self.prefetcher.start(lease)
        self.leases.refresh(lease)

    @staticmethod
    def get(lease: Lease) -> Admission:
        if lease.admission is None:
            raise NotAdmitted(f"lease {lease.lease_id} was opened by lock, not admit")
        return lease.admission

    # ------------------------------------------------------------------ pure

    def queue(self) -> list[int]:
        """Waiting admissions (queued or parked), oldest first: the order to materialize them in."""
        return [
            lid
            for lid, x in sorted(self.leases.table.items())
            if x.admission is not None and x.admission.state in ("queued", "parked") and not x.releasing
        ]

    def select(self, lease: Lease) -> Shape:
        """The shape the request would be admitted with now. Pure."""
        adm = self.get(lease)
        walk = self.core.walk(lease.tokens)
        if self.closed():
            return Shape(walk.num_pages)
        device, reach = self._reach(walk.ids, adm.no_staged)
        state = lease.prefetch
        waiting = state is not None and state.status != "done" and not adm.no_staged
        return Shape(walk.num_pages, device, reach - device, waiting)

    # ------------------------------------------------------------------ sequenced

    def materialize(self, lease: Lease, planned: Shape) -> Materialized:
        adm = self.get(lease)
        if adm.state not in ("queued", "parked"):
            raise IllegalAdmissionEvent(f"admission in state {adm.state!r} cannot materialize")
        if self.closed():  # a closed cache serves misses: admit now, with nothing
            return self._ready(lease, adm, 0, planned.num_pages)
        state = lease.prefetch
        if state is not None and state.status != "done" and not adm.no_staged:
            if self.prefetcher.anchor_moved(lease):
                self.prefetcher.reissue(lease)  # the earlier lookup's ack is stale from here on
            return self._again(lease, adm, planned, "prefetch")
        if self._loading(lease):
            return self._again(lease, adm, planned, "loading")
        device, reach = self._reach(self._path(lease), adm.no_staged)
        if reach > device and adm.load_from < 0:
            try:
                self.loader.load(lease)
            except OutOfPages:
                return self._again(lease, adm, planned, "device_full")
            adm.load_from, adm.load_to = device, reach
            if self._loading(lease):
                return self._again(lease, adm, planned, "loading")
        arrived = self._hold(lease, self._path(lease))  # (the load may have evicted pages past its reach)
        if arrived < planned.planned_pages and not adm.no_staged:
            adm.no_staged = True  # (load_from stays: what did land is still counted by where it came from)
            self.core.stats.admission_reselects += 1
            _to(adm, "short")
            self.leases.refresh(lease)
            return Materialized("short", planned, "fewer_arrived")
        return self._ready(lease, adm, arrived, planned.num_pages)

    def commit(self, lease: Lease) -> Admitted:
        adm = self.get(lease)
        _to(adm, "commit")
        hit, ps, stats = adm.hit, self.config.page_size, self.core.stats
        loaded = _overlap(adm.load_from, adm.load_to, 0, hit) if adm.load_from >= 0 else 0
        if self.buffer:
            storage = loaded  # host only stages: every loaded page came from storage
        else:
            storage = _overlap(max(adm.load_from, adm.locked_pages), adm.load_to, 0, hit) if loaded else 0
        walk = self.core.walk(lease.tokens)
        stats.lookups += 1
        stats.lookup_tokens += walk.num_pages * ps
        stats.device_hit_tokens += (hit - loaded) * ps
        stats.host_hit_tokens += (loaded - storage) * ps
        stats.storage_hit_tokens += storage * ps
        stats.admissions_committed += 1
        self.leases.refresh(lease)
        pages = self.core.device_pages(walk.ids[:hit])
        return Admitted(hit, pages, (hit - loaded) * ps, (loaded - storage) * ps, storage * ps)

    # ------------------------------------------------------------------ internals

    def _path(self, lease: Lease) -> list[int]:
        return self.core.walk(lease.tokens).ids

    def _reach(self, ids: list[int], no_staged: bool) -> tuple[int, int]:
        """(device-valid leading pages, pages a load would reach), by the load's own rule (``loads``)."""
        device, _, reach, _ = self.core.load_reach(ids)
        return (device, device) if no_staged else (device, reach)

    def _loading(self, lease: Lease) -> bool:
        """Whether a load the lease waits for (its own, or one it shares) is still in flight."""
        loads = {op.op_id for op in self.outbox.inflight[OpKind.LOAD]}
        return any(op in loads for op in lease.ops)

    def _hold(self, lease: Lease, ids: list[int]) -> int:
        """Pin the device-valid prefix of the path ``ids`` for the lease (its hold) and return its length."""
        n = self.core.load_reach(ids)[0]
        self.leases.pin_device(lease, ids[:n])
        return n

    def _again(self, lease: Lease, adm: Admission, planned: Shape, reason: str) -> Materialized:
        adm.deferrals += 1
        if adm.deferrals > self.config.admission_max_deferrals:
            self.prefetcher.abandon(lease)  # its later acks are stale: nothing it brings is counted
            adm.no_staged = True
            self.core.stats.admission_gave_up += 1
            return self._ready(lease, adm, self._hold(lease, self._path(lease)), planned.num_pages)
        self._hold(lease, self._path(lease))
        self.core.stats.admission_retries += 1
        _to(adm, "again")
        self.leases.refresh(lease)
        return Materialized("again", planned, reason)

    def _ready(self, lease: Lease, adm: Admission, arrived: int, num_pages: int) -> Materialized:
        adm.hit = arrived
        _to(adm, "ready")
        self.leases.refresh(lease)
        return Materialized("ready", Shape(num_pages, arrived))
