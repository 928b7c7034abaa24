"""Leases along their path: load after prefetch, shared loads, flush across live leases, closed cache."""

import pytest

from tpcache.comm.collective import elementwise_min
from tpcache.core import CacheConfig, CacheCore, OpKind, OutOfPages, check
from tpcache.core.round import Round
from tpcache.replay import drain as replay_drain
from tpcache.testing.ops import take_transfers

P = 2


def toks(*pages: int) -> list[int]:
    return [v * 100 + d * 10 + i for d, v in enumerate(pages) for i in range(P)]


def drain(core: CacheCore) -> None:
    replay_drain(core)  # every completion agreed, as a one-rank round would
    check(core)


def cached(core: CacheCore, tokens: list[int]) -> None:
    lease, m = core.lock(tokens)
    core.insert(lease, tokens, m.device_page_ids + core.alloc(lease, m.num_pages - m.device_pages))
    core.release(lease)


def test_load_after_prefetch_returns_the_path_pages_once():
    for policy in ("none", "write_through"):
        core = CacheCore(CacheConfig(page_size=P, device_pages=16, host_pages=8, write_policy=policy, storage=True))
        cached(core, toks(1, 2))
        drain(core)
        if policy == "write_through":
            core.evict_device(1)  # page 2 now on host only: the fetch hangs from a host page
        full = toks(1, 2, 3, 4)
        lease, _ = core.lock(full)
        assert core.prefetch(lease)
        core.complete(OpKind.STORAGE_QUERY, 2)  # agreed: pages 3 and 4 are in storage
        core.complete(OpKind.STORAGE_READ)
        check(core)
        pages = core.load(lease)
        drain(core)
        assert len(pages) == 4 and len(set(pages)) == 4
        assert core.match(full).device_page_ids == pages
        core.release(lease)
        check(core)


def test_a_page_another_request_is_loading_is_shared_not_skipped():
    core = CacheCore(CacheConfig(page_size=P, device_pages=16, host_pages=16, write_policy="write_through"))
    cached(core, toks(1, 2, 3))
    drain(core)
    core.evict_device(3)
    a, _ = core.lock(toks(1, 2))
    b, _ = core.lock(toks(1, 2, 3))
    pages_a = core.load(a)
    pages_b = core.load(b)  # page 1 and 2 are loading for A: B shares them, loads nothing below
    assert pages_b == pages_a
    assert core.lease(b).ops == core.lease(a).ops
    core.complete(OpKind.LOAD, acked_pages=1)  # page 2's load failed on some rank
    check(core)
    assert core.match(toks(1, 2, 3)).device_pages == 1
    for lease in (a, b):
        core.release(lease)
    check(core)


def test_flush_keeps_live_leases_and_their_pages():
    cfg = CacheConfig(page_size=P, device_pages=8, write_policy="none")
    core, rnd = CacheCore(cfg), None
    rnd = Round(core)
    x, _ = core.lock(toks(1))
    x_pages = core.alloc(x, 2)  # the engine may still be writing KV into these
    core.request_flush()
    report = rnd.commit(rnd.prepare(1, {}, 0, True))
    assert report.flushed and not core.closed
    y, _ = core.lock(toks(2))
    assert y != x  # ids keep counting: a stale id never names a new lease
    y_pages = core.alloc(y, 2)
    assert not set(y_pages) & set(x_pages)
    core.release(x)
    assert core.lease(y) and all(core.device.is_owned(p) for p in y_pages)
    check(core)


def test_flush_needs_every_rank_to_ask():
    cfg = CacheConfig(page_size=P, device_pages=8, write_policy="none")
    cores = [CacheCore(cfg), CacheCore(cfg)]
    rounds = [Round(c) for c in cores]
    cores[0].request_flush()  # the request reached rank 0 only
    reduced = elementwise_min([r.prepare(1, {}, 0, True) for r in rounds])
    reports = [r.commit(reduced) for r in rounds]
    assert not any(rep.flushed for rep in reports)
    assert all(c.closed for c in cores)


def test_a_refused_alloc_evicts_nothing():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, write_policy="none"))
    cached(core, toks(1, 2, 3))
    lease, _ = core.lock(toks(9))
    with pytest.raises(OutOfPages):
        core.alloc(lease, 9)
    assert core.match(toks(1, 2, 3)).device_pages == 3


def test_a_closed_cache_starts_no_copies_and_admits_waiting_requests():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8, storage=True))
    cached(core, toks(1, 2))
    core.close("test")
    take_transfers(core)
    core.complete(OpKind.BACKUP)  # the backup lands after the close: no storage write follows
    assert take_transfers(core) == []
    lease, _ = core.lock(toks(1, 2, 3))
    assert core.admissible(lease, "wait_complete")
