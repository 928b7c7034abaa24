"""A storage hit served through lock, prefetch and load is counted once its load lands on every
rank (tier storage), only for the pages that landed, and never twice."""

from tpcache.core import CacheConfig, CacheCore, OpKind, check

P = 2


def toks(*pages: int) -> list[int]:
    return [v * 100 + d * 10 + i for d, v in enumerate(pages) for i in range(P)]


def loading(core: CacheCore, lease: int) -> bool:
    """Whether a load the lease waits for is in flight (what the service's load reply waits on)."""
    loads = {op.op_id for op in core.inflight[OpKind.LOAD]}
    return any(op in loads for op in core.lease(lease).ops)


def fresh_core() -> CacheCore:
    """A core restarted over a storage tier: nothing cached, storage answers for itself."""
    cfg = {"page_size": P, "device_pages": 8, "host_pages": 8, "write_policy": "write_through", "storage": True}
    return CacheCore(CacheConfig(**cfg))


def read_to_host(core: CacheCore, tokens: list[int], hit: int) -> int:
    """lock ``tokens`` (a miss) and prefetch: storage holds ``hit`` pages, every read lands."""
    lease, m = core.lock(tokens)
    assert m.device_pages == m.host_pages == 0
    assert core.prefetch(lease)
    core.complete(OpKind.STORAGE_QUERY, hit)
    core.after_commit()
    core.complete(OpKind.STORAGE_READ)
    core.after_commit()
    assert core.prefetch_status(lease) == ("done", hit)
    return lease


def test_a_lock_counts_its_storage_pages_once_their_load_landed() -> None:
    core = fresh_core()
    lease = read_to_host(core, toks(1, 2, 3), hit=2)
    assert core.stats.storage_hit_tokens == 0  # read to host: not served yet
    pages = core.load(lease)
    assert len(pages) == 2 and loading(core, lease)
    assert core.stats.storage_hit_tokens == 0  # issued, not landed
    core.complete(OpKind.LOAD)
    core.after_commit()
    assert not loading(core, lease)
    s = core.stats
    assert (s.storage_hit_tokens, s.lock_storage_hit_tokens) == (2 * P, 2 * P)
    assert s.host_hit_tokens == s.device_hit_tokens == 0
    assert core.load(lease) == pages and not loading(core, lease)  # nothing more to load: counted once
    assert core.stats.storage_hit_tokens == 2 * P
    core.release(lease)
    check(core)


def test_only_the_pages_that_landed_are_counted() -> None:
    core = fresh_core()
    lease = read_to_host(core, toks(1, 2, 3), hit=3)
    assert len(core.load(lease)) == 3
    core.complete(OpKind.LOAD, 1)  # the copy failed on some rank after the first page
    core.after_commit()
    assert core.stats.storage_hit_tokens == P
    core.release(lease)
    check(core)


def test_a_later_lock_of_the_served_pages_is_a_device_hit() -> None:
    core = fresh_core()
    lease = read_to_host(core, toks(1, 2), hit=2)
    core.load(lease)
    core.complete(OpKind.LOAD)
    core.after_commit()
    core.release(lease)
    again, m = core.lock(toks(1, 2))
    assert m.device_pages == 2
    assert (core.stats.storage_hit_tokens, core.stats.device_hit_tokens) == (2 * P, 2 * P)
    core.release(again)
    check(core)
