"""Scenarios for real rank processes (see ``group.run_group``).

Every rank draws the same operation stream from the shared seed (what rank 0's sequencing gives
the service), while its copies finish with rank-local jitter. Each rank writes KV bytes that are a
function of (page, rank), like a real TP shard, and checks the bytes behind every hit.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Any

import torch

from tpcache.comm.collective import Collective
from tpcache.core import CacheConfig, UnknownLease
from tpcache.core.hashing import as_token_bytes
from tpcache.engine import TPCache
from tpcache.io.kv_pool import KVLayout
from tpcache.testing.ops import apply, random_op, tokens_for
from tpcache.testing.registry import rank_rng, scenario
from tpcache.testing.waits import prefetched

PAGE = 4
LAYOUT = KVLayout(num_layers=2, heads_per_rank=1, head_dim=8, dtype="float32", page_size=PAGE)


def shard_bytes(page_hash: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((page_hash ^ (rank * 0x9E3779B97F4A7C15)) & 0x7FFFFFFFFFFFFFFF)
    return torch.randint(0, 256, (LAYOUT.page_bytes,), dtype=torch.uint8, generator=g)


def check_hit_bytes(tp: TPCache, toks: list[int]) -> tuple[int, int, list[int]]:
    m = tp.match(toks)
    for page, h in zip(m.device_page_ids, m.page_hashes, strict=False):
        if not torch.equal(tp.device_pool.read_page(page), shard_bytes(h, tp.rank)):
            raise AssertionError(f"rank {tp.rank}: device page {page} is a hit but holds other bytes")
    slots = tp.core.treecore.host_slots(m.nodes[m.device_pages :])
    for slot, h in zip(slots, m.page_hashes[m.device_pages :], strict=False):
        if not torch.equal(tp.host_pool.read_page(slot), shard_bytes(h, tp.rank)):
            raise AssertionError(f"rank {tp.rank}: host slot {slot} is a hit but holds other bytes")
    return m.device_pages, m.host_pages, list(m.device_page_ids)


@scenario
def random_workload(
    rank: int,
    world: int,
    collective: Collective,
    seed: int = 0,
    steps: int = 60,
    jitter_s: float = 0.002,
    diverge_at: int | None = None,
    die_at: int | None = None,
    round_timeout_s: float = 30.0,
    exit_hard: bool = False,
) -> dict[str, Any]:
    config = CacheConfig(page_size=PAGE, device_pages=24, host_pages=24, write_policy="write_through")
    jitter = rank_rng(seed, rank)
    tp = TPCache(
        config,
        collective,
        kv_layout=LAYOUT,
        round_timeout_s=round_timeout_s,
        transfer_delay=lambda op_id: jitter.random() * jitter_s,
    )
    rng = random.Random(seed)
    leases: list[tuple[int, list[int]]] = []
    probes = []

    def write_kv(page: int, page_hash: int) -> None:
        tp.device_pool.write_page(page, shard_bytes(page_hash, rank))

    closed_at = None
    try:
        for step in range(steps):
            for _ in range(rng.randint(0, 3)):
                apply(tp, random_op(rng, PAGE), leases, write_kv)
            if diverge_at == step and rank == world - 1:
                tp.core.ledger.tick()  # a silent local difference
            if die_at == step and rank == world - 1:
                os._exit(3)  # a crash: no goodbye, no cleanup
            tp.step()
            if tp.core.closed and closed_at is None:
                closed_at = step
            probe = tokens_for(tuple(rng.randrange(4) for _ in range(rng.randint(1, 6))), PAGE, 0)
            probes.append(check_hit_bytes(tp, probe))
        for lease, _ in leases:
            with contextlib.suppress(UnknownLease):
                tp.release(lease)
        tp.drain()
        stats = tp.stats()
        return {
            "digest": tp.core.digest.value,
            "closed": tp.core.closed_reason,
            "closed_at": closed_at,
            "probes": probes,
            "rounds": tp.round.number,
            "calls": collective.calls,
            "transport": collective.name,
            "loads": stats["loads_done_pages"],
            "backups": stats["backups_done_pages"],
            "leases": stats["leases"],
        }
    finally:
        tp.shell.close()


@scenario
def storage_restart(
    rank: int, world: int, collective: Collective, storage_dir: str, phase: str, lose_on_rank: int | None = None
) -> dict[str, Any]:
    """Phase "write": cache two paths and make them durable, then a third that never reaches
    storage. Phase "read" (a new group on the same directory): prefetch all three; optionally one
    rank first loses a page of the first path."""
    from tpcache.engine import layout_version
    from tpcache.io.storage import FileBackend, StorageKey

    config = CacheConfig(page_size=PAGE, device_pages=32, host_pages=32, write_policy="write_through", storage=True)
    backend = FileBackend(storage_dir, capacity_bytes=1 << 26, shard=(rank, world))
    tp = TPCache(config, collective, kv_layout=LAYOUT, storage=backend, round_timeout_s=30.0)
    paths = [(1, 2, 3), (1, 2, 4), (5, 6, 7)]
    try:
        if phase == "write":
            for path in paths[:2]:
                toks = tokens_for(path, PAGE, 0)
                lease, m = tp.lock(toks)
                have = m.device_page_ids
                fresh = tp.alloc(lease, m.num_pages - len(have))
                for page, h in zip(fresh, m.page_hashes[len(have) :], strict=True):
                    tp.device_pool.write_page(page, shard_bytes(h, rank))
                tp.insert(lease, toks, have + fresh)
                tp.release(lease)
                tp.step()
            tp.drain()
            # The third path reaches device only: the process "dies" before any backup lands.
            toks = tokens_for(paths[2], PAGE, 0)
            lease, m = tp.lock(toks)
            fresh = tp.alloc(lease, m.num_pages)
            for page, h in zip(fresh, m.page_hashes, strict=True):
                tp.device_pool.write_page(page, shard_bytes(h, rank))
            return {"durable": tp.core.stats.storage_written_pages}
        if lose_on_rank == rank:
            hashes = tp.core.tree.walk(as_token_bytes(tokens_for(paths[0], PAGE, 0))).hashes
            key = StorageKey(config.namespace, layout_version(LAYOUT), rank, world, hashes[1])
            backend.delete([key])  # this rank lost page 1 of the first path
        ready = []
        for path in paths:
            toks = tokens_for(path, PAGE, 0)
            lease, _ = tp.lock(toks)
            tp.prefetch(lease)
            ready.append(prefetched(tp, lease)[1])
            check_hit_bytes(tp, toks)  # every host hit holds this rank's bytes for that page
            tp.release(lease)
            tp.step()
        return {"ready": ready, "digest": tp.core.digest.value}
    finally:
        tp.close()


@scenario
def connector_settings(
    rank: int,
    world: int,
    collective: Collective,
    readings: list[int | None],
    extra: dict[str, Any] | None = None,
    rank_extra: dict[str, dict[str, Any]] | None = None,
    agree: bool = True,
    keys: list[str] | None = None,
) -> dict[str, Any]:
    """The vLLM connector's start-up agreement over a real group: each rank reads ``readings[rank]``
    bytes of free memory, holds ``extra`` updated by ``rank_extra[str(rank)]`` and the storage key
    ``keys[rank]`` (None: ``TPCACHE_STORAGE_KEY`` of its environment). With ``agree``
    the ranks size the host tier together (what the connector does); without it each sizes it from
    its own reading. Then the cache is built and runs one round: does it stay open?"""
    from tpcache.comm.exchange import all_gather_json
    from tpcache.integrations.vllm.options import ConnectorOptions, agree_host_tier, rank_facts
    from tpcache.service.config import ConfigError

    options = ConnectorOptions.from_extra_config({**(extra or {}), **(rank_extra or {}).get(str(rank), {})})
    facts = rank_facts(options, "L2xH1xD8:fp32", None if keys is None else keys[rank])
    facts["available"] = readings[rank]
    try:
        gathered = all_gather_json(facts) if agree else [facts] * world
        host = agree_host_tier(options, gathered, LAYOUT.page_bytes)
    except ConfigError as exc:
        return {"error": str(exc)}
    tp = TPCache(CacheConfig(page_size=PAGE, device_pages=8, host_pages=host.pages), collective, kv_layout=LAYOUT)
    try:
        tp.step()
        return {"pages": host.pages, "closed": tp.core.closed_reason or "", "line": host.describe()}
    finally:
        tp.close()
