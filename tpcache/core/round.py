"""The round: prepare a fixed-shape vector of local facts, commit only what every rank agrees on.

Per step every rank calls ``prepare`` (local observations -> vector), the driver runs exactly one
MIN all-reduce, then every rank calls ``commit`` with the reduced vector. Commit mutates the core
only through agreed values, so ranks that were equal stay equal, whatever finished first where.

Fail-closed levels:
- a plan whose (count, tokens, digest) differs across ranks is skipped; after
  ``plan_mismatch_limit`` mismatches in a row its feature switches off;
- a layout, round, sequence, state digest, queue or health disagreement closes the cache: matches
  miss, writes are refused, in-flight copies still drain; an agreed flush reopens it;
- a collective that fails (timeout, dead rank) is broken for good (``fail``): the cache closes and
  stays closed until the group is restarted, since ranks can no longer tell which rounds the others
  committed.
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import NamedTuple

from protocol.round_vector import HEALTH_STORAGE_DOWN, LAYOUT_VERSION, QUEUES, Agreement, RoundLayout
from tpcache.core.backend import NATIVE as _native
from tpcache.core.backup import MirrorRelease
from tpcache.core.cache import CacheCore, OpKind, Transfer
from tpcache.core.digest import DIGEST_MASK, mix, mix_ids, mix_text
from tpcache.core.plans import Plan, PlanFeature

log = logging.getLogger("tpcache.round")

QUEUE_OF: dict[OpKind, str] = dict(zip(OpKind, QUEUES, strict=True))
_QUEUES_IN_ORDER = itemgetter(*QUEUE_OF)  # the inflight dict's queues, in layout order
FEATURES = {"mirror_release": MirrorRelease}  # plan features by name (``set_feature``)


class QueueObservation(NamedTuple):
    """What this rank saw of one completion queue, reading from its head in issue order."""

    done: int = 0  # ops finished at the head
    clean: int = 0  # of those, leading ops that succeeded on every page
    head_acked: int = 0  # leading pages the head op got through (its partial success)


def observe_head(landed: Mapping[int, int], pending: Sequence[Transfer]) -> QueueObservation:
    """Count finished ops from the head of a queue; ``landed`` maps op id -> pages that landed."""
    done = clean = 0
    for op in pending:
        pages = landed.get(op.op_id)
        if pages is None:
            break
        done += 1
        if clean == done - 1 and pages == op.num_pages:
            clean += 1
    head = landed.get(pending[0].op_id, 0) if pending else 0
    return QueueObservation(done, clean, head or 0)


def reference_queue_fields(queues: Iterable[Sequence[Transfer]], landed: Mapping[int, int]) -> list[int]:
    """Per queue in order, its fields of the round vector as this rank saw it: the digest of the ids
    in flight, then ``observe_head``'s counts (``head_acked`` 0 unless the head op finished)."""
    out: list[int] = []
    for pending in queues:
        obs = observe_head(landed, pending)
        out += (mix_ids([op.op_id for op in pending]), obs.done, obs.clean, obs.head_acked if obs.done else 0)
    return out


def queue_fields(queues: Iterable[Sequence[Transfer]], landed: Mapping[int, int]) -> list[int]:
    if _native is not None and type(landed) is dict:  # the same fields in C (_round.c), from plain ints
        queues = tuple(queues)  # (the same tuple when it is one)
        ids = [[op.op_id for op in pending] for pending in queues]
        sizes = [[len(op.page_hashes) for op in pending] for pending in queues]
        fields = _native.queue_fields(ids, sizes, landed)
        if fields is not None:  # None: a landed count that is not an int64, read as the reference reads it
            return fields
    return reference_queue_fields(queues, landed)


@dataclass(slots=True)
class RoundReport:
    round: int
    completed: list[Transfer] = field(default_factory=list)
    plan_executed: str | None = None
    plan_skipped: str | None = None
    mismatches: list[str] = field(default_factory=list)
    closed_reason: str | None = None
    flushed: bool = False
    idle: bool = False  # agreed: no rank had anything in flight when it prepared this round


class Round:
    def __init__(self, core: CacheCore, features: Sequence[PlanFeature] | None = None, kv_layout: str = "") -> None:
        """``kv_layout``: a description of the KV byte layout of every component (the engine's),
        which ranks must share as they share the configuration."""
        self.core = core
        self.layout = RoundLayout.default(QUEUES, [p.name for p in core.ledger.parts.values()])
        # Ranks must run one layout and one configuration: a digest of both is the layout field.
        described = [LAYOUT_VERSION, self.layout.fields, core.config.to_dict()] + ([kv_layout] if kv_layout else [])
        self.layout_digest = mix_text(json.dumps(described))
        self.number = 0
        self.features: list[PlanFeature] = list(core.plan_features if features is None else features)
        self._configured = [f.name for f in self.features]
        self._switched = False  # the features differ from the configured ones (``set_feature``)
        self.pending_plan: Plan | None = None  # prepared last commit, checked this round
        self.plan_mismatches = 0  # consecutive rounds whose plans disagreed
        self.disabled: set[str] = set()
        self.mismatch_counts: dict[str, int] = {}  # field -> rounds it disagreed (metrics)
        self.broken: str | None = None  # why the collective can no longer be trusted, once it failed
        self._prepared: tuple[list[int], array] | None = None  # this round's values and vector
        at = self.layout.index
        self._at_health, self._at_idle = at("health"), at("idle")
        self._at_flush, self._at_drained = at("flush"), at("drained")
        self._at_storage_down = at("storage_down")
        self._at_queues = [(kind, at(f"{q}.queue_digest")) for kind, q in QUEUE_OF.items()]

    def rebind(self, core: CacheCore) -> None:
        """After an agreed flush the core starts over: the features (as switched at runtime) act on it."""
        self.core = core
        self.features = [FEATURES[f.name](core.backup) for f in self.features]

    # ------------------------------------------------------------------ prepare

    def state_digest(self) -> int:
        """The core's state digest and the round's own state that decides (the plans' counters)."""
        if self.plan_mismatches or self.disabled or self._switched:
            names = [f.name for f in self.features]
            off = mix_ids(sorted(mix_text(name) for name in self.disabled))
            plans = mix(self.plan_mismatches, off, mix_ids([mix_text(name) for name in names]))
            return (self.core.state_digest() + plans) & DIGEST_MASK
        return self.core.state_digest()

    def prepare(self, seq: int, landed: Mapping[int, int], health: int, drained: bool) -> array:
        """This rank's vector for the round. Pure with respect to the core.

        ``landed``: op id -> pages that landed, for every op this rank saw finish and not yet
        retired; ``health``: the rank's health bits; ``drained``: no copy physically in flight."""
        if self._prepared is not None:
            raise RuntimeError("prepare called twice without commit: one collective per round")
        core = self.core
        inflight = core.outbox.inflight
        idle = drained and not any(inflight.values())
        values = [
            self.layout_digest,
            self.number,
            seq,
            self.state_digest(),
            health & ~HEALTH_STORAGE_DOWN,
            int(drained),
            int(idle),
            int(core.flush_requested),
            core.book.kept_digest,
        ]
        values += queue_fields(_QUEUES_IN_ORDER(inflight), landed)
        values += (
            core.outbox.next_op,
            core.book.next_lease,
            core.host_deficit,
            int(bool(health & HEALTH_STORAGE_DOWN)),
        )
        plan = self.pending_plan
        values += (plan.count, plan.tokens, plan.digest) if plan else (0, 0, 0)
        if core.ledger.parts:
            values += (len(p.backlog) for p in core.ledger.parts.values())
        vector = self._pack(values)
        self._prepared = (values, vector)
        return vector

    def _pack(self, values: list[int]) -> array:
        """The vector the collective sends, as the int64 array it sends (no conversion there)."""
        if _native is not None and len(values) == len(self.layout.fields):
            vector = _native.pack_pairs(values)  # None: a value out of range, which the reference names
            if vector is not None:
                return vector
        return array("q", self.layout.pack_values(values))

    def poison_vector(self, seq: int, health: int) -> array:
        """A vector that says "this rank is unhealthy", for a rank that could not prepare one."""
        values = [0] * len(self.layout.fields)
        at = self.layout.index
        values[at("layout")], values[at("round")], values[at("seq")] = self.layout_digest, self.number, seq
        values[self._at_health] = health
        vector = self._pack(values)
        self._prepared = (values, vector)
        return vector

    # ------------------------------------------------------------------ commit

    def commit(self, reduced: Sequence[int]) -> RoundReport:
        if self._prepared is None:
            raise RuntimeError("commit without prepare")
        values, vector = self._prepared
        self._prepared = None
        number = self.number
        self.number += 1  # first: a commit that raises below still counts its round, as its peers do
        # The reduced vector is this rank's own exactly when every rank sent the same one (MIN over
        # each (x, -x) pair gives (x, -x) back only if no rank had less or more): the common case.
        # The collective hands back an array('q') like ``vector``: one memory compare.
        if reduced == vector:
            agreement = self.layout.unanimous(values)
            clear = values[self._at_health] == 0
        else:
            agreement = self.layout.unpack(reduced)
            clear = agreement.unanimous and agreement.lo.values[self._at_health] == 0
        lo = agreement.lo.values
        report = RoundReport(number, idle=lo[self._at_idle] == 1)
        core = self.core
        if agreement.hi.values[self._at_storage_down] and not core.backup.storage_down:
            # A rank's storage can no longer be used: every rank stops using storage, in this round.
            core.prefetcher.storage_down = True
            forgotten = core.backup.storage_lost()
            log.warning(
                "round %d: a rank's storage tier can no longer be used: storage is off on every rank "
                "(%d durable pages forgotten); the cache stays open; restart with usable storage",
                number,
                forgotten,
            )

        if not clear:
            self._check_header(agreement, report)
        inflight = core.outbox.inflight
        for kind, at in self._at_queues:
            if inflight[kind] or not clear:
                self._apply_queue(kind, at, agreement, report)
        if self.pending_plan is not None or not clear:
            self._apply_plan(agreement, report)
        if lo[self._at_flush] == 1 and lo[self._at_drained] == 1:
            # Every rank asked for the flush and has no copy physically in flight, so dropping all
            # state frees nothing a copy still writes, whatever each rank's (diverged) queues say.
            # The leases a flush keeps must be the same everywhere, or the ranks would differ again.
            if agreement.agreed("leases"):
                self._flush(agreement, report)
            else:
                self._mismatch("leases", report)
                log.error(
                    "round %d: flush waits: the ranks hold different leases; release every lease to flush",
                    report.round,
                )
        if core.closed_reason is None:
            core.after_commit()
            self.pending_plan = self._prepare_plan(agreement)
            core.enforce_retention()
        report.closed_reason = core.closed_reason
        return report

    def set_feature(self, name: str, enabled: bool) -> None:
        """Switch a plan feature on or off at runtime (a sequenced op: every rank at once). On again
        also clears a switch-off after repeated plan mismatches, by the operator's choice."""
        if name not in FEATURES:
            raise ValueError(f"unknown plan feature {name!r}; choose one of {sorted(FEATURES)}")
        self.features = [f for f in self.features if f.name != name]
        if enabled:
            self.features.append(FEATURES[name](self.core.backup))
        self._switched = [f.name for f in self.features] != self._configured
        self.disabled.discard(name)
        self.plan_mismatches = 0

    def fail(self, reason: str) -> None:
        """The collective failed (timeout, dead rank): close for good, mutating nothing else. The
        round still counts, so a rank whose call failed and a peer whose call went through agree
        on the number of rounds issued."""
        self._prepared = None
        self.number += 1
        self.broken = reason
        self.core.close(f"{reason}; the group must be restarted")
        log.error("cache closed: %s; the group must be restarted", reason)

    def _mismatch(self, name: str, report: RoundReport) -> None:
        report.mismatches.append(name)
        self.mismatch_counts[name] = self.mismatch_counts.get(name, 0) + 1

    def _check_header(self, a: Agreement, report: RoundReport) -> None:
        # Health first: a rank that could not take part says so, and that is the reason to report.
        if a.hi["health"] != 0 or not a.agreed("health"):
            self._mismatch("health", report)
            self._close(f"a rank reported unhealthy (health bits up to {a.hi['health']:#x})", report)
        for name in ("layout", "round", "seq", "state_digest", "flush"):
            if not a.agreed(name):
                self._mismatch(name, report)
                why = " (the ranks were built with different settings or KV layouts)" if name == "layout" else ""
                self._close(f"{name} differs across ranks (min {a.lo[name]}, max {a.hi[name]}){why}", report)

    def _close(self, reason: str, report: RoundReport) -> None:
        if not self.core.closed:
            log.error("round %d: cache closed: %s", report.round, reason)
        self.core.close(reason)

    def _apply_queue(self, kind: OpKind, at: int, a: Agreement, report: RoundReport) -> None:
        """``at``: the position of the queue's digest; its counts follow (``QUEUE_FIELDS``)."""
        lo = a.lo.values
        if lo[at] != a.hi.values[at]:
            # Ranks disagree on what is in flight: nothing on this queue can be applied safely.
            self._mismatch(self.layout.fields[at], report)
            self._close(f"{QUEUE_OF[kind]} queues differ across ranks", report)
            return
        done, clean = lo[at + 1], lo[at + 2]
        complete = self.core.complete
        for _ in range(min(done, clean)):
            report.completed.append(complete(kind))
        if clean < done and clean == 0:
            # The head op fell short on some rank: keep only the pages every rank got through.
            report.completed.append(complete(kind, lo[at + 3]))

    def _apply_plan(self, a: Agreement, report: RoundReport) -> None:
        plan, self.pending_plan = self.pending_plan, None
        if a.disagreeing(("plan_count", "plan_tokens", "plan_digest")):
            # Counted the same way on every rank (one counter, whatever each rank prepared), so
            # every rank switches the plan features off in the same round.
            report.plan_skipped = plan.feature if plan else "plan"
            self._mismatch("plan", report)
            self.plan_mismatches += 1
            limit = self.core.config.plan_mismatch_limit
            if self.plan_mismatches >= limit and self.features and not self.disabled:
                self.disabled.update(f.name for f in self.features)
                log.error(
                    "plans (%s) switched off after %d mismatches in a row; falling back to conservative behaviour",
                    ", ".join(sorted(self.disabled)),
                    self.plan_mismatches,
                )
            return
        if plan is None or self.core.closed:
            return
        self.plan_mismatches = 0
        feature = next(f for f in self.features if f.name == plan.feature)
        feature.execute(plan)
        report.plan_executed = plan.feature

    def _prepare_plan(self, a: Agreement) -> Plan | None:
        for feature in self.features:
            if feature.name in self.disabled:
                continue
            plan = feature.prepare(a)
            if plan is not None:
                return plan
        return None

    def _flush(self, a: Agreement, report: RoundReport) -> None:
        """Reset every rank alike: ids continue from their maximum over ranks (a stale id never
        names a new lease or op anywhere), and the plans start over."""
        self.core.reset(next_op=a.hi["next_op"], next_lease=a.hi["next_lease"])
        self.rebind(self.core)
        self.pending_plan = None
        self.plan_mismatches = 0
        self.disabled.clear()
        report.flushed = True
        log.warning("round %d: agreed flush: every rank reset; cache open", report.round)
