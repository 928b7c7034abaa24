"""Each consistency promise (docs/design/architecture.md, "Guarantees"), held by a test that fails when it is broken."""

import copy
from array import array

import pytest

from tpcache.comm.collective import elementwise_min
from tpcache.comm.shm import ShmCollective
from tpcache.core import CacheConfig, CacheCore, InvariantViolation, OpKind, OutOfPages, ReadyNotAdvanced, check
from tpcache.core.hashing import as_token_bytes
from tpcache.core.round import Round
from tpcache.core.tiers import DeviceState, HostState, StorageState
from tpcache.core.treecore.accounting import record_of
from tpcache.core.treecore.eviction import LRU, is_device_candidate
from tpcache.replay import drain
from tpcache.testing.ops import take_transfers

P = 2


def toks(*pages: int) -> list[int]:
    return [v * 100 + d * 10 + i for d, v in enumerate(pages) for i in range(P)]


def cached(core: CacheCore, tokens: list[int]) -> int:
    lease, m = core.lock(tokens)
    core.insert(lease, tokens, m.device_page_ids + core.alloc(lease, m.num_pages - m.device_pages))
    core.release(lease)
    return lease


# ---------------------------------------------------------------- the state digest


@pytest.mark.parametrize(
    "field,value",
    [
        ("device_state", DeviceState.LOADING),
        ("device_page", 7),
        ("host_state", HostState.WRITING),
        ("host_slot", 3),
        ("storage_state", StorageState.DURABLE),
        ("device_pins", 1),
        ("host_pins", 1),
        ("last_access", 99),
        ("hits", 5),
        ("created_at", 42),
    ],
)
def test_every_field_that_decides_a_hit_a_page_or_an_eviction_is_in_the_record(field, value):
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, write_policy="none"))
    cached(core, toks(1))
    (node,) = [n for n in core.tree.nodes.values() if n.parent is not None]
    other = copy.copy(node)
    setattr(other, field, value)
    assert record_of(other) != record_of(node)


@pytest.mark.parametrize("field,value", [("last_access", 1234), ("hits", 9), ("device_pins", 3)])
def test_a_field_changed_behind_the_ledgers_back_fails_the_check(field, value):
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, write_policy="none"))
    cached(core, toks(1, 2))
    check(core)
    node = next(n for n in core.tree.nodes.values() if n.parent is not None)
    before = core.digest.value
    setattr(node, field, value)
    assert core.digest.value == before  # the digest cannot know ...
    with pytest.raises(InvariantViolation):
        check(core)  # ... but the check recomputes every record from the fields


# ---------------------------------------------------------------- the round


def _two_ranks(config: CacheConfig) -> tuple[list[CacheCore], list[Round]]:
    cores = [CacheCore(config), CacheCore(config)]
    return cores, [Round(c) for c in cores]


def test_completions_are_not_applied_when_queue_digests_differ():
    cores, rounds = _two_ranks(CacheConfig(page_size=P, device_pages=8, host_pages=8, write_policy="write_through"))
    for core in cores:
        cached(core, toks(1, 2))
    ops = [take_transfers(c)[0] for c in cores]
    landed = {ops[0].op_id: ops[0].num_pages}
    vectors = [r.prepare(2, landed, 0, True) for r in rounds]
    i = rounds[1].layout.index("backup.queue_digest")
    vectors[1][2 * i] += 1  # rank 1 believes another op is in flight on this queue
    vectors[1][2 * i + 1] -= 1
    reduced = elementwise_min(vectors)
    reports = [r.commit(reduced) for r in rounds]
    for core, report in zip(cores, reports, strict=True):
        assert core.closed and "backup queues differ" in core.closed_reason
        assert not report.completed and len(core.inflight[OpKind.BACKUP]) == 1  # nothing applied
        assert all(core.treecore.host(i)[0] == HostState.WRITING for i in core.inflight[OpKind.BACKUP][0].nodes)


def test_a_health_bit_on_any_rank_closes_every_rank():
    cores, rounds = _two_ranks(CacheConfig(page_size=P, device_pages=8))
    reduced = elementwise_min([rounds[0].prepare(0, {}, 0, True), rounds[1].prepare(0, {}, 1, True)])
    for core, rnd in zip(cores, rounds, strict=True):
        rnd.commit(reduced)
        assert core.closed and "unhealthy" in core.closed_reason


def test_the_shared_memory_transport_reduces_to_the_minimum():
    group = ShmCollective.local_group(3)
    try:
        vectors = [[5, -5, 1], [2, -2, 9], [7, -7, 4]]
        for c, v in zip(group, vectors, strict=True):
            c.publish(array("q", v))
        results = [c.collect(array("q", v), 5.0) for c, v in zip(group, vectors, strict=True)]
        assert results == [array("q", [2, -7, 1])] * 3
    finally:
        for c in group:
            c.close()


# ---------------------------------------------------------------- eviction


def test_within_equal_stamps_the_deepest_page_is_evicted_first():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, write_policy="none"))
    cached(core, toks(1, 2, 3))
    shallow, _, deep = sorted((n for n in core.tree.nodes.values() if n.parent is not None), key=lambda n: n.depth)
    shallow.last_access = deep.last_access = 5  # equal stamps: only the tie-break decides
    assert LRU().key(deep) < LRU().key(shallow)


def test_a_candidate_below_a_host_only_chain_is_offered_when_the_chain_is_unpinned():
    """A device page whose candidacy hangs on host-only pages two levels down must be re-offered
    when the deeper page is unpinned, or the retention cap cannot be held."""
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8, write_policy="write_back"))
    cached(core, toks(1, 2, 3))
    for _ in range(4):  # write back pages 3 then 2 and drop their device copies: they stay on host
        core.evict_device(1)
        drain(core)
    x, c, d = ([core.tree.nodes[i] for i in core.match(toks(1, 2, 3)).nodes] + [None] * 3)[:3]
    assert x.device_state == DeviceState.VALID and x.host_state == HostState.NONE
    assert c.device_state == DeviceState.NONE and d.host_state == HostState.VALID
    lease, m = core.lock(toks(1, 2, 3))  # pins x on device, c and d on host
    core.release(lease)  # unpins x first (d still pinned: x no candidate), then c, then d
    check(core)  # every candidate has its heap entry
    assert is_device_candidate(x)
    core.set_retention_cap(0)
    assert core.evictable_device_tokens == 0


# ---------------------------------------------------------------- refusals and ordering


def test_insert_adopts_nothing_below_a_page_that_is_still_loading():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8, write_policy="write_through"))
    cached(core, toks(1, 2))
    drain(core)
    core.evict_device(2)
    lease, m = core.lock(toks(1, 2, 3))
    assert m.host_pages == 2
    pages = core.load(lease)
    fresh = core.alloc(lease, 1)
    inserted, _ = core.insert(lease, toks(1, 2, 3), pages + fresh)
    assert inserted == 0  # page 3 would hang below loading pages
    assert [n.device_state for n in core.tree.walk(as_token_bytes(toks(1, 2))).nodes] == [DeviceState.LOADING] * 2
    core.complete(OpKind.LOAD, 0)  # the load failed on some rank: the loading pages go
    check(core)
    assert core.match(toks(1, 2, 3)).device_pages == 0


@pytest.mark.parametrize("policy", ["none", "write_through", "write_through_selective", "write_back"])
def test_a_refused_alloc_evicts_nothing_under_every_write_policy(policy):
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=4, write_policy=policy))
    for first in range(4):
        cached(core, toks(first, 9))
    drain(core)
    before = [(n.node_id, n.device_state, n.host_state) for n in core.tree.nodes.values()]
    lease, _ = core.lock(toks(7))
    with pytest.raises(OutOfPages):
        core.alloc(lease, 9 if policy != "write_back" else 8)
    after = [(n.node_id, n.device_state, n.host_state) for n in core.tree.nodes.values() if n.device_page >= 0]
    assert {(i, d) for i, d, _ in after} == {(i, d) for i, d, _ in before if d != DeviceState.NONE}
    check(core)


def test_write_back_alloc_succeeds_once_the_write_backs_it_started_land():
    core = CacheCore(CacheConfig(page_size=P, device_pages=4, host_pages=8, write_policy="write_back"))
    cached(core, toks(1, 2))
    cached(core, toks(3, 4))
    lease, _ = core.lock(toks(5))
    with pytest.raises(OutOfPages, match="written back"):
        core.alloc(lease, 2)  # every device page is dirty: nothing can be freed now
    assert core.device.used == 4 and core.inflight[OpKind.BACKUP]
    drain(core)  # the write-backs land: those pages are clean now
    assert len(core.alloc(lease, 2)) == 2
    check(core)


def test_ready_is_handed_out_once_until_advanced():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8))
    cached(core, toks(1))
    ready = core.ready()
    assert [op.kind for op in ready.transfers] == [OpKind.BACKUP]
    with pytest.raises(ReadyNotAdvanced):
        core.ready()
    core.advance()
    assert not core.ready()
    core.advance()
    with pytest.raises(ReadyNotAdvanced):
        core.advance()


def test_a_rank_that_gave_up_on_a_round_and_its_late_peer_both_close_for_good():
    """Rank 1 stalls past the timeout: rank 0 gives up on the round; rank 1 arrives late and finds
    the round abandoned. Both close for good, agree on the rounds issued, and refuse a flush."""
    from tpcache.engine.driver import Driver, GroupBroken
    from tpcache.engine.shell import Shell

    group = ShmCollective.local_group(2)
    config = CacheConfig(page_size=P, device_pages=8)
    drivers = [Driver(CacheCore(config), Shell(), group[r], rank=r, round_timeout_s=0.2) for r in range(2)]
    try:
        drivers[0].step()  # rank 1 is stalled: rank 0 times out
        drivers[1].step()  # rank 1 resumes and joins a round rank 0 abandoned
        for d in drivers:
            assert d.broken is not None and "restarted" in d.core.closed_reason
            with pytest.raises(GroupBroken, match="restart the group"):
                d.request_flush()
        assert drivers[0].round.number == drivers[1].round.number
        for d in drivers:
            d.step()  # later rounds fail at once, on both, and keep counting alike
        assert drivers[0].round.number == drivers[1].round.number == 2
    finally:
        for c in group:
            c.close()


# ---------------------------------------------------------------- divergences the round must see


def _diverged(config: CacheConfig, setup, diverge) -> list[CacheCore]:
    """Two ranks run ``setup`` alike, then rank 1 alone suffers ``diverge`` (state changed behind
    the operations' back, as a bug or a lost update would); one round runs. Returns the cores."""
    cores, rounds = _two_ranks(config)
    held = [setup(core) for core in cores]
    assert cores[0].state_digest() == cores[1].state_digest()
    diverge(cores[1], held[1])
    reduced = elementwise_min([r.prepare(0, {}, 0, True) for r in rounds])
    for r in rounds:
        r.commit(reduced)
    return cores


def _alloc_two(core: CacheCore) -> int:
    lease, _ = core.lock(toks(1))
    core.alloc(lease, 2)
    return lease


def _other_page(core: CacheCore, lease_id: int) -> None:
    """The lease holds another device page than its peer's lease (same count, same clock)."""
    pages = core.lease(lease_id).pages
    pages.remove(pages[-1])
    pages.append(max(pages) + 3)
    core.book.refresh(core.lease(lease_id))


def _admitted(core: CacheCore) -> int:
    lease, _ = core.admit(toks(1, 2), prefetch=False)
    return lease


def _admission_deferred(core: CacheCore, lease_id: int) -> None:
    core.lease(lease_id).admission.deferrals += 1  # one rank deferred the request once more
    core.book.refresh(core.lease(lease_id))


def _prefetch_state(core: CacheCore, lease_id: int) -> None:
    from tpcache.core.records import PrefetchState

    lease = core.lease(lease_id)
    lease.prefetch = PrefetchState(lease.tokens, status="done")  # one rank believes a storage lookup ran
    core.book.refresh(lease)


def _backlogged(core: CacheCore) -> None:
    cached(core, toks(1, 2, 3))
    assert len(core.backup_backlog) >= 2  # one host slot: the other pages wait for one


def _backlog_reordered(core: CacheCore, _held) -> None:
    backlog = core.backup_backlog
    first = next(iter(backlog))
    backlog[first] = backlog.pop(first)  # the same pages wait, in another order: another page goes next


@pytest.mark.parametrize(
    "config,setup,diverge",
    [
        pytest.param(
            CacheConfig(page_size=P, device_pages=8, write_policy="none"),
            lambda core: cached(core, toks(1, 2)),
            lambda core, _: setattr(core.evictor, "retention_cap_tokens", 2),
            id="retention-cap",
        ),
        pytest.param(
            CacheConfig(page_size=P, device_pages=8, write_policy="none"), _alloc_two, _other_page, id="lease-pages"
        ),
        pytest.param(
            CacheConfig(page_size=P, device_pages=8, write_policy="none"),
            _admitted,
            _admission_deferred,
            id="lease-admission",
        ),
        pytest.param(
            CacheConfig(page_size=P, device_pages=8, write_policy="none"),
            _admitted,
            _prefetch_state,
            id="lease-prefetch",
        ),
        pytest.param(
            CacheConfig(page_size=P, device_pages=8, host_pages=1, write_policy="write_through"),
            _backlogged,
            _backlog_reordered,
            id="backup-backlog",
        ),
    ],
)
def test_state_that_decides_what_comes_next_is_in_the_state_digest(config, setup, diverge):
    """Ranks that differ in the retention cap (which pages stay), a lease's pages or its admission
    and prefetch state (what the request gets), or the backup backlog (which page is backed up
    next) would act differently while open: the round's state digest sees it and both close."""
    for core in _diverged(config, setup, diverge):
        assert core.closed and "state_digest differs" in core.closed_reason


def test_a_health_bit_every_rank_reports_alike_still_closes_every_rank():
    cores, rounds = _two_ranks(CacheConfig(page_size=P, device_pages=8))
    vectors = [r.prepare(0, {}, 1, True) for r in rounds]
    assert vectors[0] == vectors[1]  # unanimous: the bits agree, and they say unhealthy
    reduced = elementwise_min(vectors)
    for core, rnd in zip(cores, rounds, strict=True):
        report = rnd.commit(reduced)
        assert core.closed and "unhealthy" in core.closed_reason and "health" in report.mismatches


def test_a_flush_waits_while_the_ranks_hold_different_leases():
    cores, rounds = _two_ranks(CacheConfig(page_size=P, device_pages=8, write_policy="none"))
    for core in cores:
        cached(core, toks(1))
    cores[1].lock(toks(1))  # rank 1 holds a lease rank 0 does not: a flush would keep it on one rank only
    for core in cores:
        core.request_flush()
    reduced = elementwise_min([r.prepare(0, {}, 0, True) for r in rounds])
    for core, rnd in zip(cores, rounds, strict=True):
        report = rnd.commit(reduced)
        assert not report.flushed and "leases" in report.mismatches
        assert core.closed and core.tree.nodes  # nothing dropped: the cache stays closed until the leases agree
