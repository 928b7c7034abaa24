"""Buffer-only host mode at TP=2 with real KV tensors, transfers and storage: host slots only stage
pages between device and storage, nothing is served from host, and every staging slot is freed."""

import threading
import time
from typing import Any

import torch

from tpcache.comm import SimGroup
from tpcache.core import CacheConfig
from tpcache.engine import TPCache
from tpcache.io.kv_pool import KVLayout
from tpcache.io.storage import MemoryBackend
from tpcache.testing.waits import HANG_GUARD_S, landed

PAGE = 16
LAYOUT = KVLayout(num_layers=2, heads_per_rank=2, head_dim=8, dtype="float16", page_size=PAGE)
PROMPT = [v * 1000 + i for v in (1, 2, 3) for i in range(PAGE)] + [7] * 5  # 3 full pages and a tail


def content(rank: int, page_hash: int) -> torch.Tensor:
    """The KV bytes of one rank's shard of a page: different on each rank."""
    g = torch.Generator().manual_seed((page_hash + rank * 7919) & 0x7FFFFFFF)
    return torch.randint(0, 256, (LAYOUT.page_bytes,), dtype=torch.uint8, generator=g)


def settle(tp: TPCache) -> None:
    """Wait until every copy and storage op this rank started has landed, so the next round sees
    them: the prefetch's round-paced retries and deferrals then count rounds, not the machine's
    speed (a starved storage thread cannot make it give up)."""
    landed(tp, time.monotonic() + HANG_GUARD_S)


def admit(tp: TPCache, rank: int, seen: list[int]) -> Any:
    """An engine's admission: select, materialize until ready (one round per scheduler step), commit,
    compute the rest, insert, release. ``seen``: host slots in use and host pages matched, each step."""
    lease, m = tp.admit(PROMPT)
    seen.append(m.host_pages)
    for _ in range(64):
        out = tp.materialize(lease, tp.select(lease))
        seen += [tp.match(PROMPT).host_pages]
        if out.status == "ready":
            break
        settle(tp)
        tp.step()
    assert out.status == "ready"
    admitted = tp.commit(lease)
    hashes = tp.match(PROMPT).page_hashes
    for page, h in zip(admitted.device_page_ids, hashes, strict=False):  # the hit holds this rank's shard
        assert torch.equal(tp.device_pool.read_page(page), content(rank, h)), f"rank {rank}: page {page} is wrong"
    fresh = tp.alloc(lease, len(hashes) - admitted.hit_pages)
    for page, h in zip(fresh, hashes[admitted.hit_pages :], strict=True):
        tp.device_pool.write_page(page, content(rank, h))
    tp.insert(lease, PROMPT, admitted.device_page_ids + fresh)
    tp.release(lease)
    tp.drain()
    return admitted


def body(rank: int, collective: Any) -> dict:
    config = CacheConfig(page_size=PAGE, device_pages=8, host_pages=2, host_mode="buffer", write_policy="write_through")
    backend = MemoryBackend()
    tp = TPCache(config, collective, kv_layout=LAYOUT, storage=backend)
    seen: list[int] = []
    try:
        first = admit(tp, rank, seen)  # nothing cached: computed, then staged through host to storage
        after_first = (tp.core.host.used, tp.core.stats.storage_written_pages, backend.stats()["records"])
        tp.core.evict_device(8)  # alike on both ranks: only storage holds the prefix now
        second = admit(tp, rank, seen)
        stats = tp.stats()
        return {
            "first": first.hit_pages,
            "second": (second.hit_pages, second.storage_tokens, second.host_tokens),
            "after_first": after_first,
            "host_used": tp.core.host.used,
            "host_hits_seen": max(seen),
            "stats": {k: stats[k] for k in ("host_hit_tokens", "storage_hit_tokens", "staging_freed_pages", "closed")},
        }
    finally:
        tp.close()


def test_buffer_mode_at_tp2_never_serves_from_host_and_frees_its_staging_slots():
    group = SimGroup(2)
    out: list[Any] = [None, None]

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank, group.collective(rank))
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for result in out:
        assert not isinstance(result, Exception), repr(result)
    assert out[0] == out[1]  # the same agreed outcome on both ranks (their bytes differ)
    r = out[0]
    assert r["first"] == 0
    assert r["after_first"] == (0, 3, 3)  # 3 pages durable; a 2-slot staging pool carried them and is empty
    # a 2-slot staging pool reads 2 of the 3 stored pages (the rest is computed), counted at commit
    assert r["second"] == (2, 2 * PAGE, 0)
    assert r["host_hits_seen"] == 0 and r["host_used"] == 0
    assert r["stats"] == {
        "host_hit_tokens": 0,
        "storage_hit_tokens": 2 * PAGE,
        "staging_freed_pages": 3 + 2 + 1,  # 3 pages written, 2 read back, the recomputed one written again
        "closed": 0,
    }
