"""The simulator's engine admitting requests in phases, and what buffer mode must keep true.

``admission_step`` is one scheduler step of an engine that follows the admission contract: each
waiting request in its turn is selected and materialized; a ready one is committed, its rest
computed and inserted, and it finishes. ``buffer_violations`` lists what a buffer-mode rank must
never show: a host page reported as a hit, a hit counted that no commit delivered, a staging slot
kept after the copy it staged was agreed complete.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from tpcache.core import Admitted, CacheClosed, CacheConfig, CacheCore, OutOfPages, UnknownLease
from tpcache.core.hashing import as_token_bytes

if TYPE_CHECKING:
    from tpcache.engine.driver import Operations


def buffer_config(seed: int, config: CacheConfig) -> CacheConfig:
    """A buffer-mode variant of a schedule's configuration, drawn from its own stream (the rest of
    the schedule is the same seed's): a small staging pool in front of storage."""
    rng = random.Random(seed * 6151 + 5)
    return replace(
        config,
        host_mode="buffer",
        storage=True,
        host_pages=rng.randint(2, 8),
        write_policy=rng.choice(["write_through", "write_through", "write_through_selective"]),
        admission_max_deferrals=rng.choice([2, 6, 32]),
    )


def admission_step(
    target: Operations,
    waiting: dict[int, list[int]],
    write_kv: Callable[[int, int], None],
    on_commit: Callable[[int, list[int], Admitted], None],
) -> list[tuple]:
    """Advance every waiting admission (lease id -> tokens) one phase, in their turn; a committed
    request computes what its hit lacks, inserts and finishes. Returns each outcome, to compare
    between ranks."""
    core: CacheCore = target.core
    outcomes: list[tuple] = []
    for lease_id in target.admission_queue():
        tokens = waiting.get(lease_id)
        if tokens is None:
            continue
        try:
            out = target.materialize(lease_id, target.select(lease_id))
            outcomes.append((lease_id, out.status, out.reason, out.shape))
            if out.status != "ready":
                continue
            admitted = target.commit(lease_id)
            on_commit(lease_id, tokens, admitted)
            hashes = core.tree.walk(as_token_bytes(tokens)).hashes
            fresh = target.alloc(lease_id, out.shape.num_pages - admitted.hit_pages)
            for page, page_hash in zip(fresh, hashes[admitted.hit_pages :], strict=True):
                write_kv(page, page_hash)
            target.insert(lease_id, tokens, admitted.device_page_ids + fresh)
        except (OutOfPages, CacheClosed) as exc:
            outcomes.append((lease_id, type(exc).__name__))
        except UnknownLease:
            waiting.pop(lease_id, None)
            continue
        target.release(lease_id)
        del waiting[lease_id]
    return outcomes


def buffer_violations(core: CacheCore, committed_storage_tokens: int, after_commit: bool) -> list[str]:
    """What a buffer-mode rank shows that it never may (empty: nothing)."""
    out: list[str] = []
    stats = core.stats
    if stats.host_hit_tokens:
        out.append(f"{stats.host_hit_tokens} host-hit tokens counted: host is only staging")
    admitted = stats.storage_hit_tokens - stats.lock_storage_hit_tokens  # (a lock's loads count their own)
    if admitted != committed_storage_tokens:
        out.append(f"{admitted} storage-hit tokens counted for admissions, {committed_storage_tokens} committed")
    if after_commit and not core.closed:
        kept = [i for i in core.treecore.ids() if core.treecore.host_copy_idle(i)]
        if kept:
            out.append(f"staging slots of nodes {kept} kept after their copies were agreed complete")
    return out
