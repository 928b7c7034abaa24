"""A seeded simulation of a whole TP group in one process (in the spirit of TigerBeetle's VOPR).

N ranks each run the production ``Driver`` (core, round, Ready/Advance, fail-closed paths) with two
things replaced: the I/O (``FakeIO``: copies finish after seeded delays, in any order, sometimes
short, and it records what each device page, host slot and storage key physically holds) and the
exchange of round vectors (the simulated group, or for some seeds a real shared-memory segment
driven split-phase). Every rank applies the same client operations in the same order, as rank 0's
sequencing gives. Faults: a divergence in one rank's state or vector (in every field the digests
and queues must catch), a rank's plan diverging, a rank dying, a rank's I/O turning unhealthy, a
rank failing to prepare or to commit. After every round the checker asserts:

- a rank closes only because of an injected fault or a flush, and a closing fault closes every
  rank within one round; nothing opens again until an agreed flush, after which all are equal;
- while open, every rank has the same state (compared field by field, not only by digest) and
  gives the same answers; the retention cap holds after every commit;
- every rank's core passes ``invariants.check`` (no leak, no double free, pins accounted);
- every page a match reports as a hit really holds that page's data on every rank;
- a queue whose digest disagrees applies no completion.

Reproduce a failing seed: ``python -m tpcache.testing.sim --seed S --ranks N``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from protocol.round_vector import HEALTH_IO_ERROR
from tpcache.core import CacheConfig, CacheCore, OpKind, Transfer, UnknownLease, check
from tpcache.core.round import QUEUE_OF
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.dist.collective import CollectiveError, CollectiveTimeout, to_int64_array
from tpcache.dist.sim import SimGroup
from tpcache.engine.driver import Driver, Operations
from tpcache.testing.ops import apply, random_op, tokens_for

GARBAGE = -1  # what a slot holds after a failed or torn copy
DIVERGENCES = ("clock", "stamp", "hits", "device_page", "host_slot", "storage", "lease", "queue", "state_vector")


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
    prepare_fail_at: int | None = None  # round at which one rank cannot prepare its vector
    commit_fail_at: int | None = None  # round at which one rank's commit raises
    shm: bool = False  # exchange vectors through a real shared-memory segment

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
        self.storage: dict[int, int] = {}
        self.unhealthy = False
        self.fail_landed = False

    def start(self, ops: Sequence[Transfer]) -> None:
        for op in ops:
            self.due[op.op_id] = (self.now + self.rng.randint(0, self.faults.max_delay), op)

    def landed(self) -> Mapping[int, int]:
        if self.fail_landed:
            self.fail_landed = False
            raise RuntimeError("simulated: this rank lost its completion records")
        return self.results

    def retire(self, ops: Sequence[Transfer]) -> None:
        for op in ops:
            self.results.pop(op.op_id, None)

    def health(self) -> int:
        return HEALTH_IO_ERROR if self.unhealthy else 0

    def drained(self) -> bool:
        return not self.due

    def reset(self) -> None:
        self.results.clear()
        self.unhealthy = False

    def write_device(self, page: int, page_hash: int) -> None:
        """The engine wrote a page's KV (what insert adopts)."""
        self.device[page] = page_hash

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
                present = 0  # storage answers for the leading pages this rank holds
                while present < op.num_pages and op.page_hashes[present] in self.storage:
                    present += 1
                landed = min(landed, present)
            for i in range(op.num_pages):
                ok = i < landed
                if op.kind == OpKind.BACKUP:
                    self.host[op.host_slots[i]] = self.device.get(op.device_pages[i], GARBAGE) if ok else GARBAGE
                elif op.kind == OpKind.LOAD:
                    self.device[op.device_pages[i]] = self.host.get(op.host_slots[i], GARBAGE) if ok else GARBAGE
                elif op.kind == OpKind.STORAGE_WRITE and ok:
                    self.storage[op.page_hashes[i]] = self.host.get(op.host_slots[i], GARBAGE)
                elif op.kind == OpKind.STORAGE_READ:
                    self.host[op.host_slots[i]] = self.storage[op.page_hashes[i]] if ok else GARBAGE
            self.results[op_id] = landed


class SimRank(Operations):
    """One simulated rank: the production driver over a fake I/O."""

    def __init__(self, rank: int, config: CacheConfig, io: FakeIO) -> None:
        self.rank = rank
        self.io = io
        self.driver = Driver(CacheCore(config), io, rank=rank)
        self.leases: list[tuple[int, list[int]]] = []
        self.alive = True


class SimCluster:
    def __init__(self, seed: int, ranks: int, config: CacheConfig, faults: Faults) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.config = config
        self.faults = faults
        self.group = SimGroup(ranks)
        self.shm = None
        if faults.shm:
            from tpcache.dist.shm import ShmCollective

            self.shm = ShmCollective.local_group(ranks)
        self.ranks = [SimRank(r, config, FakeIO(random.Random(seed * 1000 + r), faults)) for r in range(ranks)]
        self.calls = [0] * ranks  # collectives issued by each rank
        self.now = 0
        self.after_commit = False  # the retention cap is checked only right after a commit
        self.excused = False  # a closing fault or a flush happened and the cache has not reopened since
        self.log: list[str] = []

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
            self.excused = self.excused or op[0] == "flush"
            for rank in self.live:
                if op[0] == "flush":  # as an engine does: abort every request, then flush
                    for lease_id, _ in rank.leases:
                        with contextlib.suppress(UnknownLease):
                            rank.release(lease_id)
                    rank.leases.clear()
                    rank.request_flush()
                elif op[0] == "evict":  # a test-only sequenced op: forget pages on every rank
                    core = rank.core
                    rank.driver.apply(lambda n, c=core: (c.evict_device(n), c.evict_host(n)), op[1])
                else:
                    apply(rank, op, rank.leases, rank.io.write_device)

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
        if self.faults.commit_fail_at == self.now and self.victim.alive and isinstance(results[victim], list):
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

    def _exchange(self, vectors: dict[int, list[int]]) -> dict[int, list[int] | CollectiveError]:
        if self.shm is None:
            full = [vectors.get(r) for r in range(len(self.ranks))]
            try:
                reduced: list[int] | CollectiveError = self.group.reduce(full)
            except CollectiveError as exc:
                reduced = exc
            return {r: reduced for r in vectors}
        for r, vector in vectors.items():
            if not self.shm[r].closed:
                self.shm[r].publish(to_int64_array(vector))
        out: dict[int, list[int] | CollectiveError] = {}
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
            self.log.append(f"round {now}: rank {victim.rank}'s I/O reports unhealthy")
            victim.io.unhealthy = True
        if f.prepare_fail_at == now:
            self.log.append(f"round {now}: rank {victim.rank} cannot prepare")
            victim.io.fail_landed = True
        if f.kill_at == now:
            self.log.append(f"round {now}: rank {victim.rank} dies")
            victim.alive = False
            self.group.kill(victim.rank)
            if self.shm is not None:
                self.shm[victim.rank].close()

    def _inject_vector(self, vectors: dict[int, list[int]]) -> tuple[OpKind, list[list[int]]] | None:
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
        for tokens in probes:
            answers = []
            for rank in live:
                m = rank.match(tokens)
                answers.append((m.device_pages, m.host_pages, m.device_page_ids))
                for node in m.nodes[: m.device_pages]:
                    if rank.io.device.get(node.device_page) != node.hash:
                        raise SimFailure(
                            f"round {now}: rank {rank.rank} hit device page {node.device_page} "
                            f"that does not hold page {node.hash:x}"
                        )
                for node in m.nodes[m.device_pages :]:
                    if rank.io.host.get(node.host_slot) != node.hash:
                        raise SimFailure(
                            f"round {now}: rank {rank.rank} hit host slot {node.host_slot} "
                            f"that does not hold page {node.hash:x}"
                        )
                for node in m.nodes:
                    if node.storage_state == StorageState.DURABLE and rank.io.storage.get(node.hash) != node.hash:
                        raise SimFailure(f"round {now}: rank {rank.rank} marks page {node.hash:x} durable, not stored")
            if len({repr(a) for a, r in zip(answers, live, strict=True) if not r.core.closed}) > 1:
                raise SimFailure(f"round {now}: ranks answer a match differently: {answers}")

    def states(self) -> list[tuple[int, str | None]]:
        return [(r.core.digest.value, r.core.closed_reason) for r in self.live]


def snapshot(core: CacheCore) -> dict[str, object]:
    """Everything that decides what a rank does next, field by field (independent of the digest)."""
    nodes = [
        (n.node_id, n.hash, n.device_state, n.device_page, n.host_state, n.host_slot, n.storage_state)
        + (n.device_pins, n.host_pins, n.last_access, n.hits, n.created_at, n.parent.node_id if n.parent else -1)
        for n in core.tree.nodes.values()
    ]
    leases = [
        (lid, [n.node_id for n in x.device_nodes], [n.node_id for n in x.host_nodes], x.pages, x.ops, x.releasing)
        + (None if x.prefetch is None else tuple(x.prefetch.fields()),)
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
    idle = [x for x in core.leases.values() if not x.ops and not x.releasing]
    if what == "lease" and idle:
        core.book.release(rng.choice(idle))  # released here only, behind the sequencer's back
        return "lease"
    led.tick()
    return "clock"


def run_schedule(seed: int, ranks: int, rounds: int = 30, ops_per_round: int = 3) -> SimCluster:
    """One seeded schedule: random config, ops, delays and (for some seeds) one fault."""
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
    sim = SimCluster(seed, ranks, config, faults)
    try:
        _run(sim, rng, rounds, ops_per_round)
    finally:
        sim.close()
    return sim


def _run(sim: SimCluster, rng: random.Random, rounds: int, ops_per_round: int) -> None:
    faults, page = sim.faults, sim.config.page_size
    for _ in range(rounds):
        ops = [random_op(rng, page) for _ in range(rng.randint(0, ops_per_round))]
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
        probes = [tokens_for(tuple(rng.randrange(4) for _ in range(rng.randint(1, 6))), page, 0) for _ in range(3)]
        sim.check(probes)
    # Drain: no more ops; every copy lands, every lease ends; then everything must be accounted for.
    for rank in sim.live:
        for lease_id, _ in list(rank.leases):
            if lease_id in rank.core.leases:
                rank.release(lease_id)
        rank.leases.clear()
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run one simulation schedule (reproduce a failing seed).")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    try:
        sim = run_schedule(args.seed, args.ranks, args.rounds)
    except AssertionError as exc:
        print(f"seed {args.seed} ranks {args.ranks}: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"seed {args.seed} ranks {args.ranks}: ok; {'; '.join(sim.log) or 'no faults'}; final {sim.states()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
