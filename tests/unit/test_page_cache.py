"""A match copies device page ids from per-run caches; every change of a page must reach them."""

from tpcache.core import CacheConfig, CacheCore, check
from tpcache.replay import drain

P = 2


def cache_path(core: CacheCore, tokens: list[int]) -> list[int]:
    lease, m = core.lock(tokens)
    pages = m.device_page_ids + core.alloc(lease, m.num_pages - m.device_pages - m.host_pages)
    core.insert(lease, tokens, pages)
    core.release(lease)
    drain(core)
    return pages


def test_a_page_loaded_back_into_another_device_page_is_matched_there() -> None:
    core = CacheCore(CacheConfig(page_size=P, device_pages=6, host_pages=8, write_policy="write_through"))
    chain = list(range(8))  # four pages, one run
    assert cache_path(core, chain) == [0, 1, 2, 3]
    assert core.match(chain).device_page_ids == [0, 1, 2, 3]  # the run's page cache is built
    assert core.evict_device(1) == 1  # the last page goes to host only; device page 3 is free
    other = [100, 101, 102, 103]
    assert cache_path(core, other) == [3, 4]  # page 3 is taken by another path
    lease, m = core.lock(chain)
    assert (m.device_pages, m.host_pages) == (3, 1)
    loaded = core.load(lease)
    drain(core)
    core.release(lease)
    m = core.match(chain)
    assert loaded == [0, 1, 2, 5] and m.device_page_ids == [0, 1, 2, 5]
    assert m.device_page_ids == core.treecore.device_pages(m.nodes)
    check(core)


def test_branching_and_pruning_keep_cached_pages_right() -> None:
    core = CacheCore(CacheConfig(page_size=P, device_pages=12, host_pages=0, write_policy="none"))
    a = list(range(10))
    cache_path(core, a)
    assert core.match(a).device_page_ids == [0, 1, 2, 3, 4]
    b = a[:4] + [50, 51, 52, 53]  # branches after two pages: the run is split
    cache_path(core, b)
    for tokens in (a, b, a[:6]):
        m = core.match(tokens)
        assert m.device_page_ids == core.treecore.device_pages(m.nodes[: m.device_pages])
    core.evict_device(12)
    for tokens in (a, b):
        assert core.match(tokens).device_page_ids == []
    assert cache_path(core, b) == core.treecore.device_pages(core.match(b).nodes)
    check(core)
