"""The simulation ring: whole TP groups in one process, thousands of seeded schedules with faults."""

import logging

import pytest

from tpcache.core import CacheConfig
from tpcache.testing.ops import tokens_for
from tpcache.testing.sim import Faults, SimCluster, run_schedule

BATCHES = 20
PER_BATCH = 50  # 20 x 50 = 1,000 seeded schedules per CI run


@pytest.mark.parametrize("batch", range(BATCHES))
def test_seeded_schedules(batch, caplog):
    caplog.set_level(logging.CRITICAL)
    for seed in range(batch * PER_BATCH, (batch + 1) * PER_BATCH):
        ranks = 2 + seed % 7  # 2 to 8 ranks
        try:
            sim = run_schedule(seed, ranks)
        except AssertionError as exc:
            pytest.fail(
                f"seed {seed} failed: {exc}\nreproduce: python -m tpcache.testing.sim --seed {seed} --ranks {ranks}"
            )
        if sim.faults.kill_at is None:  # exactly one collective per round on every rank
            assert sim.group.calls == [sim.now] * ranks


def _cluster(faults: Faults, ranks: int = 3, **cfg) -> SimCluster:
    config = CacheConfig(page_size=4, device_pages=16, host_pages=16, write_policy="write_through", **cfg)
    return SimCluster(seed=1, ranks=ranks, config=config, faults=faults)


def _traffic(sim: SimCluster, n: int) -> None:
    for i in range(n):
        sim.apply_ops([("lock", (i % 5, i % 3, (i * 7) % 4), 1), ("insert", 0), ("release", 0)])
        sim.round()
        sim.check([tokens_for((i % 5, i % 3), 4, 0)])


def test_divergence_closes_every_rank_within_one_round_and_flush_reopens():
    sim = _cluster(Faults(max_delay=2))
    _traffic(sim, 6)
    assert not any(r.core.closed for r in sim.ranks)
    sim.ranks[1].core.clock += 1  # one rank silently differs
    sim.round()
    assert all(r.core.closed for r in sim.ranks)
    assert "state_digest differs" in sim.ranks[0].core.closed_reason
    m = sim.ranks[0].core.match(tokens_for((0, 0, 0), 4, 0))
    assert m.device_pages == 0  # closed: misses only
    for rank in sim.ranks:
        rank.core.request_flush()
        rank.leases.clear()
    for _ in range(6):
        sim.round()
    assert not any(r.core.closed for r in sim.ranks)
    assert len({r.core.digest.value for r in sim.ranks}) == 1
    _traffic(sim, 4)  # serves again
    assert sim.ranks[0].core.stats.inserted_pages > 0


def test_sequence_mismatch_closes():
    sim = _cluster(Faults(max_delay=0))
    _traffic(sim, 2)
    vectors = [r.round.prepare(sim.seq + (r is sim.ranks[0]), r.shell) for r in sim.ranks]
    reduced = sim.group.reduce(vectors)
    reports = [r.round.commit(reduced) for r in sim.ranks]
    assert all("seq" in rep.mismatches for rep in reports)
    assert all(r.core.closed for r in sim.ranks)


def test_plan_mismatch_skips_plan_then_switches_feature_off(caplog):
    """Mirror release (seed 002) under host pressure; one rank's plan differs every round."""
    caplog.set_level(logging.ERROR, logger="tpcache.round")
    sim = SimCluster(
        seed=2,
        ranks=2,
        config=CacheConfig(
            page_size=4,
            device_pages=24,
            host_pages=4,
            write_policy="write_through",
            storage=True,
            plan_mismatch_limit=3,
        ),
        faults=Faults(max_delay=0, plan_diverge_at=1),
    )
    released_before = None
    for i in range(30):
        sim.apply_ops([("lock", (i, i + 1), 0), ("insert", 0), ("release", 0)])
        sim.round()
        sim.check([])
        if released_before is None and sim.ranks[0].round.mismatch_counts.get("plan"):
            released_before = sim.ranks[0].core.stats.mirrors_released_pages
    r0 = sim.ranks[0].round
    assert r0.mismatch_counts["plan"] >= 3
    assert "mirror_release" in r0.disabled and "mirror_release" in sim.ranks[1].round.disabled
    assert sim.ranks[0].core.stats.mirrors_released_pages == released_before  # nothing mutated
    assert len({r.core.digest.value for r in sim.ranks}) == 1 and not sim.ranks[0].core.closed
    assert any("switched off" in rec.message for rec in caplog.records)


def test_mirror_release_executes_when_plans_agree():
    sim = SimCluster(
        seed=3,
        ranks=2,
        config=CacheConfig(page_size=4, device_pages=24, host_pages=4, write_policy="write_through", storage=True),
        faults=Faults(max_delay=0),
    )
    for i in range(30):
        sim.apply_ops([("lock", (i, i + 1), 0), ("insert", 0), ("release", 0)])
        sim.round()
        sim.check([])
    core = sim.ranks[0].core
    assert core.stats.mirrors_released_pages > 0
    assert sim.ranks[0].round.mismatch_counts.get("plan", 0) == 0
    assert core.stats.storage_written_pages > 0


def test_dead_rank_closes_the_survivors_with_a_clear_reason():
    sim = _cluster(Faults(max_delay=1, kill_at=3), ranks=4)
    _traffic(sim, 5)
    assert not sim.ranks[3].alive
    for rank in sim.live:
        assert rank.core.closed and "rank 3" in rank.core.closed_reason


def test_completions_apply_only_as_agreed():
    """One rank finishes a backup rounds before the other: nothing becomes host-valid until both have."""
    sim = _cluster(Faults(max_delay=0), ranks=2)
    sim.apply_ops([("lock", (1, 2), 0), ("insert", 0), ("release", 0)])
    slow = sim.ranks[1].shell
    held = dict(slow.due)
    slow.due.clear()  # rank 1's copy does not finish yet
    sim.round()
    sim.round()
    for rank in sim.ranks:
        assert rank.core.match(tokens_for((1, 2), 4, 0)).device_pages == 2
        assert all(n.host_state.name == "WRITING" for n in rank.core.match(tokens_for((1, 2), 4, 0)).nodes)
    slow.due.update({k: (0, op) for k, (_, op) in held.items()})
    sim.round()
    for rank in sim.ranks:
        assert all(n.host_state.name == "VALID" for n in rank.core.match(tokens_for((1, 2), 4, 0)).nodes)
    assert len({r.core.digest.value for r in sim.ranks}) == 1
