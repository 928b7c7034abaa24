"""A seeded simulation of a whole TP group in one process (in the spirit of TigerBeetle's VOPR).

N ranks each run a CacheCore and a Round over a simulated collective. Every rank applies the same
client operations in the same order (what rank 0's sequencing gives). Each rank has its own
``FakeShell`` that finishes copies after random delays, in any order, sometimes only partly, and
records what each device page and host slot really holds. Faults: a rank's state diverges, a
rank's plan diverges, a rank dies. After every round the checker asserts:

- while open, every rank has the same state digest and gives the same answers;
- every rank's core passes ``invariants.check`` (no leak, no double free, pins accounted);
- every page a match reports as a hit really holds that page's data on every rank;
- an injected divergence closes every rank within one round, and nothing opens again until an
  agreed flush, after which all ranks are equal and open.

Reproduce a failing seed: ``python -m tpcache.testing.sim --seed S --ranks N``.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tpcache.core import CacheConfig, CacheCore, OpKind, Transfer, check
from tpcache.core.round import QueueObservation, Round, observe_head
from tpcache.core.tiers import DeviceState, StorageState
from tpcache.dist.collective import CollectiveError
from tpcache.dist.sim import SimGroup
from tpcache.testing.ops import apply, random_op, tokens_for

GARBAGE = -1  # what a slot holds after a failed or torn copy


class SimFailure(AssertionError):
    pass


@dataclass
class Faults:
    max_delay: int = 3  # rounds a copy may take on a rank
    partial_ack: float = 0.05  # probability a copy stops short on a rank
    diverge_at: int | None = None  # round at which one rank's state silently diverges
    plan_diverge_at: int | None = None  # round from which one rank's plans always diverge
    kill_at: int | None = None  # round at which one rank dies


class FakeShell:
    """One rank's I/O: copies finish after a random delay, possibly out of order or short.

    ``device``/``host`` map a page/slot to the page hash it physically holds, so the checker can
    tell a real hit from a page whose copy has not landed here.
    """

    def __init__(self, rng: random.Random, faults: Faults) -> None:
        self.rng = rng
        self.faults = faults
        self.results: dict[int, int] = {}  # op id -> pages that landed (once finished)
        self.due: dict[int, tuple[int, Transfer]] = {}  # op id -> (round it finishes, op)
        self.device: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self.storage: dict[int, int] = {}

    def submit(self, effects: Sequence[Transfer], now: int) -> None:
        for op in effects:
            self.due[op.op_id] = (now + self.rng.randint(0, self.faults.max_delay), op)

    def write_device(self, page: int, page_hash: int) -> None:
        """The engine wrote a page's KV (what insert adopts)."""
        self.device[page] = page_hash

    def tick(self, now: int) -> None:
        """Finish due copies, in random order: completion order is not issue order."""
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

    def observe(self, kind: OpKind, pending: Sequence[Transfer]) -> QueueObservation:
        return observe_head(self.results, pending)

    def health(self) -> int:
        return 0

    def drained(self) -> bool:
        return not self.due

    def retire(self, ops: Sequence[Transfer]) -> None:
        for op in ops:
            self.results.pop(op.op_id, None)


@dataclass
class SimRank:
    core: CacheCore
    round: Round
    shell: FakeShell
    leases: list = field(default_factory=list)
    alive: bool = True


class SimCluster:
    def __init__(self, seed: int, ranks: int, config: CacheConfig, faults: Faults) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.config = config
        self.faults = faults
        self.group = SimGroup(ranks)
        self.ranks = [
            SimRank(core, Round(core), FakeShell(random.Random(seed * 1000 + r), faults))
            for r, core in enumerate(CacheCore(config) for _ in range(ranks))
        ]
        self.now = 0
        self.seq = 0
        self.closed_at: int | None = None
        self.after_commit = False  # the retention cap is checked only right after a commit
        self.log: list[str] = []

    @property
    def live(self) -> list[SimRank]:
        return [r for r in self.ranks if r.alive]

    def apply_ops(self, ops: Sequence[tuple]) -> None:
        """Sequenced client ops: every live rank applies the same ops in the same order."""
        self.after_commit = False
        for op in ops:
            self.seq += 1
            for rank in self.live:
                before = self._device_valid(rank) if op[0] == "insert" else None
                apply(rank.core, op, rank.leases)
                if before is not None:
                    # The engine computed the KV of every page insert adopted: it is written now.
                    for node in rank.core.tree.nodes.values():
                        key = (node.node_id, node.device_page)
                        if node.device_state == DeviceState.VALID and key not in before:
                            rank.shell.write_device(node.device_page, node.hash)
                rank.shell.submit(rank.core.take_effects(), self.now)

    @staticmethod
    def _device_valid(rank: SimRank) -> set[tuple[int, int]]:
        nodes = rank.core.tree.nodes.values()
        return {(n.node_id, n.device_page) for n in nodes if n.device_state == DeviceState.VALID}

    def round(self) -> None:
        self.now += 1
        for rank in self.live:
            rank.shell.tick(self.now)
        self._inject()
        vectors = [r.round.prepare(self.seq, r.shell) if r.alive else None for r in self.ranks]
        try:
            reduced = self.group.reduce(vectors)
        except CollectiveError as exc:
            for rank in self.live:
                rank.round.fail(f"collective failed: {exc}")
            return
        for rank in self.live:
            report = rank.round.commit(reduced)
            rank.shell.retire(report.completed)
            rank.shell.submit(rank.core.take_effects(), self.now)
        self.after_commit = True

    def _inject(self) -> None:
        f, victim = self.faults, self.ranks[-1]
        if f.diverge_at == self.now and victim.alive:
            self.log.append(f"round {self.now}: rank {len(self.ranks) - 1} diverges")
            victim.core.clock += 1  # a silent local difference, as a lost message would cause
        plan = victim.round.pending_plan
        if f.plan_diverge_at is not None and f.plan_diverge_at <= self.now and plan:
            self.log.append(f"round {self.now}: rank {len(self.ranks) - 1} prepares a different plan")
            plan.digest ^= 1
        if f.kill_at == self.now and victim.alive:
            self.log.append(f"round {self.now}: rank {len(self.ranks) - 1} dies")
            victim.alive = False
            self.group.kill(len(self.ranks) - 1)

    # ------------------------------------------------------------------ the checker

    def check(self, probes: Sequence[list[int]]) -> None:
        live = self.live
        for rank in live:
            check(rank.core)
        closed = [r.core.closed for r in live]
        if any(closed) and not all(closed):
            raise SimFailure(f"round {self.now}: some ranks closed, some open: {closed}")
        if not closed[0] and len({r.core.digest.value for r in live}) != 1:
            raise SimFailure(f"round {self.now}: open ranks with different digests")
        for rank in live:  # reference seed 000: the cap holds after every commit
            cap = rank.core.retention_cap_tokens
            if not rank.core.closed and 0 <= cap < rank.core.evictable_device_tokens and self.after_commit:
                raise SimFailure(f"round {self.now}: {rank.core.evictable_device_tokens} evictable tokens, cap {cap}")
        for tokens in probes:
            answers = []
            for r, rank in enumerate(live):
                m = rank.core.match(tokens)
                answers.append((m.device_pages, m.host_pages, m.device_page_ids))
                for node in m.nodes[: m.device_pages]:
                    if rank.shell.device.get(node.device_page) != node.hash:
                        raise SimFailure(
                            f"round {self.now}: rank {r} hit device page {node.device_page} "
                            f"that does not hold page {node.hash:x}"
                        )
                for node in m.nodes[m.device_pages :]:
                    if rank.shell.host.get(node.host_slot) != node.hash:
                        raise SimFailure(
                            f"round {self.now}: rank {r} hit host slot {node.host_slot} "
                            f"that does not hold page {node.hash:x}"
                        )
                for node in m.nodes:
                    if node.storage_state == StorageState.DURABLE and rank.shell.storage.get(node.hash) != node.hash:
                        raise SimFailure(f"round {self.now}: rank {r} marks page {node.hash:x} durable, not stored")
            if len({repr(a) for a in answers}) != 1:
                raise SimFailure(f"round {self.now}: ranks answer a match differently: {answers}")

    def states(self) -> list[tuple[int, str | None]]:
        return [(r.core.digest.value, r.core.closed_reason) for r in self.live]


def run_schedule(seed: int, ranks: int, rounds: int = 30, ops_per_round: int = 3) -> SimCluster:
    """One seeded schedule: random config, ops, delays and (for some seeds) one fault."""
    rng = random.Random(seed)
    page = rng.choice([2, 4])
    config = CacheConfig(
        page_size=page,
        device_pages=rng.randint(4, 24),
        host_pages=rng.choice([0, 6, 24]),
        write_policy=rng.choice(["none", "write_through", "write_through_selective", "write_back"]),
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
        plan_diverge_at=rng.randint(2, rounds - 6) if 0.15 <= fault < 0.25 else None,
        kill_at=rng.randint(3, rounds - 3) if 0.25 <= fault < 0.3 else None,
    )
    sim = SimCluster(seed, ranks, config, faults)
    for _ in range(rounds):
        ops = [random_op(rng, page) for _ in range(rng.randint(0, ops_per_round))]
        if sim.live[0].core.closed and sim.faults.kill_at is None and rng.random() < 0.3:
            ops.append(("flush",))
        for op in ops:
            if op[0] == "flush":
                sim.seq += 1
                for rank in sim.live:
                    rank.core.request_flush()
            else:
                sim.apply_ops([op])
        was_closed = sim.live[0].core.closed
        sim.round()
        if faults.diverge_at == sim.now and not was_closed and not all(r.core.closed for r in sim.live):
            raise SimFailure(f"seed {seed}: divergence at round {sim.now} did not close every rank")
        if faults.kill_at is not None and sim.now >= faults.kill_at and not all(r.core.closed for r in sim.live):
            raise SimFailure(f"seed {seed}: a dead rank did not close the survivors")
        probes = [tokens_for(tuple(rng.randrange(4) for _ in range(rng.randint(1, 6))), page, 0) for _ in range(3)]
        sim.check(probes)
    # Drain: no more ops; every copy lands, every lease ends; then everything must be accounted for.
    for rank in sim.live:
        for lease_id, _ in list(rank.leases):
            rank.core.release(lease_id)
        rank.leases.clear()
    for _ in range(300):  # write-back under a zero cap with a tiny host pool drains a page or so a round
        if all(r.shell.drained() and not any(r.core.inflight.values()) for r in sim.live):
            break
        sim.round()
        sim.check([])
    if faults.kill_at is None:
        for rank in sim.live:
            if rank.core.leases:
                raise SimFailure(f"seed {seed}: leases left after drain: {sorted(rank.core.leases)}")
            if any(rank.core.inflight.values()) and not rank.core.closed:
                raise SimFailure(f"seed {seed}: copies left in flight after drain")
    return sim


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
