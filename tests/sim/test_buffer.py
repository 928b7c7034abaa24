"""Buffer-only host mode on simulated groups: requests admitted in phases under failed reads, lost
storage data, a slow rank and divergence; no host hit, no hit counted before commit, the bytes
behind every committed hit checked on every rank, no staging slot kept past its agreed copy."""

import logging

import pytest

from tpcache.core import CacheConfig, OpKind
from tpcache.testing.ops import tokens_for
from tpcache.testing.sim import Faults, SimCluster, SimFailure, run_schedule

BATCHES = 2
PER_BATCH = 30  # 60 seeded buffer-mode schedules per run
PAGE = 2
PATH = (1, 2, 3, 0)


@pytest.mark.parametrize("batch", range(BATCHES))
def test_buffer_seeded_schedules(batch, caplog):
    caplog.set_level(logging.CRITICAL)
    committed = 0
    for seed in range(batch * PER_BATCH, (batch + 1) * PER_BATCH):
        ranks = 2 + seed % 3
        try:
            sim = run_schedule(seed, ranks, buffer=True)
        except AssertionError as exc:
            pytest.fail(
                f"seed {seed} failed: {exc}\n"
                f"reproduce: python -m tpcache.testing.sim --seed {seed} --ranks {ranks} --buffer"
            )
        if sim.faults.kill_at is None:
            assert sim.calls == [sim.now] * ranks
        committed += sum(r.core.stats.admissions_committed for r in sim.live)
    assert committed  # the schedules do admit requests (not only wait)


def cluster(ranks: int = 2, faults: Faults | None = None, **cfg) -> SimCluster:
    base = dict(page_size=PAGE, device_pages=8, host_pages=4, host_mode="buffer", storage=True)
    config = CacheConfig(**{**base, **cfg})
    return SimCluster(seed=4, ranks=ranks, config=config, faults=faults or Faults(max_delay=0, partial_ack=0.0))


def rounds(sim: SimCluster, n: int, ops: list | None = None) -> None:
    for _ in range(n):
        sim.apply_ops(ops or [])
        sim.round()
        sim.check([tokens_for(PATH, PAGE, 0)])


def store_then_forget(sim: SimCluster) -> None:
    sim.apply_ops([("lock", PATH, 0), ("insert", 0), ("release", 0)])
    rounds(sim, 4)
    for rank in sim.ranks:
        assert rank.core.stats.storage_written_pages == len(PATH)
        assert rank.core.host.used == 0  # the backups' staging slots went once the writes were durable
    sim.apply_ops([("evict", 8)])


def test_a_stored_prefix_comes_back_through_staging_and_is_counted_at_commit():
    sim = cluster()
    store_then_forget(sim)
    sim.apply_ops([("admit", PATH, 1)])
    rounds(sim, 8, [("admissions",)])
    for rank in sim.ranks:
        s = rank.core.stats
        assert s.admissions_committed == 1 and s.storage_hit_tokens == len(PATH) * PAGE
        assert s.host_hit_tokens == 0 and rank.core.host.used == 0
        assert rank.core.match(tokens_for(PATH, PAGE, 0)).device_pages == len(PATH)


def test_storage_lost_on_one_rank_is_a_miss_everywhere_and_nothing_is_counted_for_it():
    sim = cluster(ranks=3)
    store_then_forget(sim)
    sim.ranks[2].io.storage.clear()  # rank 2's storage lost everything
    sim.apply_ops([("admit", PATH, 1)])
    rounds(sim, 8, [("admissions",)])
    for rank in sim.ranks:
        assert rank.core.stats.admissions_committed == 1 and rank.core.stats.storage_hit_tokens == 0


def test_a_slow_rank_with_failing_reads_never_commits_a_wrong_or_early_hit():
    sim = cluster(prefetch_max_attempts=4)
    store_then_forget(sim)
    sim.faults.max_delay, sim.faults.partial_ack, sim.faults.read_fail, sim.faults.slow = 1, 0.2, 0.5, 3
    sim.apply_ops([("admit", PATH, 1), ("admit", PATH[:2], 1)])
    rounds(sim, 30, [("admissions",)])
    for rank in sim.ranks:
        assert rank.core.stats.admissions_committed == 2 and rank.core.host.used == 0


def test_the_checker_catches_a_host_hit_in_buffer_mode():
    sim = cluster()
    store_then_forget(sim)
    sim.apply_ops([("admit", PATH, 1)])
    rounds(sim, 3)  # the read lands in staging; no scheduler step loads it
    rank = sim.ranks[1]
    assert rank.core.ledger.host.used and rank.core.inflight[OpKind.LOAD] == type(rank.core.inflight[OpKind.LOAD])()
    rank.core.staging.enabled = False  # a build whose match would serve the staged pages as host hits
    with pytest.raises(SimFailure, match="host pages in buffer mode"):
        sim.check([tokens_for(PATH, PAGE, 0)])


def test_the_checker_catches_a_hit_counted_before_commit():
    sim = cluster()
    store_then_forget(sim)
    sim.ranks[0].core.stats.storage_hit_tokens += PAGE  # counted with no commit behind it
    with pytest.raises(SimFailure, match="storage-hit tokens counted"):
        sim.check([])
