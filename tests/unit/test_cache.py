import pytest

from tpcache.core import CacheClosed, CacheConfig, CacheCore, OpKind, OutOfPages, check
from tpcache.core.tiers import DeviceState, HostState
from tpcache.replay import drain as replay_drain
from tpcache.testing.ops import take_transfers

P = 4  # page size


def toks(*pages: int, tail: int = 0) -> list[int]:
    """Token ids: one page of 4 tokens per value, plus an optional partial tail."""
    out = []
    for v in pages:
        out += [v * 10 + i for i in range(P)]
    return out + [9999] * tail


def put(core: CacheCore, tokens: list[int]) -> int:
    """A request's life: lock the prefix, allocate the rest, insert, release. Returns hit pages."""
    lease, m = core.lock(tokens)
    full = len(m.page_hashes)
    fresh = core.alloc(lease, full - m.device_pages)
    core.insert(lease, tokens, m.device_page_ids + fresh)
    core.release(lease)
    check(core)
    return m.device_pages


def drain(core: CacheCore) -> None:
    """What a round's commit does on one rank (apply every completion, enforce the cap), checked."""
    replay_drain(core)
    check(core)


def test_insert_then_match_hits_only_full_pages():
    core = CacheCore(CacheConfig(page_size=P, device_pages=16, write_policy="none"))
    assert put(core, toks(1, 2, tail=3)) == 0
    m = core.match(toks(1, 2, 3))
    assert (m.device_pages, m.host_pages) == (2, 0)
    assert core.match(toks(1, 5)).device_pages == 1
    assert core.match(toks(2)).device_pages == 0
    assert put(core, toks(1, 2, 3)) == 2


def test_match_is_pure():
    core = CacheCore(CacheConfig(page_size=P, device_pages=16, write_policy="none"))
    put(core, toks(1, 2))
    before = (core.digest.value, core.clock, core.stats.lookups)
    core.match(toks(1, 2))
    core.match(toks(7))
    assert (core.digest.value, core.clock, core.stats.lookups) == before


def test_eviction_takes_deepest_page_of_least_recent_leaf_and_exactly_what_is_needed():
    core = CacheCore(CacheConfig(page_size=P, device_pages=6, write_policy="none"))
    put(core, toks(1, 2, 3))  # older path
    put(core, toks(4, 5, 6))  # newer path; pool is full
    assert core.device.available == 0
    put(core, toks(7))  # needs one page
    assert core.match(toks(1, 2, 3)).device_pages == 2  # only page 3 of the oldest path went
    assert core.match(toks(4, 5, 6)).device_pages == 3
    assert core.stats.device_evicted_pages == 1
    put(core, toks(1, 2, 3))  # refresh the old path: now path 4-5-6 is the oldest
    assert core.match(toks(4, 5, 6)).device_pages == 2


def test_pinned_pages_are_never_evicted():
    core = CacheCore(CacheConfig(page_size=P, device_pages=4, write_policy="none"))
    put(core, toks(1, 2))
    lease, m = core.lock(toks(1, 2))
    assert m.device_pages == 2
    core.alloc(lease, 2)  # takes the two free pages
    other, _ = core.lock(toks(8))
    with pytest.raises(OutOfPages):
        core.alloc(other, 1)  # everything is pinned
    assert core.match(toks(1, 2)).device_pages == 2
    core.release(lease)
    core.release(other)
    check(core)
    assert core.device.available == 2


def test_insert_refuses_pages_the_lease_does_not_hold():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, write_policy="none"))
    lease, _ = core.lock(toks(1))
    with pytest.raises(ValueError, match="not held"):
        core.insert(lease, toks(1), [5])
    check(core)


def test_duplicate_pages_go_back_to_the_lease_and_are_freed_on_release():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, write_policy="none"))
    a, _ = core.lock(toks(1, 2))
    b, _ = core.lock(toks(1, 2))
    pa, pb = core.alloc(a, 2), core.alloc(b, 2)
    assert core.insert(a, toks(1, 2), pa) == (2, 0)
    assert core.insert(b, toks(1, 2), pb) == (0, 2)
    core.release(a)
    core.release(b)
    check(core)
    assert core.device.used == 2


def test_write_through_backs_up_and_protects_until_the_copy_is_agreed():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8, write_policy="write_through"))
    put(core, toks(1, 2))
    effects = take_transfers(core)
    assert [e.kind for e in effects] == [OpKind.BACKUP] and effects[0].num_pages == 2
    assert core.evictable_device_tokens == 0 and core.protected_device_tokens == 2 * P
    node = core.tree.nodes[core.match(toks(1)).nodes[0]]
    assert node.host_state == HostState.WRITING
    assert core.match(toks(1, 2)).host_pages == 0
    core.complete(OpKind.BACKUP)
    check(core)
    assert node.host_state == HostState.VALID
    assert core.evictable_device_tokens == 2 * P


def test_partial_ack_keeps_only_the_acked_prefix():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8, write_policy="write_through"))
    put(core, toks(1, 2, 3))
    core.complete(OpKind.BACKUP, acked_pages=1)
    check(core)
    states = [core.tree.nodes[i].host_state for i in core.match(toks(1, 2, 3)).nodes]
    assert states == [HostState.VALID, HostState.NONE, HostState.NONE]
    assert core.host.used == 1


def test_load_back_from_host_becomes_valid_only_when_agreed():
    core = CacheCore(CacheConfig(page_size=P, device_pages=4, host_pages=8, write_policy="write_through"))
    put(core, toks(1, 2))
    drain(core)
    core.evict_device(2)
    check(core)
    m = core.match(toks(1, 2))
    assert (m.device_pages, m.host_pages) == (0, 2)
    lease, m = core.lock(toks(1, 2))
    pages = core.load(lease)
    assert len(pages) == 2
    assert [core.tree.nodes[i].device_state for i in m.nodes] == [DeviceState.LOADING] * 2
    assert core.match(toks(1, 2)).device_pages == 0  # loading is not readable
    [op] = take_transfers(core)
    assert op.kind == OpKind.LOAD and op.device_pages == pages
    core.complete(OpKind.LOAD)
    assert core.match(toks(1, 2)).device_pages == 2
    core.release(lease)
    check(core)


def test_release_waits_for_in_flight_loads_into_its_pages():
    """Reference seed 004: abort after a load started must not free what the copy writes."""
    core = CacheCore(CacheConfig(page_size=P, device_pages=4, host_pages=8, write_policy="write_through"))
    put(core, toks(1, 2))
    drain(core)
    core.evict_device(2)
    lease, _ = core.lock(toks(1, 2))
    pages = core.load(lease)
    assert core.release(lease) is False  # parked: the load is in flight
    check(core)
    assert all(core.device.is_owned(p) for p in pages)
    assert core.evict_device(4) == 0  # loading pages cannot be evicted either
    core.complete(OpKind.LOAD)
    assert lease not in core.leases
    check(core)
    assert core.match(toks(1, 2)).device_pages == 2


def test_failed_load_drops_the_device_copy_and_keeps_host():
    core = CacheCore(CacheConfig(page_size=P, device_pages=4, host_pages=8, write_policy="write_through"))
    put(core, toks(1, 2))
    drain(core)
    core.evict_device(2)
    lease, _ = core.lock(toks(1, 2))
    core.load(lease)
    core.complete(OpKind.LOAD, acked_pages=1)
    check(core)
    m = core.match(toks(1, 2))
    assert (m.device_pages, m.host_pages) == (1, 1)
    core.release(lease)
    check(core)


@pytest.mark.parametrize("cap,expected", [(0, 0), (2 * P, 2 * P), (-1, 6 * P)])
def test_retention_cap_holds_after_copies_complete(cap, expected):
    """Reference seed 000: acks make tokens evictable; the cap must hold after they apply."""
    cfg = CacheConfig(page_size=P, device_pages=16, host_pages=16, retention_cap_tokens=cap)
    core = CacheCore(cfg)
    put(core, toks(1, 2, 3))
    put(core, toks(4, 5, 6))
    assert core.evictable_device_tokens == 0  # all protected by their in-flight backups
    drain(core)  # the acks land, then the cap is enforced
    assert core.evictable_device_tokens == expected
    assert core.match(toks(1, 2, 3)).host_pages + core.match(toks(1, 2, 3)).device_pages == 3


def test_runtime_cap_change_applies_at_once():
    core = CacheCore(CacheConfig(page_size=P, device_pages=16, write_policy="none"))
    put(core, toks(1, 2, 3))
    assert core.evictable_device_tokens == 3 * P
    core.set_retention_cap(P)
    assert core.evictable_device_tokens == P
    check(core)


def test_write_back_backs_up_on_eviction_then_frees():
    cfg = CacheConfig(page_size=P, device_pages=2, host_pages=4, write_policy="write_back")
    core = CacheCore(cfg)
    put(core, toks(1, 2))
    assert take_transfers(core) == []
    assert core.evict_device(1) == 0  # no host copy yet: back up first
    [op] = take_transfers(core)
    assert op.kind == OpKind.BACKUP
    drain(core)
    assert core.evict_device(2) == 1  # page 2 had its copy: freed; page 1 is backed up first
    drain(core)
    assert core.evict_device(1) == 1
    m = core.match(toks(1, 2))
    assert (m.device_pages, m.host_pages) == (0, 2)
    check(core)


def test_selective_write_through_after_threshold_hits():
    cfg = CacheConfig(
        page_size=P,
        device_pages=8,
        host_pages=8,
        write_policy="write_through_selective",
        write_through_threshold=2,
    )
    core = CacheCore(cfg)
    put(core, toks(1, 2))
    put(core, toks(1, 2))
    assert take_transfers(core) == []
    put(core, toks(1, 2))
    [op] = take_transfers(core)
    assert op.num_pages == 2
    check(core)


def test_closed_cache_serves_misses_and_refuses_writes():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, write_policy="none"))
    put(core, toks(1, 2))
    core.close("state digest mismatch")
    assert core.match(toks(1, 2)).device_pages == 0
    lease, m = core.lock(toks(1, 2))
    assert m.device_pages == 0
    with pytest.raises(CacheClosed, match="digest"):
        core.alloc(lease, 1)
    core.release(lease)
    core.reset(core.outbox.next_op, core.book.next_lease)
    assert not core.closed and core.match(toks(1, 2)).device_pages == 0
    check(core)


def test_digest_tracks_structure_and_tier_state():
    def build(host: bool) -> CacheCore:
        core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8 if host else 0))
        put(core, toks(1, 2))
        put(core, toks(1, 3))
        return core

    a, b = build(True), build(True)
    assert a.digest.value == b.digest.value
    a.complete(OpKind.BACKUP)
    assert a.digest.value != b.digest.value  # same tree, different host state
    b.complete(OpKind.BACKUP)
    assert a.digest.value == b.digest.value
    c = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8))
    put(c, toks(1, 3))
    put(c, toks(1, 2))
    assert c.digest.value != a.digest.value  # different order, different pages and stamps


def test_a_pool_of_more_pages_than_int32_ids_is_refused_naming_the_setting():
    for name in ("device_pages", "host_pages"):  # page ids and host slots are int32 wherever they are held
        with pytest.raises(ValueError, match=f"^{name} must be at most 2147483647 "):
            CacheCore(CacheConfig(**{name: 2**31}))
    CacheConfig(device_pages=2**31 - 1, host_pages=2**31 - 1).validate()
