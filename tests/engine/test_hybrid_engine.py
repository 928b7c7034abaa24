"""A hybrid model's components with real tensors: full-attention pages, sliding-window pages and
Mamba states each in their own device and host pools, through transfers and storage, byte-exact."""

import threading

import pytest
import torch

from tpcache.comm import SimGroup
from tpcache.core import CacheConfig
from tpcache.core.treecore.components import DEV, DSLOT, HSLOT, STRIDE
from tpcache.engine import TPCache
from tpcache.io.kv_pool import KVLayout, state_layout
from tpcache.io.storage import FileBackend
from tpcache.testing.waits import prefetched, settled

PAGE = 16
FULL = KVLayout(num_layers=2, heads_per_rank=2, head_dim=8, dtype="float16", page_size=PAGE)
SWA = KVLayout(num_layers=3, heads_per_rank=1, head_dim=8, dtype="float16", page_size=PAGE)
MAMBA = state_layout(num_layers=2, bytes_per_layer=96)
LAYOUTS = {"swa": SWA, "mamba": MAMBA}
TAG = {"full": 0, "swa": 1, "mamba": 2}


def config(**kw) -> CacheConfig:
    base = dict(
        page_size=PAGE,
        device_pages=12,
        host_pages=64,
        write_policy="write_through",
        swa_window=2 * PAGE,
        swa_device_pages=8,
        swa_host_pages=64,
        mamba_every=2,
        mamba_state_bytes=MAMBA.page_bytes,
        mamba_device_states=6,
        mamba_host_states=64,
    )
    return CacheConfig(**{**base, **kw})


def make(cfg: CacheConfig, **kw) -> TPCache:
    return TPCache(cfg, SimGroup(1).collective(0), kv_layout=FULL, part_layouts=LAYOUTS, **kw)


def content(page_hash: int, name: str) -> torch.Tensor:
    """What an engine computes for one component of a page: a function of the page and component."""
    layout = {"full": FULL, "swa": SWA, "mamba": MAMBA}[name]
    g = torch.Generator().manual_seed((page_hash ^ TAG[name] * 0x9E3779B1) & 0x7FFFFFFF)
    return torch.randint(0, 256, (layout.page_bytes,), dtype=torch.uint8, generator=g)


def tokens(*pages: int) -> list[int]:
    return [v * 1000 + d * 10 + i for d, v in enumerate(pages) for i in range(PAGE)]


def request(tp: TPCache, toks: list[int]) -> tuple[int, int]:
    """An engine's request: lock, load what is on host, compute the rest of every component, insert."""
    lease, m = tp.lock(toks)
    have = list(m.device_page_ids)
    if m.host_pages:
        loaded = tp.load(lease)
        loaded.wait(timeout=10)  # the forward pass reads every loaded copy
        have = loaded.device_pages
    n = len(m.page_hashes)
    fresh = tp.alloc(lease, n - len(have))
    for page, h in zip(fresh, m.page_hashes[len(have) :], strict=True):
        tp.device_pool.write_page(page, content(h, "full"))
    parts = {}
    for spec in tp.config.components():
        at = [i for i in range(len(have), n) if not spec.every or (i + 1) % spec.every == 0]
        slots = tp.alloc(lease, len(at), spec.name)
        row = [-1] * n
        for i, slot in zip(at, slots, strict=True):
            tp.part_pools[spec.name][0].write_page(slot, content(m.page_hashes[i], spec.name))
            row[i] = slot
        parts[spec.name] = row
    tp.insert(lease, toks, have + fresh, parts)
    tp.release(lease)
    tp.step()
    return m.device_pages, m.host_pages


def check_hit(tp: TPCache, toks: list[int]) -> int:
    """Every page and every component copy the hit reads holds its own bytes; returns the hit."""
    m = tp.match(toks)
    for node in (tp.core.tree.nodes[i] for i in m.nodes):
        pool, slot = (tp.device_pool, node.device_page) if node.device_state == 2 else (tp.host_pool, node.host_slot)
        assert torch.equal(pool.read_page(slot), content(node.hash, "full")), f"page at depth {node.depth}"
    for spec in tp.config.components():
        device, host = tp.part_pools[spec.name]
        b = (spec.index - 1) * STRIDE
        for node in (tp.core.tree.nodes[i] for i in m.parts.get(spec.index, [])):
            on_device = node.comp[b + DEV] == 2
            pool, slot = (device, node.comp[b + DSLOT]) if on_device else (host, node.comp[b + HSLOT])
            assert torch.equal(pool.read_page(slot), content(node.hash, spec.name)), f"{spec.name} at {node.depth}"
    return m.device_pages + m.host_pages


def test_components_survive_device_host_device_cycles_under_pressure():
    tp = make(config())
    try:
        paths = [tokens(k, *range(1, 6)) for k in range(6)]  # 6 pages each; pools hold about 2 paths
        for toks in paths:
            request(tp, toks)
            settled(tp)  # its backups land: its SWA copies on device become evictable
        hits = 0
        for toks in paths + paths:
            dev, host = request(tp, toks)  # hits from device or loaded back from host, verified below
            hits += host
            settled(tp)
            assert check_hit(tp, toks) == 6
        assert hits > 0 and tp.core.stats.part_loads_issued > 0
        assert tp.core.stats.swa_released_pages > 0  # SWA behind each request's window was freed
    finally:
        tp.close()


def test_a_restarted_cache_serves_every_component_from_storage(tmp_path):
    cfg = config(storage=True)
    first = make(cfg, storage=FileBackend(tmp_path, capacity_bytes=1 << 24, shard=(0, 1)))
    try:
        request(first, tokens(1, 2, 3, 4))
        settled(first)
        assert first.core.stats.storage_written_pages == 4
    finally:
        first.close()
    second = make(cfg, storage=FileBackend(tmp_path, capacity_bytes=1 << 24, shard=(0, 1)))
    try:
        lease, m = second.lock(tokens(1, 2, 3, 4, 5))
        assert m.device_pages + m.host_pages == 0
        assert second.prefetch(lease)
        prefetched(second, lease)
        assert second.match(tokens(1, 2, 3, 4)).host_pages == 4  # the window's SWA and the state came too
        assert check_hit(second, tokens(1, 2, 3, 4)) == 4  # byte-exact from storage, every component
        loaded = second.load(lease)
        loaded.wait(timeout=10)
        settled(second)
        assert second.match(tokens(1, 2, 3, 4)).device_pages == 4
        assert check_hit(second, tokens(1, 2, 3, 4)) == 4
        assert sorted(second.part_slots(lease)) == ["mamba", "swa"]
        second.release(lease)
    finally:
        second.close()


def test_component_layouts_must_match_the_configuration():
    with pytest.raises(ValueError, match="needs its layout"):
        TPCache(config(), SimGroup(1).collective(0), kv_layout=FULL, part_layouts={"swa": SWA})
    wrong = KVLayout(num_layers=1, heads_per_rank=1, head_dim=8, dtype="float16", page_size=PAGE // 2)
    with pytest.raises(ValueError, match="page size"):
        TPCache(config(), SimGroup(1).collective(0), kv_layout=FULL, part_layouts={"swa": wrong, "mamba": MAMBA})
    with pytest.raises(ValueError, match="bytes a state"):
        make(config(mamba_state_bytes=MAMBA.page_bytes + 2))


def test_ranks_with_different_component_layouts_close_in_their_first_round():
    group = SimGroup(2)
    deeper = KVLayout(num_layers=4, heads_per_rank=1, head_dim=8, dtype="float16", page_size=PAGE)
    other = {"swa": deeper, "mamba": MAMBA}
    ranks = [
        TPCache(config(), group.collective(0), kv_layout=FULL, part_layouts=LAYOUTS),
        TPCache(config(), group.collective(1), kv_layout=FULL, part_layouts=other),
    ]
    try:
        threads = [threading.Thread(target=tp.step) for tp in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert all(tp.core.closed and "layout differs" in tp.core.closed_reason for tp in ranks)
    finally:
        for tp in ranks:
            tp.close()
