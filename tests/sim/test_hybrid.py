"""Hybrid models on simulated groups: SWA pages and Mamba states agreed like every other copy, under
every fault the simulator injects, with the bytes behind every component of every hit checked."""

import logging

import pytest

from tpcache.core import CacheConfig, OpKind
from tpcache.core.tiers import StorageState
from tpcache.core.treecore.components import DSLOT, STORE
from tpcache.testing.ops import tokens_for
from tpcache.testing.sim import HYBRIDS, PART_DIVERGENCES, Faults, SimCluster, SimFailure, run_schedule

BATCHES = 4
PER_BATCH = 25  # 3 kinds x 4 x 25 = 300 seeded hybrid schedules per run
PAGE = 2
PATH = (1, 2, 3, 0)


@pytest.mark.parametrize("kind", HYBRIDS)
@pytest.mark.parametrize("batch", range(BATCHES))
def test_hybrid_seeded_schedules(kind, batch, caplog):
    caplog.set_level(logging.CRITICAL)
    for seed in range(batch * PER_BATCH, (batch + 1) * PER_BATCH):
        ranks = 2 + seed % 5
        try:
            sim = run_schedule(seed, ranks, hybrid=kind)
        except AssertionError as exc:
            pytest.fail(
                f"seed {seed} failed: {exc}\n"
                f"reproduce: python -m tpcache.testing.sim --seed {seed} --ranks {ranks} --hybrid {kind}"
            )
        if sim.faults.kill_at is None:
            assert sim.calls == [sim.now] * ranks


def cluster(ranks: int = 2, faults: Faults | None = None, **cfg) -> SimCluster:
    base = dict(
        page_size=PAGE,
        device_pages=8,
        host_pages=8,
        write_policy="write_through",
        storage=True,
        swa_window=3,  # two pages of window
        swa_device_pages=8,
        swa_host_pages=8,
        mamba_every=1,
        mamba_device_states=8,
        mamba_host_states=8,
    )
    config = CacheConfig(**{**base, **cfg})
    return SimCluster(seed=4, ranks=ranks, config=config, faults=faults or Faults(max_delay=0, partial_ack=0.0))


def rounds(sim: SimCluster, n: int) -> None:
    for _ in range(n):
        sim.round()
        sim.check([tokens_for(PATH, PAGE, 0), tokens_for(PATH[:2], PAGE, 0)])


def store_then_forget(sim: SimCluster) -> None:
    sim.apply_ops([("lock", PATH, 0), ("insert", 0), ("release", 0)])
    rounds(sim, 4)
    for rank in sim.ranks:
        assert rank.core.stats.storage_written_pages == len(PATH)
    sim.apply_ops([("evict", 8)])
    for rank in sim.ranks:
        assert len(rank.core.tree) == 0


def test_prefetch_and_load_bring_back_every_component_of_the_hit():
    sim = cluster()
    store_then_forget(sim)
    sim.apply_ops([("lock", PATH, 0), ("prefetch", 0)])
    rounds(sim, 3)
    for rank in sim.ranks:
        m = rank.match(tokens_for(PATH, PAGE, 0))
        assert (m.device_pages, m.host_pages) == (0, 4)
        assert {c: len(nodes) for c, nodes in m.parts.items()} == {1: 2, 2: 1}  # window, state at 4
    sim.apply_ops([("load", 0)])
    rounds(sim, 2)
    for rank in sim.ranks:  # check() verified every full page, SWA page and state behind the hit
        assert rank.match(tokens_for(PATH, PAGE, 0)).device_pages == 4


def test_a_component_missing_from_one_ranks_storage_is_a_miss_on_every_rank():
    sim = cluster(ranks=3)
    store_then_forget(sim)
    last = sim.ranks[0].core.match(tokens_for(PATH, PAGE, 0)).page_hashes[-1]
    del sim.ranks[2].io.storage[(2, last)]  # rank 2 lost the state at page 4
    sim.apply_ops([("lock", PATH, 0), ("prefetch", 0)])
    rounds(sim, 3)
    hits = {(m.device_pages, m.host_pages) for m in (r.match(tokens_for(PATH, PAGE, 0)) for r in sim.ranks)}
    assert hits == {(0, 3)}  # the hit ends at the state every rank holds


def test_a_load_that_falls_short_on_one_rank_is_short_on_every_rank_and_nothing_is_read_early():
    sim = cluster(ranks=2, storage=False)
    sim.apply_ops([("lock", PATH, 0), ("insert", 0), ("release", 0)])
    rounds(sim, 2)
    sim.apply_ops([("demote", 8)])  # device copies go; host copies stay
    sim.apply_ops([("lock", PATH, 0), ("load", 0)])
    victim = sim.ranks[1].io
    (op_id,) = [i for i, (_, op) in victim.due.items() if op.kind == OpKind.LOAD and op.parts]
    del victim.due[op_id]
    victim.results[op_id] = 1  # on rank 1 only the first node's copies landed
    rounds(sim, 2)  # check(): nothing whose copy failed somewhere is served from device
    for rank in sim.ranks:
        path = rank.core.tree.walk(rank.match(tokens_for(PATH, PAGE, 0)).walk._tokens).nodes
        assert [n.device_state for n in path] == [2, 0, 0, 0]  # the agreed leading node only
        assert rank.match(tokens_for(PATH, PAGE, 0)).host_pages == 4  # the rest is still on host
    sim.apply_ops([("release", 0), ("request", PATH, 0, False)])  # the next request loads again: now it all lands
    rounds(sim, 2)
    assert {r.match(tokens_for(PATH, PAGE, 0)).device_pages for r in sim.ranks} == {4}


@pytest.mark.parametrize("what", PART_DIVERGENCES)
def test_a_divergence_in_component_data_closes_every_rank_in_its_round(what, caplog):
    caplog.set_level(logging.CRITICAL)
    sim = cluster(ranks=3, faults=Faults(max_delay=0, partial_ack=0.0, diverge_at=6, diverge=what))
    sim.apply_ops([("lock", (9, 9), 0)])
    for i in range(5):
        sim.apply_ops([("request", (i % 3, 1, i % 2), 1, False)])
        rounds(sim, 1)
    assert not any(r.core.closed for r in sim.ranks)
    sim.apply_ops([("request", (1, 1, 1), 0, False)])
    sim.round()
    assert all(r.core.closed for r in sim.ranks), sim.log
    assert what.split(" ")[0] in " ".join(sim.log)


def test_the_checker_verifies_the_bytes_behind_a_component_of_a_hit():
    sim = cluster(storage=False)
    sim.apply_ops([("lock", PATH, 0), ("insert", 0), ("release", 0)])
    rounds(sim, 2)
    core = sim.ranks[1].core
    node = core.tree.nodes[core.match(tokens_for(PATH, PAGE, 0)).parts[1][0]]
    sim.ranks[1].io.part_device[1][node.comp[DSLOT]] = -1  # that SWA page's bytes are wrong on rank 1
    with pytest.raises(SimFailure, match="component 1"):
        sim.check([tokens_for(PATH, PAGE, 0)])


def test_storage_going_down_as_a_read_lands_leaves_no_component_durable():
    sim = cluster()
    store_then_forget(sim)
    sim.apply_ops([("lock", PATH, 0), ("prefetch", 0)])
    rounds(sim, 1)  # the lookup agreed; the read is in flight
    core = sim.ranks[0].core
    assert core.inflight[OpKind.STORAGE_READ]
    sim.faults.storage_down_at = sim.now + 1  # the read lands on every rank, then the storage goes
    rounds(sim, 3)
    for rank in sim.ranks:
        assert rank.core.backup.storage_down and not rank.core.inflight[OpKind.STORAGE_READ]
        assert rank.match(tokens_for(PATH, PAGE, 0)).host_pages == 4  # what landed stays readable
        for node in rank.core.tree.nodes.values():
            assert node.storage_state != StorageState.DURABLE
            stored = [node.comp[p.base + STORE] for p in rank.core.ledger.parts.values() if node.comp is not None]
            assert StorageState.DURABLE not in stored
