"""A PP x TP group on real rank processes (see ``group.run_group``): slices, storage, a killed rank.

The model's KV of a page is a function of the page alone (``model_page``); each rank stores only its
slice of it (its stage's layers, its tensor rank's heads), cut from that tensor by the rank's place
in the group. A rank that read another rank's slice, or the right slice of another page, would see
other values, so every byte check below also checks that slices never cross.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tpcache.comm.collective import Collective
from tpcache.comm.parallel import ParallelGroup, Shard
from tpcache.core import CacheConfig
from tpcache.engine import TPCache
from tpcache.io.kv_pool import KVLayout
from tpcache.io.storage import file_url
from tpcache.testing.ops import tokens_for
from tpcache.testing.registry import scenario

PAGE = 4
LAYERS, HEADS, HEAD_DIM = 4, 4, 8  # the whole model's: every rank of PP2 x TP2 holds 2 layers x 2 heads
GROUP = ParallelGroup(pp_size=2, tp_size=2)
PATHS = [(1, 2, 3), (4, 5, 6)]


def model_page(page_hash: int) -> torch.Tensor:
    """Every layer's K and V of every KV head of one page: ``[layers, 2, page, heads, head_dim]``."""
    g = torch.Generator().manual_seed(page_hash & 0x7FFFFFFFFFFFFFFF)
    return torch.randn((LAYERS, 2, PAGE, HEADS, HEAD_DIM), generator=g)


def _span(shard: Shard) -> tuple[slice, slice, slice, slice]:
    """Where the rank at ``shard`` sits in a ``model_page``: its stage's layers, its tensor rank's heads."""
    layers, heads = LAYERS // shard.pp_size, HEADS // shard.tp_size
    every = slice(None)
    return (
        slice(shard.pp_rank * layers, (shard.pp_rank + 1) * layers),
        every,
        every,
        slice(shard.tp_rank * heads, (shard.tp_rank + 1) * heads),
    )


def rank_slice(page_hash: int, shard: Shard) -> torch.Tensor:
    """The part of ``model_page`` the rank at ``shard`` holds, in its pool's canonical page order."""
    return model_page(page_hash)[_span(shard)].contiguous()


def _cache(collective: Collective, storage_dir: str, round_timeout_s: float) -> TPCache:
    layout = KVLayout.from_model(LAYERS, HEADS, HEAD_DIM, GROUP.tp_size, "float32", PAGE, pp_size=GROUP.pp_size)
    config = CacheConfig(page_size=PAGE, device_pages=16, host_pages=16, write_policy="write_through")
    return TPCache(
        config,
        collective,
        kv_layout=layout,
        storage=file_url(storage_dir),
        group=GROUP,
        round_timeout_s=round_timeout_s,
    )


def _check_slices(tp: TPCache, device_pages: list[int], hashes: list[int]) -> None:
    for page, h in zip(device_pages, hashes, strict=True):
        got = tp.device_pool.read_page(page).view(torch.float32).view(tp.kv_layout.page_shape)
        if not torch.equal(got, rank_slice(h, tp.shard)):
            raise AssertionError(f"rank {tp.rank} ({tp.shard.label}): device page {page} holds another slice's bytes")


def _damage(storage_dir: str, rank: int, key: str) -> int:
    """Flip one payload byte of every record of ``key`` in rank ``rank``'s segments (a record is its
    header, the key's encoding, then the payload); returns how many were damaged."""
    damaged = 0
    for seg in sorted((Path(storage_dir) / f"rank{rank}").rglob("*.seg")):
        data = bytearray(seg.read_bytes())
        at = data.find(key.encode())
        while at >= 0:
            data[at + len(key) + 5] ^= 0xFF
            damaged += 1
            at = data.find(key.encode(), at + 1)
        seg.write_bytes(bytes(data))
    return damaged


@scenario
def pp_tp_group(
    rank: int,
    world: int,
    collective: Collective,
    storage_dir: str,
    damage_rank: int,
    kill_rank: int,
    round_timeout_s: float = 2.0,
) -> dict[str, Any]:
    """Write two paths through device, host and storage; restart the caches on the same storage after
    ``damage_rank`` damaged its slice of page 1 of the first path; read both back from storage to host
    to device and check every slice, then reassemble whole pages from the four slices; finally
    ``kill_rank`` dies and the survivors must close, serving misses."""
    tp = _cache(collective, storage_dir, round_timeout_s)
    for path in PATHS:
        toks = tokens_for(path, PAGE, 0)
        lease, m = tp.lock(toks)
        fresh = tp.alloc(lease, m.num_pages)
        for page, h in zip(fresh, m.page_hashes, strict=True):
            tp.device_pool.write_page(page, rank_slice(h, tp.shard))
        tp.insert(lease, toks, fresh)
        tp.release(lease)
        tp.step()
    tp.drain()
    written = tp.core.stats.storage_written_pages
    hashes = [tp.match(tokens_for(path, PAGE, 0)).page_hashes for path in PATHS]
    key = tp.shell.key_of(hashes[0][1]).encode()  # this rank's key of page 1 of the first path
    tp.shell.close()
    tp.storage.close()
    damaged = _damage(storage_dir, rank, key) if rank == damage_rank else 0

    tp = _cache(collective, storage_dir, round_timeout_s)  # empty device and host: only storage holds pages
    ready = []
    for path, path_hashes in zip(PATHS, hashes, strict=True):
        lease, m = tp.lock(tokens_for(path, PAGE, 0))
        assert m.device_pages == m.host_pages == 0
        tp.prefetch(lease)
        for _ in range(10_000):
            if tp.prefetch_status(lease)[0] == "done":
                break
            tp.step()
        ready.append(tp.prefetch_status(lease)[1])
        loaded = tp.load(lease)
        loaded.wait(timeout=30)
        tp.drain()
        _check_slices(tp, loaded.device_pages, path_hashes[: len(loaded.device_pages)])
        tp.release(lease)
        tp.step()
    # The four slices of each page of the second path together are the whole page.
    m = tp.match(tokens_for(PATHS[1], PAGE, 0))
    mine = torch.stack([tp.device_pool.read_page(p) for p in m.device_page_ids])
    slices = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(slices, mine)
    for i, h in enumerate(m.page_hashes):
        whole = torch.empty((LAYERS, 2, PAGE, HEADS, HEAD_DIM))
        for r, got in enumerate(slices):
            whole[_span(GROUP.place(r))] = got[i].view(torch.float32).view(tp.kv_layout.page_shape)
        if not torch.equal(whole, model_page(h)):
            raise AssertionError(f"page {i} of the second path does not reassemble from its four slices")
    storage = tp.storage.stats()
    stats = tp.stats()

    if rank == kill_rank:
        os._exit(3)  # a crash on one stage: no goodbye, no cleanup
    for _ in range(50):
        tp.step()
        if tp.core.closed:
            break
    after = tp.match(tokens_for(PATHS[1], PAGE, 0))
    result = {
        "written": written,
        "damaged": damaged,
        "ready": ready,
        "misses_corrupt": storage["misses_corrupt"],
        "prefetch_hit_pages": stats["prefetch_hit_pages"],
        "holds": tp.group.describe(rank, tp.kv_layout.num_layers, tp.kv_layout.heads_per_rank),
        "health": tp.health(),
        "hit_after_kill": after.device_pages + after.host_pages,
    }
    tp.shell.close()
    tp.storage.close()
    return result
