"""The CUDA path of engine-owned device pages: vLLM-style KV tensors on the GPU (the FlashAttention
layout, K and V apart), pinned host pages, and storage, checked byte for byte."""

from __future__ import annotations

import pytest
import torch

from tpcache.comm import SimGroup
from tpcache.core import CacheConfig
from tpcache.engine.external import EngineCache
from tpcache.integrations.vllm.layout import engine_kv_from_vllm
from tpcache.io.storage import MemoryBackend
from tpcache.testing.waits import prefetched

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PAGE, LAYERS, HEADS, DIM, BLOCKS = 16, 3, 4, 64, 32


def gpu_kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (2, BLOCKS, PAGE, HEADS, DIM)  # [K/V, blocks, block_size, heads, head_dim]
    return {f"l{i}": torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16) for i in range(LAYERS)}


def make(kv: dict[str, torch.Tensor], storage: MemoryBackend | None = None) -> EngineCache:
    adapter, layout, fmt = engine_kv_from_vllm(kv, BLOCKS, PAGE)
    config = CacheConfig(page_size=PAGE, device_pages=0, host_pages=16)
    return EngineCache(config, SimGroup(1).collective(0), adapter, layout, engine_format=fmt, storage=storage)


def toks(*pages: int) -> list[int]:
    return [p * 1000 + i for p in pages for i in range(PAGE)]


def blocks_of(kv: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [t[:, ids].clone() for t in kv.values()]


def test_cuda_blocks_round_trip_through_pinned_host_pages() -> None:
    kv = gpu_kv(0)
    cache = make(kv)
    assert cache.host_pool is not None and cache.host_pool.pinned
    want = blocks_of(kv, [4, 9, 17])
    lease, _ = cache.lock(toks(1, 2, 3))
    cache.save(lease, toks(1, 2, 3), [4, 9, 17])
    cache.release(lease)
    cache.drain(pause_s=0)
    lease, hit = cache.lock(toks(1, 2, 3))
    assert hit.host_pages == 3
    op = cache.load_into(lease, 0, [0, 1, 2])
    cache.step()
    assert cache.outcome(op) == 3
    torch.cuda.synchronize()
    for got, exp in zip(blocks_of(kv, [0, 1, 2]), want, strict=True):
        assert torch.equal(got, exp)
    cache.release(lease)
    cache.close()


def test_cuda_pages_come_back_from_storage() -> None:
    backend = MemoryBackend()
    kv = gpu_kv(1)
    first = make(kv, backend)
    want = blocks_of(kv, [3, 5])
    lease, _ = first.lock(toks(7, 8))
    first.save(lease, toks(7, 8), [3, 5])
    first.release(lease)
    first.drain(pause_s=0)
    other = gpu_kv(2)
    second = make(other, backend)
    lease, _ = second.lock(toks(7, 8))
    assert second.prefetch(lease)
    prefetched(second, lease)
    op = second.load_into(lease, 0, [10, 11])
    second.step()
    assert second.outcome(op) == 2
    torch.cuda.synchronize()
    for got, exp in zip(blocks_of(other, [10, 11]), want, strict=True):
        assert torch.equal(got, exp)
