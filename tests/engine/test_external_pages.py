"""EngineCache: tpcache under an engine's own KV blocks, with real tensors, copies and storage.

The engine's KV here has vLLM's CPU layout, one tensor per layer [blocks, heads, block_size,
2 * head_dim]; the tests check the bytes that land in the engine's blocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tpcache.comm import SimGroup
from tpcache.core import CacheConfig, check
from tpcache.engine.external import EngineCache
from tpcache.integrations.vllm.layout import engine_kv_from_vllm
from tpcache.io.storage import MemoryBackend

PAGE, LAYERS, HEADS, DIM, BLOCKS = 16, 2, 2, 8, 12


def engine_kv(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}": torch.randn(BLOCKS, HEADS, PAGE, 2 * DIM, generator=g).to(torch.bfloat16) for i in range(LAYERS)
    }


def make(kv: dict[str, torch.Tensor], collective: Any = None, host_pages: int = 8, **kw: Any) -> EngineCache:
    adapter, layout, fmt = engine_kv_from_vllm(kv, BLOCKS, PAGE)
    config = CacheConfig(page_size=PAGE, device_pages=0, host_pages=host_pages)
    return EngineCache(config, collective or SimGroup(1).collective(0), adapter, layout, engine_format=fmt, **kw)


def toks(*pages: int) -> list[int]:
    return [p * 1000 + i for p in pages for i in range(PAGE)]


def block(kv: dict[str, torch.Tensor], b: int) -> list[torch.Tensor]:
    return [t[b].clone() for t in kv.values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def saved(cache: EngineCache, tokens: list[int], blocks: list[int]) -> None:
    lease, _ = cache.lock(tokens)
    cache.save(lease, tokens, blocks)
    cache.release(lease)
    cache.drain(pause_s=0)


def until_prefetched(cache: EngineCache, lease: int) -> None:
    """Rounds until the lease's storage prefetch is done (the storage worker runs on its own thread)."""
    deadline = time.monotonic() + 60
    while cache.prefetch_status(lease)[0] != "done":
        assert time.monotonic() < deadline, "the prefetch never finished"
        cache.step()
        time.sleep(0.001)


def test_saved_blocks_load_back_byte_for_byte_into_other_blocks() -> None:
    kv = engine_kv()
    cache = make(kv)
    want = [block(kv, b) for b in (3, 5, 7)]
    saved(cache, toks(1, 2, 3), [3, 5, 7])
    lease, hit = cache.lock(toks(1, 2, 3, 4))
    assert hit.host_pages == 3 and cache.hit_pages(lease) == 3
    op = cache.load_into(lease, 1, [0, 1])  # vLLM already holds page 0 itself
    assert cache.outcome(op) is None  # copied, not agreed yet
    cache.step()
    assert cache.outcome(op) == 2
    assert same(block(kv, 0), want[1]) and same(block(kv, 1), want[2])
    assert cache.release(lease)
    check(cache.core)
    assert cache.stats()["leases"] == 0


def test_a_failed_copy_is_agreed_as_failed_and_the_lease_waits_for_it() -> None:
    kv = engine_kv()
    fail = {"on": False}

    def before(op_id: int, direction: str) -> None:
        if fail["on"]:
            raise RuntimeError("disk on fire")

    cache = make(kv, before_copy=before)
    saved(cache, toks(1, 2), [0, 1])
    lease, _ = cache.lock(toks(1, 2))
    fail["on"] = True
    op = cache.load_into(lease, 0, [4, 5])
    assert not cache.release(lease)  # parked until the load is agreed
    cache.step()
    assert cache.outcome(op) == 0
    assert cache.stats()["leases"] == 0
    cache.request_flush()  # a failed copy is finished: nothing is in flight, the flush goes through
    cache.step()
    assert cache.health()["state"] == "open"


def test_a_held_completion_keeps_the_load_in_flight() -> None:
    kv = engine_kv()
    held = {"on": True}
    cache = make(kv, hold=lambda op_id, direction: held["on"] and direction == "h2d")
    saved(cache, toks(1), [0])
    lease, _ = cache.lock(toks(1))
    op = cache.load_into(lease, 0, [2])
    for _ in range(3):
        cache.step()
        assert cache.outcome(op) is None
    held["on"] = False
    cache.step()
    assert cache.outcome(op) == 1


def test_storage_serves_a_new_cache_with_the_same_bytes() -> None:
    kv = engine_kv(1)
    backend = MemoryBackend()
    first = make(kv, storage=backend)
    want = [block(kv, b) for b in (2, 9)]
    saved(first, toks(5, 6), [2, 9])
    first.drain(pause_s=0)
    assert first.stats()["storage_written_pages"] == 2
    other = engine_kv(2)
    second = make(other, storage=backend)  # a restart: empty host tier, same storage
    lease, hit = second.lock(toks(5, 6, 7))
    assert hit.host_pages == 0
    assert second.prefetch(lease)
    until_prefetched(second, lease)
    assert second.hit_pages(lease) == 2
    op = second.load_into(lease, 0, [10, 11])
    second.step()
    assert second.outcome(op) == 2
    assert same(block(other, 10), want[0]) and same(block(other, 11), want[1])


def test_another_engine_format_never_reads_the_stored_pages() -> None:
    backend = MemoryBackend()
    kv = engine_kv()
    saved(make(kv, storage=backend), toks(5), [2])
    wide = {f"layer{i}": torch.zeros(BLOCKS, HEADS, PAGE, 2 * DIM, dtype=torch.float16) for i in range(LAYERS)}
    cache = make(wide, storage=backend)
    lease, _ = cache.lock(toks(5))
    cache.prefetch(lease)
    until_prefetched(cache, lease)
    assert cache.hit_pages(lease) == 0


def run_ranks(body: Callable[[int, Any], Any], world: int = 2) -> list[Any]:
    group = SimGroup(world)
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank, group.collective(rank))
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def test_a_load_failing_on_one_rank_fails_on_every_rank() -> None:
    def body(rank: int, collective: Any) -> tuple[int | None, int]:
        kv = engine_kv(rank)  # each rank holds its own shard: different bytes

        def before(op_id: int, direction: str) -> None:
            if rank == 1 and direction == "h2d":
                raise RuntimeError("rank 1 cannot copy")

        cache = make(kv, collective, before_copy=before)
        saved(cache, toks(1, 2), [0, 1])
        lease, _ = cache.lock(toks(1, 2))
        op = cache.load_into(lease, 0, [6, 7])
        cache.step()
        cache.release(lease)
        cache.step()
        return cache.outcome(op), cache.stats()["leases"]

    assert run_ranks(body) == [(0, 0), (0, 0)]


def test_ranks_that_differ_serve_no_hit() -> None:
    """Rank 1 saves a page the others do not: the round finds the trees differ and closes the cache
    on every rank, so neither serves the pages it holds."""

    def body(rank: int, collective: Any) -> tuple[int, bool]:
        cache = make(engine_kv(rank), collective)
        lease, _ = cache.lock(toks(1, 2, 3))
        cache.save(lease, toks(1, 2, 3), [0, 1, 2])
        if rank == 1:
            cache.save(lease, toks(1, 2, 3, 4), [0, 1, 2, 3])
        cache.step()
        cache.step()
        return cache.match(toks(1, 2, 3)).host_pages, cache.core.closed

    assert run_ranks(body) == [(0, True), (0, True)]


def _engine_layer(model: torch.Tensor, tp: int, rank: int, order: str) -> torch.Tensor:
    """Rank ``rank`` of ``tp``'s slice of one layer of ``model`` ([blocks, heads, tokens, 2 * dim]),
    as vLLM hands it over: logical [blocks, heads, tokens, K and V], kept in ``order`` ("BHNC": as
    the CPU backend; "BNHC": heads inside tokens; "HBNC": heads outside blocks), here seen as int8."""
    heads = model.shape[1] // tp
    part = model[:, rank * heads : (rank + 1) * heads]
    if order == "BHNC":
        t = part.contiguous()
    elif order == "BNHC":
        t = part.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    else:
        t = part.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    return t.view(torch.int8)


def test_engine_pages_of_any_backend_order_and_tp_size_share_the_models_shards() -> None:
    """A TP=2 engine in one physical order writes its pages as the model's shards; a TP=1 engine in
    another order reads them into exactly the bytes its own block holds (and the other way)."""
    from tpcache.comm.parallel import Shard
    from tpcache.integrations.vllm.layout import model_page_view
    from tpcache.io.storage.keys import StorageKey
    from tpcache.io.storage.sharded import ModelShape, ShardedStorage

    g = torch.Generator().manual_seed(3)
    layers, heads, dim = 2, 4, 8
    model = [torch.randn(BLOCKS, heads, PAGE, 2 * dim, generator=g) for _ in range(layers)]

    def views(tp: int, order: str) -> list[tuple[Any, ShardedStorage]]:
        out = []
        for rank in range(tp):
            kv = {f"layer{i}": _engine_layer(model[i], tp, rank, order) for i in range(layers)}
            adapter, _, _ = engine_kv_from_vllm(kv, BLOCKS, PAGE)
            layout, view = model_page_view(kv, BLOCKS, PAGE, heads // tp, dim, torch.float32)
            shape = ModelShape.of_rank("tiny", layout, Shard(rank, tp))
            out.append((adapter, ShardedStorage(store, shape, Shard(rank, tp), layout, view)))
        return out

    def page_of(adapter: Any, b: int) -> torch.Tensor:
        host = torch.zeros(1, adapter.page_elems, dtype=adapter.dtype)
        adapter.save(host, [b], [0])
        return host[0]

    for writer, reader in (("BHNC", "BNHC"), ("HBNC", "BHNC")):
        for w_tp, r_tp in ((2, 1), (1, 2)):
            store = MemoryBackend()
            key = StorageKey("vllm", 1, 0, 1, 0x5EED)
            for adapter, storage in views(w_tp, writer):
                assert storage.put([key], [page_of(adapter, 5)]) == [True]
            for adapter, storage in views(r_tp, reader):
                out = torch.full((adapter.page_elems,), 7, dtype=adapter.dtype)
                assert storage.get([key], [out]) == [True]
                assert torch.equal(out, page_of(adapter, 5)), (writer, reader, w_tp, r_tp)


def test_an_engine_kv_that_is_not_whole_heads_of_k_then_v_is_refused_in_one_line() -> None:
    """Where the model's shards cannot be cut from vLLM's KV, the connector keeps a store per rank
    (and says why): the view refuses, naming the shape it found."""
    from tpcache.integrations.vllm.layout import model_page_view
    from tpcache.io.errors import KVLayoutError

    kv = engine_kv()  # bf16, [blocks, 2 heads, tokens, 2 * 8]
    with pytest.raises(KVLayoutError, match=r"not vLLM's \[blocks, KV heads, tokens, K and V\]"):
        model_page_view(kv, BLOCKS, PAGE, HEADS, DIM, torch.float8_e4m3fn)  # a quantized cache's dtype
    outer = {n: t.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0) for n, t in kv.items()}
    with pytest.raises(KVLayoutError, match="a token's K and V are not innermost"):
        model_page_view(outer, BLOCKS, PAGE, HEADS, DIM, torch.bfloat16)
    layout, _ = model_page_view(kv, BLOCKS, PAGE, HEADS, DIM, torch.bfloat16)
    assert (layout.num_layers, layout.heads_per_rank, layout.head_dim) == (LAYERS, HEADS, DIM)
