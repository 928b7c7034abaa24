"""The driver: the one loop that applies sequenced operations to the core and runs the round.

Sequenced operations are data (``sequenced.Op``: a kind and plain arguments), applied through one
dispatch table (``sequenced.APPLY``); ``trace`` sees each before it is applied.

``TPCache`` (embedded in an engine's TP workers and in the service's rank processes) and the
simulator all run this code; the simulator replaces only the I/O (``IO``) and the exchange of
vectors. A step is split in two halves around that exchange:

    vector = driver.begin()                 # poll local completions, prepare
    reduced = collective.allreduce_min(vector)   # exactly one collective, on every rank
    report = driver.end(reduced)            # commit, act on the Ready

``step`` does the three in order. Whatever happens locally the rank still takes part: a rank that
cannot prepare sends a poison vector, so its peers close with it instead of waiting; a commit that
raises closes this rank and reports it unhealthy in the next round; a collective that fails breaks
the group for good (every rank closes and says the group must be restarted).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from protocol.round_vector import HEALTH_COMMIT_FAILED, HEALTH_PREPARE_FAILED
from tpcache.comm.collective import Collective, CollectiveError
from tpcache.core import Admitted, CacheClosed, CacheCore, MatchResult, Materialized, Shape, Transfer
from tpcache.core.hashing import TokenIds
from tpcache.core.round import Round, RoundReport
from tpcache.core.treecore.lookup import lookup
from tpcache.engine.sequenced import APPLY, Op

log = logging.getLogger("tpcache.driver")


class IO(Protocol):
    """One rank's I/O as the driver sees it: all the simulator replaces besides the collective."""

    def start(self, ops: Sequence[Transfer]) -> None:
        """Begin these ops; an op that cannot start is reported as landed with 0 pages."""

    def landed(self) -> Mapping[int, int]:
        """Op id -> leading pages that landed on this rank, for every finished op not yet retired."""

    def retire(self, ops: Sequence[Transfer]) -> None:
        """The round agreed these ops complete: forget them."""

    def health(self) -> int:
        """This rank's health bits (0: healthy)."""

    def drained(self) -> bool:
        """No copy is physically in flight on this rank."""

    def reset(self) -> None:
        """After an agreed flush: forget every op (none is in flight)."""


class GroupBroken(CacheClosed):
    """The round's collective failed on this rank: only restarting the group reopens the cache."""


class Driver:
    def __init__(
        self,
        core: CacheCore,
        io: IO,
        collective: Collective | None = None,
        *,
        rank: int = 0,
        round_timeout_s: float = 30.0,
        kv_layout: str = "",
    ) -> None:
        """``kv_layout``: a description of the KV layout of every component, which the round's
        layout field covers (ranks with different layouts close in their first round)."""
        self.core = core
        self.io = io
        self.collective = collective
        self.rank = rank
        self.round_timeout_s = round_timeout_s
        self.round = Round(core, kv_layout=kv_layout)
        self.seq = 0  # sequenced operations applied since the start or the last agreed flush
        self.health_bits = 0  # the driver's own: a commit that raised
        self.on_released: Callable[[list[int]], None] | None = None  # leases whose release finished
        self.trace: Callable[[Op], None] | None = None  # sees each op before it is applied (a debug hook)

    @property
    def broken(self) -> str | None:
        return self.round.broken

    def apply(self, op: Op) -> Any:
        """Apply one sequenced operation to the core (every rank applies the same ones, in order);
        returns the core's answer."""
        fn = APPLY.get(op.kind)
        if fn is None:
            raise ValueError(f"no sequenced op {op.kind!r} (the kinds: {', '.join(APPLY)})")
        self.seq += 1  # counted even when the op raises: every rank raises alike
        if self.trace is not None:
            self.trace(op)
        try:
            return fn(self, *op.args)
        finally:
            self._act()

    def request_flush(self) -> None:
        if self.broken is not None:
            raise GroupBroken(f"the round's collective failed ({self.broken}); restart the group to reopen the cache")
        self.apply(Op("request_flush"))

    # ------------------------------------------------------------------ the round

    def begin(self) -> array:
        """The first half of a round: this rank's vector (a poison vector if it cannot prepare one)."""
        try:
            landed = self.io.landed()
            return self.round.prepare(self.seq, landed, self.io.health() | self.health_bits, self.io.drained())
        except Exception as exc:  # noqa: BLE001 - any local failure must still reach the round
            log.exception("round %d: preparing failed on rank %d", self.round.number, self.rank)
            self.core.close(f"rank {self.rank} could not prepare round {self.round.number}: {exc}")
            return self.round.poison_vector(self.seq, HEALTH_PREPARE_FAILED)

    def end(self, reduced: Sequence[int] | CollectiveError) -> RoundReport:
        """The second half: commit the reduced vector (or fail closed on a collective error)."""
        if isinstance(reduced, CollectiveError):
            number = self.round.number
            self.round.fail(f"round {number}: the collective failed: {reduced}")
            return RoundReport(round=number, closed_reason=self.core.closed_reason)
        try:
            report = self.round.commit(reduced)
            if report.flushed:
                # Every rank starts over together: requests are counted afresh, so ranks whose counts
                # had diverged (the usual reason for a flush) agree again.
                self.io.reset()
                self.seq = 0
                self.health_bits = 0
            self._act()
        except Exception as exc:  # noqa: BLE001 - a commit that breaks midway must not serve again
            log.exception("round %d: commit failed on rank %d", self.round.number, self.rank)
            self.core.close(f"rank {self.rank} failed to commit: {exc}")
            self.health_bits |= HEALTH_COMMIT_FAILED  # the next round closes every rank
            return RoundReport(round=self.round.number, closed_reason=self.core.closed_reason)
        return report

    def step(self) -> RoundReport:
        """One round: exactly one all-reduce, issued by every rank whatever happened locally."""
        if self.collective is None:
            raise RuntimeError("this driver has no collective: the caller exchanges vectors (begin/end)")
        vector = self.begin()
        try:
            reduced: Sequence[int] | CollectiveError = self.collective.allreduce_min(vector, self.round_timeout_s)
        except CollectiveError as exc:
            reduced = exc
        return self.end(reduced)

    def _act(self) -> None:
        """Hand the core's Ready to the I/O and acknowledge it."""
        if not self.core.has_ready():
            return
        ready = self.core.ready()
        try:
            self.io.retire(ready.retired)
            self.io.start(ready.transfers)
        finally:
            self.core.advance()
        if ready.released and self.on_released is not None:
            self.on_released(ready.released)


class Operations:
    """The engine-facing operations of one rank, each sequenced through its driver. ``TPCache`` and
    the simulator's ranks share these, so both apply exactly the same calls."""

    driver: Driver

    @property
    def core(self) -> CacheCore:
        return self.driver.core

    def lock(self, tokens: TokenIds) -> tuple[int, MatchResult]:
        """Match and pin the cached prefix for a request; returns (lease id, match)."""
        return self.driver.apply(Op("lock", (tokens,)))

    def alloc(self, lease: int, num_pages: int, component: int | str = 0) -> list[int]:
        """Device pages for the lease to compute KV into (evicting unpinned cache pages); with a
        ``component`` ("swa", "mamba" or its index), slots of that component's device pool."""
        return self.driver.apply(Op("alloc", (lease, num_pages, self._component(component))))

    def insert(
        self,
        lease: int,
        tokens: TokenIds,
        device_pages: Sequence[int],
        parts: Mapping[int | str, Sequence[int]] | None = None,
    ) -> tuple[int, int]:
        """Cache the full pages of ``tokens`` whose KV is in ``device_pages``; ``parts``: per
        component, the slot holding each page's data of that component (-1: none)."""
        return self.driver.apply(Op("insert", (lease, tokens, list(device_pages), self._by_index(parts))))

    def adopt(self, lease: int, tokens: TokenIds, device_pages: Sequence[int]) -> list[int]:
        """With ``device_adopt`` (the engine's allocator owns the device pages): cache the full
        pages of ``tokens`` whose KV the engine wrote into ``device_pages``; returns the pages not
        adopted (cached already under another page), which stay the engine's."""
        return self.driver.apply(Op("adopt", (lease, tokens, list(device_pages))))

    def load_adopted(self, lease: int, pages: Sequence[int]) -> Transfer | None:
        """With ``device_adopt`` and a host tier: copy the lease's host-only hit into the engine's
        ``pages`` (allocated by the engine) and adopt them; returns the LOAD op (None: no pages)."""
        return self.driver.apply(Op("load_adopted", (lease, list(pages))))

    def evict_device(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unpinned device pages, least valuable first; returns how many.
        With ``device_adopt`` the freed page ids wait in ``drain_returned``."""
        return self.driver.apply(Op("evict_device", (num_pages,)))

    def drain_returned(self) -> list[int]:
        """With ``device_adopt``: the device pages freed since the last drain, in the order freed
        (alike on every rank); the engine owns them again."""
        return self.driver.apply(Op("drain_returned"))

    def append(
        self,
        lease: int,
        tokens: TokenIds,
        device_pages: Sequence[int],
        parts: Mapping[int | str, Sequence[int]] | None = None,
    ) -> tuple[int, int]:
        """Cache the full pages of ``tokens``, which follow what the lease's last ``insert`` or
        ``append`` cached (a running request's new pages, given alone); ``device_pages[i]`` holds
        page i of ``tokens``. Costs what it adds. ``NoCursor`` (a ValueError) when the lease's
        sequence cannot be continued (see ``CacheCore.append``): call ``insert`` with all of it."""
        return self.driver.apply(Op("append", (lease, tokens, list(device_pages), self._by_index(parts))))

    def chunk_tokens(self, lease: int, start: int, want: int) -> int:
        """How many tokens of a prefill chunk starting at ``start`` the pools take now (pure)."""
        return self.core.chunk_tokens(lease, start, want)

    def _by_index(self, parts: Mapping[int | str, Sequence[int]] | None) -> dict[int, list[int]] | None:
        return {self._component(c): list(v) for c, v in parts.items()} if parts else None

    def _component(self, component: int | str) -> int:
        if isinstance(component, int):
            return component
        for spec in self.core.config.components():
            if spec.name == component:
                return spec.index
        raise ValueError(f"no component {component!r} in this configuration")

    def load(self, lease: int) -> Any:
        """Start loading the lease's host hits to device; returns the prefix's device pages."""
        return self.driver.apply(Op("load", (lease,)))

    def prefetch(self, lease: int, read: bool = True) -> bool:
        """Look the continuation of the lease's tokens up in storage; read the agreed hit to host
        (``read=False``: only agree on the hit). Follow with ``prefetch_status``/``admissible``,
        then ``load``."""
        return self.driver.apply(Op("prefetch", (lease, read)))

    def prefetch_status(self, lease: int) -> tuple[str, int]:
        return self.core.prefetch_status(lease)

    def admissible(self, lease: int, policy: str = "best_effort", timeout_rounds: int = 8) -> bool:
        """Whether to admit the lease's request now under the prefetch stop policy (pure, agreed state)."""
        return self.core.admissible(lease, policy, timeout_rounds)

    def admit(self, tokens: TokenIds, prefetch: bool = True) -> tuple[int, MatchResult]:
        """Open a request for admission in phases (``select``, ``materialize``, ``commit``): its
        prefix is pinned and, with a storage tier, its rest looked up; no hit is counted yet."""
        return self.driver.apply(Op("admit", (tokens, prefetch)))

    def select(self, lease: int) -> Shape:
        """The prefill shape the request would be admitted with now (pure; allocates nothing)."""
        return self.core.select(lease)

    def materialize(self, lease: int, planned: Shape) -> Materialized:
        """Bring the planned hit to device: "ready", "again" (keep it queued) or "short" (select again)."""
        return self.driver.apply(Op("materialize", (lease, planned)))

    def commit(self, lease: int) -> Admitted:
        """Admit the request with the delivered hit; only now is the hit counted."""
        return self.driver.apply(Op("commit", (lease,)))

    def admission_queue(self) -> list[int]:
        """Leases waiting for admission, oldest first (pure)."""
        return self.core.admission_queue()

    def release(self, lease: int) -> bool:
        """Finish or abort a request. Parked until copies into its pages land."""
        return self.driver.apply(Op("release", (lease,)))

    def set_retention_cap(self, tokens: int) -> None:
        self.driver.apply(Op("set_retention_cap", (tokens,)))

    def set_mirror_release(self, enabled: bool) -> None:
        """Switch mirror release on or off; sequenced, so every rank switches at once."""
        self.driver.apply(Op("set_feature", ("mirror_release", enabled)))

    def request_flush(self) -> None:
        """Ask for an agreed flush (raises ``GroupBroken`` if the round's collective failed)."""
        self.driver.request_flush()

    def match(self, tokens: TokenIds) -> MatchResult:
        """A pure lookup (not sequenced; changes nothing)."""
        return self.core.match(tokens)

    def lookup(self, tokens: TokenIds) -> tuple[int, int, array]:
        """``match``'s (device pages, host pages, device page ids) alone, at less cost. Pure."""
        return lookup(self.core, tokens)
