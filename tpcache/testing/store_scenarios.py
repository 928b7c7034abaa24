"""Scenarios for a real rank group on a shared store (``storage_url``): restart, sharing between
groups, a shard lost from the store, and a store that goes away and comes back.

Each rank writes KV bytes that are a function of (page, rank) and checks the bytes behind every
hit (``scenarios.check_hit_bytes``). Where a scenario waits for the test to act on a server, it
does so through marker files in ``sync_dir``, at the same point of every rank's operation stream,
so the ranks' sequenced operations never depend on when a marker appeared.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tpcache.comm.collective import Collective
from tpcache.core import CacheConfig
from tpcache.engine import TPCache, layout_version
from tpcache.io.storage import StorageKey, StorageWorker
from tpcache.testing.ops import tokens_for
from tpcache.testing.registry import scenario
from tpcache.testing.scenarios import LAYOUT, PAGE, check_hit_bytes, shard_bytes

MARKER_TIMEOUT_S = 120.0  # bounds every wait for a marker, a store, or copies in flight


def _cache(rank: int, world: int, collective: Collective, url: str, namespace: str) -> TPCache:
    config = CacheConfig(
        page_size=PAGE,
        device_pages=32,
        host_pages=32,
        write_policy="write_through",
        storage=True,
        namespace=namespace,
    )
    # The embedded API's storage URL: TPCache opens this rank's shard of the store.
    return TPCache(config, collective, kv_layout=LAYOUT, storage=url, round_timeout_s=60.0)


def _settle(tp: TPCache) -> None:
    """Run rounds until no copy is in flight (a storage op may take its store's timeout)."""
    deadline = time.monotonic() + MARKER_TIMEOUT_S
    while any(tp.core.inflight.values()):
        if time.monotonic() > deadline:
            raise TimeoutError("copies still in flight")
        tp.step()
        time.sleep(0.001)


def _write(tp: TPCache, path: tuple[int, ...]) -> None:
    """Cache ``path`` on device (the forward pass writes each page's bytes); write-through does the rest."""
    toks = tokens_for(path, PAGE, 0)
    lease, m = tp.lock(toks)
    have = m.device_page_ids
    fresh = tp.alloc(lease, m.num_pages - len(have))
    for page, h in zip(fresh, m.page_hashes[len(have) :], strict=True):
        tp.device_pool.write_page(page, shard_bytes(h, tp.rank))
    tp.insert(lease, toks, have + fresh)
    tp.release(lease)
    tp.step()


def _prefetch(tp: TPCache, path: tuple[int, ...]) -> tuple[int, int]:
    """Prefetch ``path`` from storage; (pages read to host, rounds run while a storage op was in
    flight). Every hit's bytes are checked."""
    toks = tokens_for(path, PAGE, 0)
    lease, _ = tp.lock(toks)
    tp.prefetch(lease)
    busy = 0
    deadline = time.monotonic() + MARKER_TIMEOUT_S
    while tp.core.prefetch_status(lease)[0] != "done":
        if time.monotonic() > deadline:
            raise TimeoutError("the prefetch did not finish")
        tp.step()
        busy += tp.shell.storage is not None and tp.shell.storage.pending() > 0
        time.sleep(0.0005)
    ready = tp.core.prefetch_status(lease)[1]
    check_hit_bytes(tp, toks)
    tp.release(lease)
    tp.step()
    return ready, busy


def _only_in_storage(tp: TPCache) -> None:
    """Drop every device and host copy (same on every rank): what is left is in storage."""
    _settle(tp)
    tp.core.evict_device(1 << 30)
    tp.core.evict_host(1 << 30)
    tp.step()


def _key(tp: TPCache, path: tuple[int, ...], page: int) -> StorageKey:
    hashes = tp.match(tokens_for(path, PAGE, 0)).page_hashes
    return StorageKey(tp.config.namespace, layout_version(LAYOUT), tp.rank, tp.world_size, hashes[page])


def _wait(path: Path, timeout_s: float = MARKER_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"marker {path.name} did not appear within {timeout_s:.0f} s")
        time.sleep(0.01)


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


RESTART_PATHS = [(1, 2, 3), (5, 6), (8, 9)]  # written durably
UNSTORED_PATH = (7, 7, 7)  # on device only when the group stops


@scenario
def store_restart(
    rank: int,
    world: int,
    collective: Collective,
    url: str,
    namespace: str,
    phase: str,
    lose_on_rank: int | None = None,
) -> dict[str, Any]:
    """Phase "write": make ``RESTART_PATHS`` durable, then cache ``UNSTORED_PATH`` on device only.
    Phase "read" (a new group on the same store): optionally rank ``lose_on_rank`` first removes
    its record of page 1 of the first path from the store; then prefetch every path."""
    tp = _cache(rank, world, collective, url, namespace)
    try:
        if phase == "write":
            for path in RESTART_PATHS:
                _write(tp, path)
            _settle(tp)
            durable = tp.core.stats.storage_written_pages
            toks = tokens_for(UNSTORED_PATH, PAGE, 0)
            lease, m = tp.lock(toks)
            for page, h in zip(tp.alloc(lease, m.num_pages), m.page_hashes, strict=True):
                tp.device_pool.write_page(page, shard_bytes(h, rank))
            return {"durable": durable}
        removed = None
        if lose_on_rank == rank:
            assert tp.storage is not None
            removed = tp.storage.delete([_key(tp, RESTART_PATHS[0], 1)])
        ready = [_prefetch(tp, path)[0] for path in [*RESTART_PATHS, UNSTORED_PATH]]
        return {"ready": ready, "removed": removed, "digest": tp.core.digest.value, "closed": tp.core.closed_reason}
    finally:
        tp.close()


SHARED_PATHS = [(3, 1, 4), (2, 7)]


@scenario
def store_share(
    rank: int, world: int, collective: Collective, url: str, namespace: str, role: str, sync_dir: str
) -> dict[str, Any]:
    """Two groups on one store at the same time: the "writer" makes ``SHARED_PATHS`` durable and
    stays up until the "reader", another engine instance, has prefetched them."""
    sync = Path(sync_dir)
    tp = _cache(rank, world, collective, url, namespace)
    try:
        if role == "writer":
            for path in SHARED_PATHS:
                _write(tp, path)
            _settle(tp)
            _barrier()
            if rank == 0:
                (sync / "written").touch()
            _wait(sync / "read")
            return {"durable": tp.core.stats.storage_written_pages}
        _wait(sync / "written")
        ready = [_prefetch(tp, path)[0] for path in SHARED_PATHS]
        _barrier()
        if rank == 0:
            (sync / "read").touch()
        return {"ready": ready, "digest": tp.core.digest.value, "closed": tp.core.closed_reason}
    finally:
        tp.close()


BEFORE, DURING, AFTER = (10, 11), (20, 21), (30, 31)


@scenario
def store_outage(
    rank: int, world: int, collective: Collective, url: str, namespace: str, sync_dir: str
) -> dict[str, Any]:
    """The store goes away while a storage read is in flight, and comes back.

    Markers: rank 0 writes ``in-flight`` when its first storage op after ``BEFORE`` became
    storage-only is about to run, and every rank holds that op until the test writes ``stopped``
    (so the op really runs against the stopped server). Rank 0 writes ``ready-to-restart`` once it
    has run on without the store; the test restarts the server and writes ``restarted``."""
    sync = Path(sync_dir)
    tp = _cache(rank, world, collective, url, namespace)
    assert tp.storage is not None
    backend = tp.storage
    out: dict[str, Any] = {}
    try:
        _write(tp, BEFORE)
        _only_in_storage(tp)
        out["durable_before"] = tp.core.stats.storage_written_pages

        held = [False]

        def hold(op_id: int, kind: str) -> None:
            if not held[0]:
                held[0] = True
                if rank == 0:
                    (sync / "in-flight").touch()
                _wait(sync / "stopped")

        assert tp.shell.storage is not None
        tp.shell.storage.close()
        tp.shell.storage = StorageWorker(backend, delay=hold)
        out["ready_while_down"], out["rounds_with_op_in_flight"] = _prefetch(tp, BEFORE)
        out["stats_while_down"] = backend.stats()

        written = tp.core.stats.storage_written_pages
        _write(tp, DURING)
        _settle(tp)
        out["written_while_down"] = tp.core.stats.storage_written_pages - written
        out["device_hit_while_down"], out["host_hit_while_down"], _ = check_hit_bytes(tp, tokens_for(DURING, PAGE, 0))
        out["closed_while_down"] = tp.core.closed_reason

        _barrier()
        if rank == 0:
            (sync / "ready-to-restart").touch()
        _wait(sync / "restarted")
        # Wait until this rank's store answers again and has forgotten what it lost: a holder
        # remounts its segment after a master restart; the master keeps a dead holder's segment
        # (and allocates writes in it) until that client's TTL expires; the backend fails calls
        # fast for a moment after a failure.
        probe = StorageKey(namespace, 0, rank, world, (1 << 63) + rank)
        lost = _key(tp, BEFORE, 0)
        deadline = time.monotonic() + MARKER_TIMEOUT_S
        while backend.exists([lost])[0] or not backend.put([probe], [bytes(64)])[0]:
            if time.monotonic() > deadline:
                raise TimeoutError("the store did not come back")
            time.sleep(0.2)
        _barrier()

        written = tp.core.stats.storage_written_pages
        _write(tp, AFTER)
        _only_in_storage(tp)
        out["written_after"] = tp.core.stats.storage_written_pages - written
        out["ready_after"] = _prefetch(tp, AFTER)[0]
        out["ready_lost"] = _prefetch(tp, BEFORE)[0]  # the store lost it with the restart
        out["digest"] = tp.core.digest.value
        out["closed"] = tp.core.closed_reason
        return out
    finally:
        tp.close()
