"""One rank with real KV tensors, transfers and storage: the shell path end to end."""

import threading
import time

import pytest
import torch

from tpcache.comm import SimGroup
from tpcache.core import CacheConfig
from tpcache.core.tiers import HostState
from tpcache.engine import TPCache
from tpcache.io.kv_pool import KVLayout
from tpcache.io.storage import FileBackend, MemoryBackend
from tpcache.testing.waits import HANG_GUARD_S, landed, prefetched, stepped_until

PAGE = 16
LAYOUT = KVLayout(num_layers=2, heads_per_rank=2, head_dim=8, dtype="float16", page_size=PAGE)


def make(config: CacheConfig, **kw) -> TPCache:
    return TPCache(config, SimGroup(1).collective(0), kv_layout=LAYOUT, **kw)


def content(page_hash: int) -> torch.Tensor:
    """The KV bytes an engine would compute for a page: a function of the page's identity."""
    g = torch.Generator().manual_seed(page_hash & 0x7FFFFFFF)
    return torch.randint(0, 256, (LAYOUT.page_bytes,), dtype=torch.uint8, generator=g)


def tokens(*pages: int) -> list[int]:
    return [v * 1000 + i for v in pages for i in range(PAGE)]


def request(tp: TPCache, toks: list[int], load: bool = True) -> tuple[int, int]:
    """An engine's request: lock, load host hits, compute KV for the rest, insert, release."""
    lease, m = tp.lock(toks)
    have = list(m.device_page_ids)
    if m.host_pages and load:
        result = tp.load(lease)
        have = result.device_pages
    elif m.host_pages:
        have = have[: m.device_pages]
    fresh = tp.alloc(lease, len(m.page_hashes) - len(have))
    for page, h in zip(fresh, m.page_hashes[len(have) :], strict=True):
        tp.device_pool.write_page(page, content(h))
    if m.host_pages and load:
        result.handle.wait(timeout=10)  # the KV of loaded pages is read by the forward pass
    tp.insert(lease, toks, have + fresh)
    tp.release(lease)
    tp.step()
    return m.device_pages, m.host_pages


def check_hits(tp: TPCache, toks: list[int]) -> int:
    m = tp.match(toks)
    for page, h in zip(m.device_page_ids, m.page_hashes, strict=False):
        assert torch.equal(tp.device_pool.read_page(page), content(h)), f"device page {page} holds wrong bytes"
    for node in (tp.core.tree.nodes[i] for i in m.nodes[m.device_pages :]):
        assert torch.equal(tp.host_pool.read_page(node.host_slot), content(node.hash)), "host slot holds wrong bytes"
    return m.device_pages + m.host_pages


def test_bytes_survive_device_host_device_cycles_under_pressure():
    tp = make(CacheConfig(page_size=PAGE, device_pages=8, host_pages=32, write_policy="write_through"))
    try:
        paths = [(i, i + 1, i + 2) for i in range(0, 30, 3)]
        host_hits = 0
        for _rnd in range(3):
            for path in paths:
                _, host = request(tp, tokens(*path))
                host_hits += host
                tp.drain()
                for other in paths:
                    check_hits(tp, tokens(*other))
        assert host_hits > 0  # pages really went to host and came back
        assert tp.core.stats.loads_done_pages > 0 and tp.core.stats.device_evicted_pages > 0
    finally:
        tp.close()


@pytest.mark.parametrize("cap,expected", [(0, 0), (256, 256), (-1, None)])
def test_retention_cap_seed_table(cap, expected):
    """Reference seed 000: write-through acks make tokens evictable after the cap was checked."""
    tp = make(CacheConfig(page_size=PAGE, device_pages=128, host_pages=128, retention_cap_tokens=cap))
    copies = threading.Event()  # the backups run only once the test lets them
    tp.shell.transfer._before_copy = lambda op, layer: copies.wait(30)
    try:
        request(tp, tokens(*range(60)))  # 960 tokens, protected while their backups are in flight
        request(tp, tokens(*range(100, 160)))
        assert tp.core.protected_device_tokens == 120 * PAGE and tp.core.evictable_device_tokens == 0
        copies.set()
        tp.drain()  # the acks land in a round; the cap is enforced in the same commit
        if expected is None:
            assert tp.core.evictable_device_tokens == 120 * PAGE  # unlimited keeps everything
        else:
            assert tp.core.evictable_device_tokens <= expected
        tp.set_retention_cap(0 if cap != 0 else 256)  # a runtime change applies at once
        assert tp.core.evictable_device_tokens <= (0 if cap != 0 else 256)
        assert check_hits(tp, tokens(*range(60))) == 60  # evicted from device, still on host
    finally:
        copies.set()
        tp.close()


def test_abort_waits_for_a_slow_load_before_freeing_its_pages():
    """Reference seed 004: the unwind must not free pages a copy still writes."""
    release_copy = threading.Event()
    events: list[str] = []

    def slow(op_id: int) -> float:
        return 0.0

    tp = make(CacheConfig(page_size=PAGE, device_pages=8, host_pages=16, write_policy="write_through"))
    try:
        request(tp, tokens(1, 2, 3))
        tp.drain()
        tp.core.evict_device(3)
        tp.shell.transfer._before_copy = lambda op, layer: (release_copy.wait(10), events.append(f"copy{layer}"))
        lease, m = tp.lock(tokens(1, 2, 3))
        assert m.host_pages == 3
        result = tp.load(lease)
        pages = result.device_pages
        assert tp.release(lease) is False  # admission failed: unwind; parked while the load runs
        for _ in range(3):
            tp.step()
            assert all(tp.core.device.is_owned(p) for p in pages)  # never handed back while copying
            assert lease in tp.core.leases
        release_copy.set()
        result.handle.wait(10)
        events.append("landed")
        tp.drain()
        assert lease not in tp.core.leases
        events.append("released")
        assert events.index("landed") < events.index("released")
        assert check_hits(tp, tokens(1, 2, 3)) == 3
    finally:
        release_copy.set()
        tp.close()


def run_mirror_scenario(mirror_release: bool) -> dict[str, int]:
    cfg = CacheConfig(
        page_size=PAGE,
        device_pages=32,
        host_pages=8,
        write_policy="write_through",
        storage=True,
        mirror_release=mirror_release,
    )
    tp = make(cfg, storage=MemoryBackend())
    try:
        for i in range(40):
            request(tp, tokens(2 * i, 2 * i + 1))
            tp.drain()  # copies land before the next request: the outcome does not depend on thread timing
        if mirror_release:  # the backup -> storage -> release pipeline settles
            stepped_until(
                tp,
                lambda: not tp.core.backup_backlog and not any(tp.core.inflight.values()),
                "backups and storage writes did not finish",
            )
        else:  # it never settles (backups wait for host room that never comes): rounds, each landing
            deadline = time.monotonic() + HANG_GUARD_S
            for _ in range(200):
                tp.step()
                landed(tp, deadline)
        return {
            k: tp.core.stats.__dict__[k]
            for k in ("inserted_pages", "backup_rejected_host_full", "storage_written_pages", "mirrors_released_pages")
        }
    finally:
        tp.close()


def test_mirror_release_ends_host_starvation():
    """Reference seed 002 in small: host pool smaller than device pool, write_through, storage on."""
    on, off = run_mirror_scenario(True), run_mirror_scenario(False)
    assert on["backup_rejected_host_full"] == 0
    assert on["storage_written_pages"] == on["inserted_pages"]  # 100% write-out
    assert on["mirrors_released_pages"] > 0
    assert off["backup_rejected_host_full"] > 0
    assert off["storage_written_pages"] < off["inserted_pages"]


def test_restarted_cache_gets_storage_hits_for_durable_pages_only(tmp_path):
    cfg = CacheConfig(page_size=PAGE, device_pages=16, host_pages=16, write_policy="write_through", storage=True)
    first = make(cfg, storage=FileBackend(tmp_path, capacity_bytes=1 << 24, shard=(0, 1)))
    try:
        request(first, tokens(1, 2, 3))
        first.drain()
        assert first.core.stats.storage_written_pages == 3
        # A second request reaches the device but is never stored: the process "dies" first.
        lease, m = first.lock(tokens(1, 2, 3, 4))
        fresh = first.alloc(lease, 1)
        first.device_pool.write_page(fresh[0], content(m.page_hashes[3]))
        first.insert(lease, tokens(1, 2, 3, 4), m.device_page_ids + fresh)
    finally:
        first.close()
    second = make(cfg, storage=FileBackend(tmp_path, capacity_bytes=1 << 24, shard=(0, 1)))
    try:
        lease, m = second.lock(tokens(1, 2, 3, 4))
        assert m.device_pages + m.host_pages == 0
        assert second.prefetch(lease)
        assert prefetched(second, lease) == ("done", 3)  # the durable pages, not page 4
        m = second.match(tokens(1, 2, 3, 4))
        assert m.host_pages == 3
        assert check_hits(second, tokens(1, 2, 3)) == 3  # byte-exact from storage
        for node_id in m.nodes:
            assert second.core.treecore.host(node_id)[0] == HostState.VALID
        second.release(lease)
    finally:
        second.close()


def test_a_rank_that_cannot_prepare_still_joins_the_round_and_everyone_closes():
    group = SimGroup(2)
    config = CacheConfig(page_size=PAGE, device_pages=8, write_policy="none")
    ranks = [TPCache(config, group.collective(r), round_timeout_s=5.0) for r in range(2)]

    def broken_poll() -> dict:
        raise RuntimeError("transfer engine lost its worker")

    ranks[1].shell.landed = broken_poll
    reports: list = [None, None]

    def run(r: int) -> None:
        reports[r] = ranks[r].step()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert group.calls == [1, 1]  # the failing rank still issued its one collective
    assert all(tp.core.closed for tp in ranks)
    assert "could not prepare" in ranks[1].core.closed_reason
    assert "unhealthy" in ranks[0].core.closed_reason


def test_a_request_sharing_another_requests_load_gets_its_handle():
    tp = make(CacheConfig(page_size=PAGE, device_pages=8, host_pages=16, write_policy="write_through"))
    try:
        request(tp, tokens(1, 2))
        tp.drain()
        tp.core.evict_device(2)
        a, _ = tp.lock(tokens(1, 2))
        b, _ = tp.lock(tokens(1, 2))
        first = tp.load(a)
        second = tp.load(b)  # starts nothing: the pages are already loading for a
        assert second.device_pages == first.device_pages
        assert second.handles == first.handles and second.handles
        second.wait_layer(LAYOUT.num_layers - 1, timeout=10)
        tp.drain()
        assert check_hits(tp, tokens(1, 2)) == 2
        for lease in (a, b):
            tp.release(lease)
    finally:
        tp.close()
