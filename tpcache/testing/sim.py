"""A seeded simulation of a whole TP group in one process (in the spirit of TigerBeetle's VOPR).

N ranks each run the production ``Driver`` (core, round, Ready/Advance, fail-closed paths) with two
things replaced: the I/O (``FakeIO``: copies finish after seeded delays, in any order, sometimes
short, and it records what each device page, host slot and storage key physically holds) and the
exchange of round vectors (the simulated group, or for some seeds a real shared-memory segment
driven split-phase). Every rank applies the same client operations in the same order, as rank 0's
sequencing gives. Hybrid schedules (``hybrid="swa" | "mamba" | "both"``) add a sliding-window and/or
a Mamba component with their own small pools, so tombstones, window-only stamps, out-of-window
release and component loads, backups, write-outs and prefetches all happen under every fault.
Buffer schedules (``buffer=True``) run host as staging only (``host_mode="buffer"``) with an engine
admitting requests in phases (``admissions.py``), and add their own faults: one rank's storage
reads failing, one rank's storage losing data, one rank's copies running slow.
Faults: a divergence in one rank's state or vector (in every field the digests and queues must
catch, component data included), a rank's plan diverging, a rank dying, a rank's I/O turning
unhealthy, a rank failing to prepare or to commit. After every round the checker asserts:

- a rank closes only because of an injected fault or a flush, and a closing fault closes every
  rank within one round; nothing opens again until an agreed flush, after which all are equal;
- while open, every rank has the same state (compared field by field, not only by digest) and
  gives the same answers; the retention cap holds after every commit;
- every rank's core passes ``invariants.check`` (no leak, no double free, pins accounted);
- every page a match reports as a hit really holds that page's data on every rank, and so does
  every SWA page and state the hit reads (for a hybrid model);
- a queue whose digest disagrees applies no completion;
- in buffer mode: no match reports a host page, no hit is counted but by a commit, every committed
  hit's pages hold their data on every rank, and no staging slot outlives its agreed copy.

Reproduce a failing seed: ``python -m tpcache.testing.sim --seed S --ranks N``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from protocol.round_vector import HEALTH_IO_ERROR, HEALTH_STORAGE_DOWN
from tpcache.comm.collective import CollectiveError, CollectiveTimeout, to_int64_array
from tpcache.comm.sim import SimGroup
from tpcache.core import (
    Admitted,
    CacheClosed,
    CacheConfig,
    CacheCore,
    Lease,
    MatchResult,
    OpKind,
    Transfer,
    UnknownLease,
    check,
)
from tpcache.core.hashing import as_token_bytes
from tpcache.core.round import QUEUE_OF
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.treecore.components import DEV, DSLOT, HOST, HSLOT, STORE
from tpcache.core.treecore.feed import ChangeFeed, apply_changes, on_tiers
from tpcache.engine.driver import Driver, Operations
from tpcache.engine.sequenced import Op, register
from tpcache.testing.admissions import admission_step, buffer_config, buffer_violations
from tpcache.testing.ops import apply, evict, random_op, tokens_for

GARBAGE = -1  # what a slot holds after a failed or torn copy
DIVERGENCES = ("clock", "stamp", "hits", "device_page", "host_slot", "storage", "lease", "queue", "state_vector")
# in a component's data of one node (a configuration without components diverges in its clock instead)
PART_DIVERGENCES = ("part_slot", "part_host_slot", "part_stamp", "part_storage")
# in what decides what happens next outside the nodes: the retention cap, which device pages a lease
# holds, a lease's admission or prefetch state, the order of the backup backlog (asked for by tests;
# seeded schedules draw from the kinds above)
NEXT_DIVERGENCES = ("retention_cap", "lease_pages", "lease_state", "backlog")
HYBRIDS = ("swa", "mamba", "both")

# The simulator's own sequenced op: forget up to n pages on device (and on host) on every rank.
FORGET = "sim.forget"
register(FORGET, lambda driver, n, host: evict(driver.core, n, host))


class SimFailure(AssertionError):
    pass


@dataclass
class Faults:
    max_delay: int = 3  # rounds a copy may take on a rank
    partial_ack: float = 0.05  # probability a copy stops short on a rank
    diverge_at: int | None = None  # round at which one rank diverges ...
    diverge: str = "clock"  # ... in this field (one of DIVERGENCES)
    plan_diverge_at: int | None = None  # round from which one rank's plans always diverge
    kill_at: int | None = None  # round at which one rank dies
    unhealthy_at: int | None = None  # round at which one rank's I/O reports itself unhealthy
    unhealthy_everywhere: bool = False  # ... every rank's I/O at once (the same health bits on all)
    prepare_fail_at: int | None = None  # round at which one rank cannot prepare its vector
    commit_fail_at: int | None = None  # round at which one rank's commit raises
    shm: bool = False  # exchange vectors through a real shared-memory segment
    read_fail: float = 0.0  # probability one rank's storage lookup or read returns nothing
    lose_at: int | None = None  # round at which one rank's storage loses half its pages
    storage_down_at: int | None = None  # round at which one rank's storage goes away (unusable)
    slow: int = 0  # extra rounds each copy takes on one rank

    def closes_at(self, now: int) -> bool:
        """Whether a fault that must close the cache happens in round ``now``."""
        return now in (self.diverge_at, self.kill_at, self.unhealthy_at, self.prepare_fail_at, self.commit_fail_at)


class FakeIO:
    """One rank's I/O (``driver.IO``): copies finish after a seeded delay, possibly out of order or
    short. ``device``/``host``/``storage`` map a page/slot/page hash to the page hash it physically
    holds, so the checker can tell a real hit from a page whose copy has not landed here."""

    def __init__(self, rng: random.Random, faults: Faults) -> None:
        self.rng = rng
        self.faults = faults
        self.now = 0
        self.results: dict[int, int] = {}  # op id -> pages that landed (once finished)
        self.due: dict[int, tuple[int, Transfer]] = {}  # op id -> (round it finishes, op)
        self.device: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self.storage: dict[int | tuple[int, int], int] = {}  # page hash, or (component, page hash)
        self.part_device: dict[int, dict[int, int]] = {}  # component -> slot -> page hash it holds
        self.part_host: dict[int, dict[int, int]] = {}
        self.unhealthy = False
        self.fail_landed = False
        self.window_parts: dict[int, bool] = {}  # component -> is it sliding-window data
        self.victim = False  # the rank the per-rank faults (read_fail, slow) hit
        self.storage_gone = False  # the storage is unusable: it says so, holds nothing, stores nothing

    def start(self, ops: Sequence[Transfer]) -> None:
        for op in ops:
            slow = self.faults.slow if self.victim else 0
            self.due[op.op_id] = (self.now + self.rng.randint(0, self.faults.max_delay) + slow, op)

    def landed(self) -> Mapping[int, int]:
        if self.fail_landed:
            self.fail_landed = False
            raise RuntimeError("simulated: this rank lost its completion records")
        return self.results

    def retire(self, ops: Sequence[Transfer]) -> None:
        for op in ops:
            self.results.pop(op.op_id, None)

    def health(self) -> int:
        return (HEALTH_IO_ERROR if self.unhealthy else 0) | (HEALTH_STORAGE_DOWN if self.storage_gone else 0)

    def drained(self) -> bool:
        return not self.due

    def reset(self) -> None:
        self.results.clear()
        self.unhealthy = False

    def write_device(self, page: int, page_hash: int) -> None:
        """The engine wrote a page's KV (what insert adopts)."""
        self.device[page] = page_hash

    def write_part(self, part: int, slot: int, page_hash: int) -> None:
        """The engine wrote a component's data of a page (an SWA page, a state) into its slot."""
        self.part_device.setdefault(part, {})[slot] = page_hash

    def _present(self, op: Transfer) -> int:
        """Leading nodes of a storage lookup or read whose every key this rank's storage holds."""
        if op.kind == OpKind.STORAGE_QUERY and op.query is not None:
            plan, hashes = op.query, op.page_hashes
            full = next((i for i, h in enumerate(hashes) if h not in self.storage), len(hashes))
            window = next((c for c, is_window in self.window_parts.items() if is_window), 0)
            state = next((c for c, is_window in self.window_parts.items() if not is_window), 0)
            swa = [(window, h) in self.storage for h in hashes]
            states = [kept and (state, h) in self.storage for h, kept in zip(hashes, plan.state_pages, strict=False)]
            return plan.answer(full, swa, states + [False] * (len(hashes) - len(states)))
        need: list[list[int | tuple[int, int]]] = [[] for _ in op.page_hashes]
        for i, _ in op.full_moves() if op.kind == OpKind.STORAGE_READ else enumerate(op.page_hashes):
            need[i].append(op.page_hashes[i])
        for pc in op.parts:
            for i in pc.index:
                need[i].append((pc.part, op.page_hashes[i]))
        return next((i for i, keys in enumerate(need) if any(k not in self.storage for k in keys)), len(need))

    def tick(self, now: int) -> None:
        """Finish due copies, in random order: completion order is not issue order."""
        self.now = now
        ready = [op_id for op_id, (t, _) in self.due.items() if t <= now]
        self.rng.shuffle(ready)
        for op_id in ready:
            _, op = self.due.pop(op_id)
            landed = op.num_pages
            if self.rng.random() < self.faults.partial_ack:
                landed = self.rng.randrange(op.num_pages)
            if op.kind in (OpKind.STORAGE_QUERY, OpKind.STORAGE_READ):
                landed = min(landed, self._present(op))  # storage answers for what this rank holds
                if self.victim and self.faults.read_fail and self.rng.random() < self.faults.read_fail:
                    landed = 0
            if self.storage_gone and op.kind in (OpKind.STORAGE_QUERY, OpKind.STORAGE_READ, OpKind.STORAGE_WRITE):
                landed = 0
            for k, (i, _) in enumerate(op.full_moves()):
                self._copy(
                    op.kind, i < landed, self.device, self.host, op.device_pages[k], op.host_slots[k], op.page_hashes[i]
                )
            for pc in op.parts:
                dev, host = self.part_device.setdefault(pc.part, {}), self.part_host.setdefault(pc.part, {})
                for k, i in enumerate(pc.index):
                    key = (pc.part, op.page_hashes[i])
                    self._copy(op.kind, i < landed, dev, host, pc.device[k], pc.host[k], key)
            self.results[op_id] = landed

    def _copy(
        self, kind: OpKind, ok: bool, dev: dict[int, int], host: dict[int, int], d: int, h: int, key: int | tuple
    ) -> None:
        """One page's (or component slot's) copy: its bytes land, or the target holds garbage."""
        if kind == OpKind.BACKUP:
            host[h] = dev.get(d, GARBAGE) if ok else GARBAGE
        elif kind == OpKind.LOAD:
            dev[d] = host.get(h, GARBAGE) if ok else GARBAGE
        elif kind == OpKind.STORAGE_WRITE and ok:
            self.storage[key] = host.get(h, GARBAGE)
        elif kind == OpKind.STORAGE_READ:
            host[h] = self.storage[key] if ok else GARBAGE


class SimRank(Operations):
    """One simulated rank: the production driver over a fake I/O."""

    def __init__(self, rank: int, config: CacheConfig, io: FakeIO) -> None:
        self.rank = rank
        self.io = io
        io.window_parts = {spec.index: spec.is_window for spec in config.components()}
        self.driver = Driver(CacheCore(config), io, rank=rank)
        # The change feed, drained after every round into a mirror that must equal the tree's tiers.
        self.driver.core.ledger.feed = ChangeFeed()
        self.mirror: tuple[set[int], set[int], set[int]] = (set(), set(), set())
        self.leases: list[tuple[int, list[int]]] = []
        self.waiting: dict[int, list[int]] = {}  # admissions in phases: lease id -> tokens
        self._committed = (self.core.stats, 0)  # (the core's counters, storage tokens committed into them)
        self.alive = True

    @property
    def committed_storage_tokens(self) -> int:
        """Storage-hit tokens the commits this rank's current counters saw delivered (a flush resets both)."""
        stats, tokens = self._committed
        return tokens if stats is self.core.stats else 0

    def on_commit(self, lease_id: int, tokens: list[int], admitted: Admitted) -> None:
        """What the engine is told at commit: every hit page must hold its own data on this rank."""
        hashes = self.core.tree.walk(as_token_bytes(tokens)).hashes
        for page, page_hash in zip(admitted.device_page_ids, hashes, strict=False):
            if self.io.device.get(page) != page_hash:
                raise SimFailure(f"rank {self.rank} committed a hit on device page {page} without its data")
        self._committed = (self.core.stats, self.committed_storage_tokens + admitted.storage_tokens)


class SimCluster:
    def __init__(self, seed: int, ranks: int, config: CacheConfig, faults: Faults) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.config = config
        self.faults = faults
        self.group = SimGroup(ranks)
        self.shm = None
        if faults.shm:
            from tpcache.comm.shm import ShmCollective

            self.shm = ShmCollective.local_group(ranks)
        self.ranks = [SimRank(r, config, FakeIO(random.Random(seed * 1000 + r), faults)) for r in range(ranks)]
        self.ranks[-1].io.victim = True
        self.buffer = config.host_mode == "buffer"
        self.calls = [0] * ranks  # collectives issued by each rank
        self.now = 0
        self.after_commit = False  # the retention cap is checked only right after a commit
        self.excused = False  # a closing fault or a flush happened and the cache has not reopened since
        self.alphabet = 4  # distinct token values per page position: fewer, more shared prefixes
        self.requests = 0.0  # share of whole requests among the random ops
        self.log: list[str] = []
        self.lost: set[int | tuple[int, int]] = set()  # storage keys a fault took (durable marks go stale)

    @property
    def live(self) -> list[SimRank]:
        return [r for r in self.ranks if r.alive]

    @property
    def victim(self) -> SimRank:
        return self.ranks[-1]

    def close(self) -> None:
        for c in self.shm or ():
            c.close()

    def apply_ops(self, ops: Sequence[tuple]) -> None:
        """Sequenced client ops: every live rank applies the same ops in the same order."""
        self.after_commit = False
        for op in ops:
            outcomes: dict[int, list[tuple]] = {}
            self.excused = self.excused or op[0] == "flush"
            for rank in self.live:
                if op[0] == "flush":  # as an engine does: abort every request, then flush
                    for lease_id, _ in rank.leases:
                        with contextlib.suppress(UnknownLease):
                            rank.release(lease_id)
                    rank.leases.clear()
                    for lease_id in list(rank.waiting):
                        with contextlib.suppress(UnknownLease):
                            rank.release(lease_id)
                    rank.waiting.clear()
                    rank.request_flush()
                elif op[0] in ("evict", "demote"):  # test-only sequenced ops: forget pages on every rank
                    rank.driver.apply(Op(FORGET, (op[1], op[0] == "evict")))
                elif op[0] == "admit":
                    tokens = tokens_for(op[1], self.config.page_size, op[2])
                    with contextlib.suppress(CacheClosed):
                        rank.waiting[rank.admit(tokens)[0]] = tokens
                elif op[0] == "admissions":  # the engine's scheduler step
                    outcomes[rank.rank] = admission_step(rank, rank.waiting, rank.io.write_device, rank.on_commit)
                else:
                    apply(rank, op, rank.leases, rank.io.write_device, rank.io.write_part)
            open_outcomes = {repr(v) for r, v in outcomes.items() if not self.ranks[r].core.closed}
            if len(open_outcomes) > 1:
                raise SimFailure(f"round {self.now}: open ranks admitted differently: {outcomes}")

    def round(self) -> None:
        self.now += 1
        self.excused = self.excused or self.faults.closes_at(self.now)
        for rank in self.live:
            rank.io.tick(self.now)
        self._inject_state()
        vectors = {r.rank: r.driver.begin() for r in self.live}
        queue_guard = self._inject_vector(vectors)
        for rank in self.live:
            self.calls[rank.rank] += 1
        results = self._exchange(vectors)
        victim = self.victim.rank
        if self.faults.commit_fail_at == self.now and self.victim.alive and isinstance(results[victim], array):
            self.log.append(f"round {self.now}: rank {victim} receives a torn vector and its commit fails")
            results[victim] = results[victim][:-2]  # type: ignore[index]
        for rank in self.live:
            rank.driver.end(results[rank.rank])
        if queue_guard is not None:
            kind, heads = queue_guard
            for rank, ids in zip(self.live, heads, strict=True):
                left = {op.op_id for op in rank.core.inflight[kind]}
                if not set(ids) <= left:
                    raise SimFailure(f"round {self.now}: {kind.name} applied completions despite differing digests")
        self.after_commit = True

    def _exchange(self, vectors: dict[int, array]) -> dict[int, array | CollectiveError]:
        if self.shm is None:
            full = [vectors.get(r) for r in range(len(self.ranks))]
            try:
                reduced: array | CollectiveError = self.group.reduce(full)
            except CollectiveError as exc:
                reduced = exc
            return {r: reduced for r in vectors}
        for r, vector in vectors.items():
            if not self.shm[r].closed:
                self.shm[r].publish(to_int64_array(vector))
        out: dict[int, array | CollectiveError] = {}
        for r, vector in vectors.items():
            try:
                if self.shm[r].closed:
                    raise CollectiveTimeout(f"shm collective of rank {r} is broken", [])
                out[r] = self.shm[r].collect(to_int64_array(vector), 5.0)
            except CollectiveError as exc:
                self.shm[r]._break(str(exc))
                out[r] = exc
        return out

    # ------------------------------------------------------------------ faults

    def _inject_state(self) -> None:
        f, victim, now = self.faults, self.victim, self.now
        if not victim.alive:
            return
        if f.diverge_at == now and f.diverge not in ("queue", "state_vector"):
            done = diverge(victim.core, f.diverge, self.rng)
            self.log.append(f"round {now}: rank {victim.rank} diverges in {done}")
        plan = victim.driver.round.pending_plan
        if f.plan_diverge_at is not None and f.plan_diverge_at <= now and plan:
            self.log.append(f"round {now}: rank {victim.rank} prepares a different plan")
            plan.digest ^= 1
        if f.unhealthy_at == now:
            for rank in self.live if f.unhealthy_everywhere else [victim]:
                self.log.append(f"round {now}: rank {rank.rank}'s I/O reports unhealthy")
                rank.io.unhealthy = True
        if f.prepare_fail_at == now:
            self.log.append(f"round {now}: rank {victim.rank} cannot prepare")
            victim.io.fail_landed = True
        if f.lose_at == now and victim.io.storage:
            lost = sorted(victim.io.storage, key=repr)[::2]
            self.log.append(f"round {now}: rank {victim.rank}'s storage loses {len(lost)} pages")
            for key in lost:
                del victim.io.storage[key]
            self.lost.update(lost)
        if f.storage_down_at == now:
            self.log.append(f"round {now}: rank {victim.rank}'s storage goes away")
            victim.io.storage.clear()
            victim.io.storage_gone = True
        if f.kill_at == now:
            self.log.append(f"round {now}: rank {victim.rank} dies")
            victim.alive = False
            self.group.kill(victim.rank)
            if self.shm is not None:
                self.shm[victim.rank].close()

    def _inject_vector(self, vectors: dict[int, array]) -> tuple[OpKind, list[list[int]]] | None:
        """A divergence in the vector itself. For a queue: returns the queue and each rank's op ids
        in flight on it, which must all still be in flight after the commit (nothing applied)."""
        f, victim = self.faults, self.victim
        if f.diverge_at != self.now or f.diverge not in ("queue", "state_vector") or not victim.alive:
            return None
        layout = victim.driver.round.layout
        if f.diverge == "state_vector":
            name = "state_digest"
            guard = None
        else:
            kinds = [k for k in OpKind if victim.core.inflight[k]]
            if not kinds:
                name, guard = "state_digest", None
            else:
                kind = self.rng.choice(kinds)
                name = f"{QUEUE_OF[kind]}.queue_digest"
                guard = (kind, [[op.op_id for op in r.core.inflight[kind]] for r in self.live])
        i = layout.index(name)
        vector = vectors[victim.rank]
        vector[2 * i] += 1
        vector[2 * i + 1] -= 1
        self.log.append(f"round {self.now}: rank {victim.rank} sends a different {name}")
        return guard

    # ------------------------------------------------------------------ the checker

    def check(self, probes: Sequence[list[int]]) -> None:
        live = self.live
        now = self.now
        for rank in live:
            check(rank.core)
            feed = rank.core.ledger.feed  # (None: a test swapped the rank's core for one of its own)
            if feed is not None:
                apply_changes(rank.mirror, feed.drain())
            # A state divergence is injected into the victim's nodes behind the ledger's back.
            if feed is not None and rank is not self.victim and rank.mirror != on_tiers(rank.core.tree.nodes.values()):
                raise SimFailure(f"round {now}: rank {rank.rank}'s change feed disagrees with its tree")
        closed = [r.core.closed for r in live]
        if any(closed) and not all(closed) and now != self.faults.commit_fail_at:
            raise SimFailure(f"round {now}: some ranks closed, some open: {closed}")
        if any(closed) and not self.excused:
            reasons = sorted({r.core.closed_reason or "" for r in live})
            raise SimFailure(f"round {now}: the cache closed with no fault injected: {reasons}")
        if not any(closed):
            self.excused = False
            states = [snapshot(r.core) for r in live]
            for r, state in enumerate(states[1:], 1):
                if state != states[0]:
                    field_ = next(k for k in state if state[k] != states[0][k])
                    raise SimFailure(f"round {now}: open ranks 0 and {r} differ in {field_}")
            if len({r.driver.round.state_digest() for r in live}) != 1:
                raise SimFailure(f"round {now}: open ranks with equal state and different digests")
        for rank in live:
            cap = rank.core.retention_cap_tokens
            if not rank.core.closed and 0 <= cap < rank.core.evictable_device_tokens and self.after_commit:
                raise SimFailure(f"round {now}: {rank.core.evictable_device_tokens} evictable tokens, cap {cap}")
            if self.buffer:
                for problem in buffer_violations(rank.core, rank.committed_storage_tokens, self.after_commit):
                    raise SimFailure(f"round {now}: rank {rank.rank}: {problem}")
        for tokens in probes:
            answers = []
            for rank in live:
                m = rank.match(tokens)
                if self.buffer and m.host_pages:
                    raise SimFailure(f"round {now}: rank {rank.rank} reports {m.host_pages} host pages in buffer mode")
                answers.append((m.device_pages, m.host_pages, m.device_page_ids))
                hit = [rank.core.tree.nodes[i] for i in m.nodes]
                for node in hit[: m.device_pages]:
                    if rank.io.device.get(node.device_page) != node.hash:
                        raise SimFailure(
                            f"round {now}: rank {rank.rank} hit device page {node.device_page} "
                            f"that does not hold page {node.hash:x}"
                        )
                for node in hit[m.device_pages :]:
                    on_device = node.device_state == DeviceState.VALID  # with components: a longer full run
                    held = rank.io.device.get(node.device_page) if on_device else rank.io.host.get(node.host_slot)
                    if held != node.hash:
                        raise SimFailure(
                            f"round {now}: rank {rank.rank} hit host slot {node.host_slot} "
                            f"that does not hold page {node.hash:x}"
                        )
                for node in hit:
                    durable = node.storage_state == StorageState.DURABLE and node.hash not in self.lost
                    if durable and rank.io.storage.get(node.hash) != node.hash:
                        raise SimFailure(f"round {now}: rank {rank.rank} marks page {node.hash:x} durable, not stored")
                self._check_parts(rank, m)
                answers[-1] += (sorted((c, list(ns)) for c, ns in m.parts.items()),)
            if len({repr(a) for a, r in zip(answers, live, strict=True) if not r.core.closed}) > 1:
                raise SimFailure(f"round {now}: ranks answer a match differently: {answers}")

    def _check_parts(self, rank: SimRank, m: MatchResult) -> None:
        """Every SWA page and state a hit reads holds that page's data on the tier the hit reads it
        from; every component copy marked durable is stored."""
        io, now = rank.io, self.now
        for c, nodes in m.parts.items():
            b = rank.core.ledger.parts[c].base
            for node_id in nodes:
                node = rank.core.tree.nodes[node_id]
                rec = node.comp
                assert rec is not None
                device = rec[b + DEV] == DeviceState.VALID
                if not device and rec[b + HOST] != HostState.VALID:
                    raise SimFailure(f"round {now}: rank {rank.rank}'s hit reads component {c} of a node without it")
                if not device and not m.host_pages:
                    raise SimFailure(
                        f"round {now}: rank {rank.rank} serves a device hit whose component {c} is on host"
                    )
                held = (
                    io.part_device.get(c, {}).get(rec[b + DSLOT])
                    if device
                    else io.part_host.get(c, {}).get(rec[b + HSLOT])
                )
                if held != node.hash:
                    tier = "device" if device else "host"
                    raise SimFailure(
                        f"round {now}: rank {rank.rank} hit component {c} of page {node.hash:x} on {tier}, "
                        f"whose slot holds {held}"
                    )
                if rec[b + STORE] == StorageState.DURABLE and io.storage.get((c, node.hash)) != node.hash:
                    raise SimFailure(f"round {now}: rank {rank.rank} marks component {c} of {node.hash:x} durable")

    def states(self) -> list[tuple[int, str | None]]:
        return [(r.core.digest.value, r.core.closed_reason) for r in self.live]


def snapshot(core: CacheCore) -> dict[str, object]:
    """Everything that decides what a rank does next, field by field (independent of the digest)."""
    nodes = [
        (n.node_id, n.hash, n.device_state, n.device_page, n.host_state, n.host_slot, n.storage_state)
        + (n.device_pins, n.host_pins, n.last_access, n.hits, n.created_at, n.parent.node_id if n.parent else -1)
        + (tuple(n.comp or ()),)
        for n in core.tree.nodes.values()
    ]
    leases = [
        (lid, list(x.device_nodes), list(x.host_nodes), x.pages, x.ops, x.releasing)
        + (None if x.prefetch is None else tuple(x.prefetch.fields()), x.hit_pages, x.cursor)
        + tuple((c, list(h.device_nodes), list(h.host_nodes), h.pages) for c, h in x.parts.items())
        for lid, x in core.leases.items()
    ]
    return {
        "nodes": nodes,
        "leases": leases,
        "clock": core.clock,
        "next_op": core.outbox.next_op,
        "next_lease": core.book.next_lease,
        "inflight": [[op.op_id for op in q] for q in core.inflight.values()],
        "backlog": list(core.backup_backlog),
        "retention_cap": core.retention_cap_tokens,
        "flush_requested": core.flush_requested,
        "part_backlogs": [(list(p.backlog), list(p.behind)) for p in core.ledger.parts.values()],
    }


def diverge(core: CacheCore, what: str, rng: random.Random) -> str:
    """Make one rank's state differ in ``what``, through the ledger (the rank stays internally
    consistent: only a comparison with the other ranks can tell). Returns what was changed."""
    led = core.ledger
    nodes = [n for n in core.tree.nodes.values() if n.parent is not None]
    on_device = [n for n in nodes if n.device_state == DeviceState.VALID]
    on_host = [n for n in nodes if n.host_state == HostState.VALID]
    if what == "stamp" and nodes:
        led.tick()
        led.update(rng.choice(nodes), stamp=True)
        return "stamp (and clock)"
    if what == "hits" and nodes:
        led.update(rng.choice(nodes), hit=True)
        return "hits"
    if what == "device_page" and len(on_device) >= 2:
        a, b = rng.sample(on_device, 2)
        pa, pb = a.device_page, b.device_page
        for n in (a, b):
            led.update(n, device=(DeviceState.NONE, -1))
        led.update(a, device=(DeviceState.VALID, pb))
        led.update(b, device=(DeviceState.VALID, pa))
        return "device_page"
    if what == "host_slot" and len(on_host) >= 2:
        a, b = rng.sample(on_host, 2)
        sa, sb = a.host_slot, b.host_slot
        for n in (a, b):
            led.update(n, host=(HostState.NONE, -1))
        for n, slot in ((a, sb), (b, sa)):
            led.update(n, host=(HostState.WRITING, slot))
            led.update(n, host=(HostState.VALID, slot))
        return "host_slot"
    settled = [n for n in on_host if n.storage_state != StorageState.WRITING]
    if what == "storage" and settled:
        node = rng.choice(settled)
        durable = node.storage_state == StorageState.DURABLE
        led.update(node, storage=StorageState.NONE if durable else StorageState.DURABLE)
        return "storage"
    if what.startswith("part_") and led.parts:
        return _diverge_part(core, what, rng)
    idle = [x for x in core.leases.values() if not x.ops and not x.releasing]
    if what == "lease" and idle:
        core.book.release(rng.choice(idle))  # released here only, behind the sequencer's back
        return "lease"
    done = _diverge_next(core, what, idle, rng) if what in NEXT_DIVERGENCES else None
    if done:
        return done
    led.tick()
    return "clock"


def _diverge_next(core: CacheCore, what: str, idle: list[Lease], rng: random.Random) -> str | None:
    """A divergence outside the nodes that changes no page now, only what comes next."""
    if what == "retention_cap":  # as generous as before: nothing is evicted by it now
        cap = core.retention_cap_tokens
        core.evictor.retention_cap_tokens = -1 if cap >= 0 else 1 << 40
        return what
    holding = [x for x in idle if x.pages]
    fresh = core.device.try_alloc(1) if what == "lease_pages" and holding else None
    if fresh:  # the lease holds another free device page than on the other ranks
        lease = rng.choice(holding)
        old = lease.pages[-1]
        lease.pages.remove(old)
        lease.pages.append(fresh[0])
        core.device.free([old])
        core.book.refresh(lease)
        return what
    phased = [x for x in idle if x.admission is not None or x.prefetch is not None]
    if what == "lease_state" and phased:
        lease = rng.choice(phased)
        state = lease.admission if lease.admission is not None else lease.prefetch
        state.deferrals += 1  # type: ignore[union-attr]
        core.book.refresh(lease)
        return what
    backlog = core.ledger.backup_backlog
    if what == "backlog" and len(backlog) >= 2:  # the same pages wait, another goes first
        first = next(iter(backlog))
        backlog[first] = backlog.pop(first)
        return what
    return None


def _diverge_part(core: CacheCore, what: str, rng: random.Random) -> str:
    """A divergence in one node's component data, through the ledger."""
    led = core.ledger
    part = rng.choice(list(led.parts.values()))
    b, c = part.base, part.index
    nodes = [n for n in core.tree.nodes.values() if n.comp is not None and n.parent is not None]
    on_device = [n for n in nodes if n.comp[b + DEV] == DeviceState.VALID]  # type: ignore[index]
    on_host = [n for n in nodes if n.comp[b + HOST] == HostState.VALID]  # type: ignore[index]
    if what == "part_slot" and len(on_device) >= 2:
        x, y = rng.sample(on_device, 2)
        sx, sy = x.comp[b + DSLOT], y.comp[b + DSLOT]  # type: ignore[index]
        for n in (x, y):
            led.update(n, part=c, device=(DeviceState.NONE, -1))
        led.update(x, part=c, device=(DeviceState.VALID, sy))
        led.update(y, part=c, device=(DeviceState.VALID, sx))
        return "part_slot"
    if what == "part_host_slot" and len(on_host) >= 2:
        x, y = rng.sample(on_host, 2)
        sx, sy = x.comp[b + HSLOT], y.comp[b + HSLOT]  # type: ignore[index]
        for n in (x, y):
            led.update(n, part=c, host=(HostState.NONE, -1))
        for n, slot in ((x, sy), (y, sx)):
            led.update(n, part=c, host=(HostState.WRITING, slot))
            led.update(n, part=c, host=(HostState.VALID, slot))
        return "part_host_slot"
    if what == "part_stamp" and nodes:
        led.tick()
        led.update(rng.choice(nodes), part=c, stamp=True)
        return "part_stamp (and clock)"
    settled = [n for n in on_host if n.comp[b + STORE] != StorageState.WRITING]  # type: ignore[index]
    if what == "part_storage" and settled:
        node = rng.choice(settled)
        durable = node.comp[b + STORE] == StorageState.DURABLE  # type: ignore[index]
        led.update(node, part=c, storage=StorageState.NONE if durable else StorageState.DURABLE)
        return "part_storage"
    led.tick()
    return "clock"


def run_schedule(
    seed: int, ranks: int, rounds: int = 30, ops_per_round: int = 3, hybrid: str | None = None, buffer: bool = False
) -> SimCluster:
    """One seeded schedule: random config, ops, delays and (for some seeds) one fault; ``buffer``:
    host as staging only, requests admitted in phases, and the storage faults of that mode."""
    rng = random.Random(seed)
    page = rng.choice([2, 4])
    config = CacheConfig(
        page_size=page,
        device_pages=rng.randint(4, 24),
        host_pages=rng.choice([0, 6, 24]),
        write_policy=rng.choice(["none", "write_through", "write_through_selective", "write_back"]),
        eviction_policy=rng.choice(["lru", "lru", "lfu", "fifo"]),
        retention_cap_tokens=rng.choice([-1, -1, 0, 4 * page]),
        storage=rng.random() < 0.5,
    )
    fault = rng.random()
    if 0.15 <= fault < 0.25:
        # Plans need host pressure: a host pool smaller than the device pool, backed by storage.
        config = replace(
            config, host_pages=4, device_pages=max(config.device_pages, 12), write_policy="write_through", storage=True
        )
    faults = Faults(
        max_delay=rng.randint(0, 3),
        partial_ack=rng.choice([0.0, 0.05, 0.2]),
        diverge_at=rng.randint(3, rounds - 8) if fault < 0.15 else None,
        diverge=rng.choice(DIVERGENCES),
        plan_diverge_at=rng.randint(2, rounds - 6) if 0.15 <= fault < 0.25 else None,
        kill_at=rng.randint(3, rounds - 3) if 0.25 <= fault < 0.3 else None,
        unhealthy_at=rng.randint(3, rounds - 8) if 0.3 <= fault < 0.34 else None,
        prepare_fail_at=rng.randint(3, rounds - 8) if 0.34 <= fault < 0.38 else None,
        commit_fail_at=rng.randint(3, rounds - 8) if 0.38 <= fault < 0.42 else None,
        shm=rng.random() < 0.25,
    )
    alphabet = 4
    if hybrid is not None:
        config, faults, alphabet = _hybrid(seed, hybrid, config, faults)
    if buffer:
        config = buffer_config(seed, config)
        extra = random.Random(seed * 6151 + 6)
        faults = replace(
            faults,
            read_fail=extra.choice([0.0, 0.1, 0.3]),
            lose_at=extra.randint(3, rounds - 3) if extra.random() < 0.3 else None,
            slow=extra.choice([0, 0, 2, 5]),
            storage_down_at=extra.randint(3, rounds - 3) if extra.random() < 0.2 else None,
        )
        alphabet = 3
    sim = SimCluster(seed, ranks, config, faults)
    sim.alphabet = alphabet
    sim.requests = 0.4 if hybrid is not None else 0.0
    try:
        _run(sim, rng, rounds, ops_per_round)
    finally:
        sim.close()
    return sim


def _hybrid(seed: int, kind: str, config: CacheConfig, faults: Faults) -> tuple[CacheConfig, Faults, int]:
    """The components of a hybrid schedule, drawn from their own stream (the rest of the schedule
    is the same seed's): small pools, so that component data is evicted, tombstoned and reloaded,
    and requests that share more of their prefixes, so that hits load component data back."""
    if kind not in HYBRIDS:
        raise ValueError(f"hybrid must be one of {HYBRIDS}, got {kind!r}")
    rng = random.Random(seed * 7919 + 17)
    page = config.page_size
    extra: dict[str, object] = {"retention_cap_tokens": rng.choice([-1, -1, -1, 0, 2 * page])}
    if faults.plan_diverge_at is None:  # (a plan fault keeps its host pressure: a small host pool)
        extra["device_pages"] = min(config.device_pages, rng.randint(5, 12))
        if config.host_pages and rng.random() < 0.6:
            extra.update(host_pages=24, write_policy="write_through")
    if kind in ("swa", "both"):
        extra.update(
            swa_window=rng.choice([1, page, 2 * page + 1, 3 * page]),
            swa_device_pages=rng.randint(3, 16),
            swa_host_pages=rng.choice([0, 4, 16]),
            swa_release_out_of_window=rng.random() < 0.7,
        )
    if kind in ("mamba", "both"):
        extra.update(mamba_every=rng.choice([1, 2, -1]), mamba_device_states=rng.randint(2, 8))
        extra.update(mamba_host_states=rng.choice([0, 4, 12]))
    if faults.diverge_at is not None:
        faults = replace(faults, diverge=rng.choice(DIVERGENCES + PART_DIVERGENCES))
    return replace(config, **extra), faults, rng.choice([2, 2, 3])  # type: ignore[arg-type]


def _run(sim: SimCluster, rng: random.Random, rounds: int, ops_per_round: int) -> None:
    faults, page = sim.faults, sim.config.page_size
    for _ in range(rounds):
        ops = [
            random_op(rng, page, sim.alphabet, requests=sim.requests, appends=0.1)
            for _ in range(rng.randint(0, ops_per_round))
        ]
        if sim.buffer:  # requests admitted in phases, then the engine's scheduler step
            admits = [("admit", tuple(rng.randrange(sim.alphabet) for _ in range(rng.randint(1, 6))), 1)]
            ops += admits * rng.randint(0, 2) + [("admissions",)]
        if sim.live[0].core.closed and faults.kill_at is None and rng.random() < 0.3:
            ops.append(("flush",))
        sim.apply_ops(ops)
        was_closed = sim.live[0].core.closed
        sim.round()
        due = (faults.diverge_at, faults.unhealthy_at, faults.prepare_fail_at)
        if sim.now in due and not was_closed and not all(r.core.closed for r in sim.live):
            raise SimFailure(f"seed {sim.seed}: {'; '.join(sim.log)}: not every rank closed in that round")
        failed_commit = faults.commit_fail_at is not None and sim.now == faults.commit_fail_at + 1
        if failed_commit and not was_closed and not all(r.core.closed for r in sim.live):
            raise SimFailure(f"seed {sim.seed}: a failed commit did not close every rank in the next round")
        if faults.kill_at is not None and sim.now >= faults.kill_at:
            for rank in sim.live:
                if rank.driver.broken is None or "restarted" not in (rank.core.closed_reason or ""):
                    raise SimFailure(f"seed {sim.seed}: a dead rank did not close rank {rank.rank} for good")
        probes = [
            tokens_for(tuple(rng.randrange(sim.alphabet) for _ in range(rng.randint(1, 6))), page, 0) for _ in range(3)
        ]
        sim.check(probes)
    # Drain: no more ops; every copy lands, every lease ends; then everything must be accounted for.
    for rank in sim.live:
        for lease_id, _ in list(rank.leases):
            if lease_id in rank.core.leases:
                rank.release(lease_id)
        rank.leases.clear()
        for lease_id in list(rank.waiting):
            if lease_id in rank.core.leases:
                rank.release(lease_id)
        rank.waiting.clear()
    if faults.kill_at is not None:
        return
    for _ in range(300):  # write-back under a zero cap with a tiny host pool drains a page or so a round
        if all(r.io.drained() and not r.core.outbox.busy() for r in sim.live):
            break
        sim.round()
        sim.check([])
    for rank in sim.live:
        if rank.core.leases:
            raise SimFailure(f"seed {sim.seed}: leases left after drain: {sorted(rank.core.leases)}")
        if rank.core.outbox.busy() and not rank.core.closed:
            raise SimFailure(f"seed {sim.seed}: copies left in flight after drain")
        if sim.buffer and rank.core.host.used and not rank.core.closed:
            raise SimFailure(f"seed {sim.seed}: rank {rank.rank} holds {rank.core.host.used} staging slots after drain")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run one simulation schedule (reproduce a failing seed).")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--hybrid", choices=HYBRIDS, help="with sliding-window and/or Mamba components")
    ap.add_argument("--buffer", action="store_true", help="host as staging only, requests admitted in phases")
    args = ap.parse_args(argv)
    try:
        sim = run_schedule(args.seed, args.ranks, args.rounds, hybrid=args.hybrid, buffer=args.buffer)
    except AssertionError as exc:
        print(f"seed {args.seed} ranks {args.ranks}: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"seed {args.seed} ranks {args.ranks}: ok; {'; '.join(sim.log) or 'no faults'}; final {sim.states()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
