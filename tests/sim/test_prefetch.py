"""Storage prefetch (reference seed 003) on a simulated group: agreed hits, pacing, caps, unwind."""

import pytest

from tpcache.core import CacheConfig, InvariantViolation, OpKind, check
from tpcache.core.hashing import as_token_bytes
from tpcache.core.tiers import StorageState
from tpcache.testing.ops import tokens_for
from tpcache.testing.sim import Faults, SimCluster

PAGE = 2
PATH = (1, 2, 3, 0)


def cluster(ranks: int = 2, **cfg) -> SimCluster:
    config = CacheConfig(
        page_size=PAGE, device_pages=8, host_pages=8, write_policy="write_through", storage=True, **cfg
    )
    return SimCluster(seed=4, ranks=ranks, config=config, faults=Faults(max_delay=0, partial_ack=0.0))


def rounds(sim: SimCluster, n: int) -> None:
    for _ in range(n):
        sim.round()
        sim.check([tokens_for(PATH, PAGE, 0)])


def store_then_forget(sim: SimCluster) -> None:
    """Insert PATH, let it reach storage, then evict it from device and host on every rank."""
    sim.apply_ops([("lock", PATH, 0), ("insert", 0), ("release", 0)])
    rounds(sim, 4)
    for rank in sim.ranks:
        assert rank.core.stats.storage_written_pages == len(PATH)
    sim.apply_ops([("evict", 8)])
    for rank in sim.ranks:
        m = rank.core.match(tokens_for(PATH, PAGE, 0))
        assert m.device_pages + m.host_pages == 0


def lock_and_prefetch(sim: SimCluster) -> int:
    index = len(sim.ranks[0].leases)
    sim.apply_ops([("lock", PATH, 0), ("prefetch", index)])
    return sim.ranks[0].leases[index][0]


def test_prefetch_reads_the_agreed_hit_into_host_then_loads_back():
    sim = cluster()
    store_then_forget(sim)
    lease = lock_and_prefetch(sim)
    assert sim.ranks[0].core.prefetch_status(lease)[0] == "querying"
    rounds(sim, 3)
    for rank in sim.ranks:
        assert rank.core.prefetch_status(lease) == ("done", len(PATH))
        assert rank.core.match(tokens_for(PATH, PAGE, 0)).host_pages == len(PATH)
    sim.apply_ops([("load", 0)])
    rounds(sim, 2)
    for rank in sim.ranks:  # check() verified the bytes: every hit page holds its own data
        assert rank.core.match(tokens_for(PATH, PAGE, 0)).device_pages == len(PATH)


def test_a_commit_ticks_every_running_fetch_and_only_those_in_lease_order():
    sim = cluster()
    store_then_forget(sim)
    sim.apply_ops([("lock", (3, 3), 0)])  # a lease that fetches nothing
    first, second = lock_and_prefetch(sim), lock_and_prefetch(sim)
    core = sim.ranks[0].core
    assert [lease.lease_id for lease in core.prefetcher.running(core.book.table)] == [first, second]
    started = core.prefetcher.started.pop(second)  # a running fetch no commit would tick
    with pytest.raises(InvariantViolation, match="not among those a commit ticks"):
        check(core)
    core.prefetcher.started[second] = started
    rounds(sim, 3)  # done: the commits stop looking at them
    assert core.prefetcher.running(core.book.table) == [] and not core.prefetcher.started


def test_a_page_stored_on_only_one_rank_is_a_miss():
    sim = cluster(ranks=3)
    store_then_forget(sim)
    hashes = sim.ranks[0].core.tree.walk(as_token_bytes(tokens_for(PATH, PAGE, 0))).hashes
    del sim.ranks[2].io.storage[hashes[2]]  # rank 2 lost page 2
    lease = lock_and_prefetch(sim)
    rounds(sim, 3)
    for rank in sim.ranks:
        status, ready = rank.core.prefetch_status(lease)
        assert ready == 2  # the minimum over ranks: pages 0 and 1 only
        assert rank.core.match(tokens_for(PATH, PAGE, 0)).host_pages == 2


def test_short_reads_retry_paced_and_capped():
    sim = cluster(prefetch_max_attempts=2, prefetch_retry_rounds=3)
    store_then_forget(sim)
    lease = lock_and_prefetch(sim)
    hashes = [op.page_hashes for op in sim.ranks[0].core.inflight[OpKind.STORAGE_QUERY]][0]
    sim.round()  # query agreed: 4 pages
    for rank in sim.ranks:  # the storage loses page 1 everywhere before the read runs
        rank.io.storage.pop(hashes[1], None)
    sim.round()  # read lands only page 0
    core = sim.ranks[0].core
    assert core.prefetch_status(lease) == ("retry_wait", 1)
    queries_before = core.outbox.next_op
    sim.round()
    assert core.outbox.next_op == queries_before  # paced: no retry before the interval
    rounds(sim, 4)
    status, ready = core.prefetch_status(lease)
    assert status == "done" and ready == 1  # capped at 2 attempts; proceeds with what it has
    assert core.lease(lease).prefetch.attempts == 2


def test_release_during_prefetch_waits_and_ignores_the_stale_result():
    sim = cluster()
    store_then_forget(sim)
    lease = lock_and_prefetch(sim)
    sim.apply_ops([("release", 0)])
    core = sim.ranks[0].core
    assert lease in core.leases  # parked: its storage lookup is in flight
    rounds(sim, 3)
    assert lease not in core.leases
    assert core.stats.prefetch_stale_completions == 1
    assert core.host.used == 0  # nothing was read for a released request


def test_deferral_is_bounded_when_host_is_full():
    sim = cluster(prefetch_max_deferrals=2)
    store_then_forget(sim)
    # Fill the host pool with pinned pages: a lease holding 8 host-resident pages.
    sim.apply_ops([("lock", (3, 3, 3, 3), 0), ("insert", 0), ("lock", (2, 2, 2, 2), 0), ("insert", 1)])
    rounds(sim, 3)
    lease = lock_and_prefetch(sim)
    rounds(sim, 6)
    status, ready = sim.ranks[0].core.prefetch_status(lease)
    assert status == "done" and ready == 0
    assert sim.ranks[0].core.lease(lease).prefetch.deferrals == 2
    assert sim.ranks[0].core.stats.prefetch_rejected_host_full == 4  # counted (and logged)
    assert sim.ranks[0].core.admissible(lease, "wait_complete")


def test_stop_policies():
    sim = cluster()
    store_then_forget(sim)
    lease = lock_and_prefetch(sim)
    core = sim.ranks[0].core
    assert core.admissible(lease, "best_effort")
    assert not core.admissible(lease, "wait_complete")
    assert not core.admissible(lease, "timeout", timeout_rounds=1)
    sim.round()
    assert core.admissible(lease, "timeout", timeout_rounds=1) or core.prefetch_status(lease)[0] == "done"


STORAGE_OPS = (OpKind.STORAGE_QUERY, OpKind.STORAGE_READ, OpKind.STORAGE_WRITE)


def storage_goes_down(sim: SimCluster, lease: int, n: int) -> None:
    """The victim's storage goes away now; for ``n`` rounds after that, check that it is off on
    every rank, nothing counts as durable and no storage op is in flight (none issued since)."""
    sim.faults.storage_down_at = sim.now + 1
    for _ in range(n):
        rounds(sim, 1)
        for rank in sim.ranks:
            core = rank.core
            assert core.backup.storage_down and not core.closed
            assert not [n.node_id for n in core.tree.nodes.values() if n.storage_state == StorageState.DURABLE]
            assert not [k.name for k in STORAGE_OPS if core.inflight[k]]
    for rank in sim.ranks:
        assert rank.core.prefetch_status(lease)[0] == "done"  # admission waits for nothing
        assert rank.core.admissible(lease, "wait_complete")


@pytest.mark.parametrize("when", ["read_lands", "query_lands", "retry_wait", "deferred"])
def test_storage_going_down_with_a_fetch_under_way_leaves_nothing_durable_and_reads_nothing(when):
    sim = cluster(prefetch_max_deferrals=50)
    store_then_forget(sim)
    if when == "deferred":  # the host pool is full of pinned pages: the read waits for slots
        sim.apply_ops([("lock", (3, 3, 3, 3), 0), ("insert", 0), ("lock", (2, 2, 2, 2), 0), ("insert", 1)])
        rounds(sim, 3)
    lease = lock_and_prefetch(sim)
    core = sim.ranks[0].core
    hashes = core.inflight[OpKind.STORAGE_QUERY][0].page_hashes
    if when == "read_lands":  # its read landed on every rank in the round that agrees storage is off
        rounds(sim, 1)
        assert core.prefetch_status(lease)[0] == "reading"
    elif when == "retry_wait":  # a short read: the fetch waits to ask again
        rounds(sim, 1)
        for rank in sim.ranks:
            rank.io.storage.pop(hashes[1], None)
        rounds(sim, 1)
        assert core.prefetch_status(lease) == ("retry_wait", 1)
    elif when == "deferred":
        rounds(sim, 2)
        assert core.prefetch_status(lease)[0] == "deferred"
    storage_goes_down(sim, lease, 6)
    m = core.match(tokens_for(PATH, PAGE, 0))
    assert m.host_pages == {"read_lands": 4, "retry_wait": 1}.get(when, 0)  # what landed stays readable
