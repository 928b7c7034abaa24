"""The device path a storage prefetch hangs from stays pinned by its lease until the lease ends."""

from tpcache.core import CacheConfig, CacheCore, OpKind, check
from tpcache.core.hashing import as_token_bytes

P = 2


def toks(*pages: int) -> list[int]:
    return [v * 100 + d * 10 + i for d, v in enumerate(pages) for i in range(P)]


def fetching(core: CacheCore) -> int:
    """A lease locks a path the cache does not hold; then another request caches page 1 on device
    only (no host copy), and the first lease fetches pages 2 and 3 from storage under it."""
    lease, m = core.lock(toks(1, 2, 3))
    assert m.device_pages == 0
    other, _ = core.lock(toks(1))
    core.insert(other, toks(1), core.alloc(other, 1))
    core.release(other)
    assert core.prefetch(lease)
    core.complete(OpKind.STORAGE_QUERY, 2)  # agreed: storage holds pages 2 and 3
    assert core.inflight[OpKind.STORAGE_READ]
    return lease


def config() -> CacheConfig:
    return CacheConfig(page_size=P, device_pages=8, host_pages=8, write_policy="none", storage=True)


def test_fetched_host_pages_under_a_device_page_keep_it_pinned():
    core = CacheCore(config())
    lease = fetching(core)
    core.complete(OpKind.STORAGE_READ)  # landed: pages 2 and 3 on host, pinned by the lease
    check(core)  # page 1 would count as evictable while pinned host pages hold it on device
    first = core.tree.walk(as_token_bytes(toks(1))).nodes[0]
    assert first.device_pins == 1
    core.release(lease)
    check(core)
    assert first.device_pins == 0


def test_an_insert_over_fetched_pages_keeps_its_path_pinned_when_the_read_fails():
    core = CacheCore(config())
    lease = fetching(core)
    core.insert(lease, toks(1, 2, 3), [core.match(toks(1)).device_page_ids[0], *core.alloc(lease, 2)])
    core.complete(OpKind.STORAGE_READ, 0)  # the read failed somewhere: the host copies go
    check(core)  # the lease still pins the device page its inserted pages hang from
    core.release(lease)
    check(core)
