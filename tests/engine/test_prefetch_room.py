"""A storage prefetch when the host pool holds only mirrors of device pages (host pages equal to or
fewer than device pages, both pools full): it makes room through agreed mirror release."""

import pytest

from tests.engine.test_engine import check_hits, make, request, tokens
from tpcache.core import CacheConfig
from tpcache.io.storage import FileBackend
from tpcache.testing.waits import prefetched

PREFIXES = 12  # two pages each: three times what the device pool holds


def fetch(tp, toks) -> tuple[str, int]:
    lease, m = tp.lock(toks)
    try:
        if m.device_pages + m.host_pages < len(m.page_hashes):
            assert tp.prefetch(lease)
            return prefetched(tp, lease)
        return "resident", 0
    finally:
        tp.release(lease)
        tp.step()


@pytest.mark.parametrize("host_pages", [8, 4], ids=["host_equals_device", "host_below_device"])
def test_prefetch_frees_durable_mirrors_when_the_host_pool_holds_only_mirrors(tmp_path, host_pages):
    cfg = CacheConfig(page_size=16, device_pages=8, host_pages=host_pages, write_policy="write_through", storage=True)
    tp = make(cfg, storage=FileBackend(tmp_path, capacity_bytes=1 << 24, shard=(0, 1)))
    try:
        prefixes = [tokens(100 + i, 200 + i) for i in range(PREFIXES)]
        for toks in prefixes:
            request(tp, toks)
            tp.drain()  # its backup and write-out land before the next request needs device pages
        tp.drain()
        assert tp.core.stats.storage_written_pages == 2 * PREFIXES
        assert tp.core.host.available == 0  # the host pool is full, of mirrors of device pages
        served = 0
        for toks in prefixes:
            status = fetch(tp, toks)
            assert status[0] in ("resident", "done")
            assert status[1] in (0, 2)
            if status[0] == "done":
                assert status[1] == 2, f"a prefetch read nothing: {tp.core.stats}"
            assert check_hits(tp, toks) == 2  # every prefix is served, byte-exact
            served += 1
        assert served == PREFIXES
        assert tp.core.stats.mirrors_released_pages > 0
        assert tp.core.stats.prefetch_rejected_host_full == 0
    finally:
        tp.close()
