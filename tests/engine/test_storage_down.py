"""A rank whose storage directory disappears: it notices, says so in the round, and every rank turns
storage off in the same round (agreed), with the cache still open and serving what it holds."""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.engine.test_engine import LAYOUT, check_hits, request, tokens
from tpcache.comm import SimGroup
from tpcache.core import CacheConfig
from tpcache.core.tiers import StorageState
from tpcache.engine import TPCache
from tpcache.io.storage import FileBackend


def on_both(ranks: list[TPCache], fn: Callable[[TPCache], Any]) -> list[Any]:
    """Run ``fn`` on every rank at once (the ops are sequenced alike; rounds are collective)."""
    out: list[Any] = [None] * len(ranks)
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(ranks[r])
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def durable(tp: TPCache) -> int:
    return sum(1 for n in tp.core.tree.nodes.values() if n.storage_state == StorageState.DURABLE)


def test_a_removed_storage_directory_turns_storage_off_on_every_rank_agreed(tmp_path: Path, caplog) -> None:
    cfg = CacheConfig(page_size=16, device_pages=16, host_pages=16, write_policy="write_through", storage=True)
    group = SimGroup(2)
    ranks = [
        TPCache(
            cfg,
            group.collective(r),
            kv_layout=LAYOUT,
            storage=FileBackend(tmp_path / f"rank{r}", capacity_bytes=1 << 24, shard=(r, 2)),
            round_timeout_s=30.0,
        )
        for r in range(2)
    ]
    try:
        on_both(ranks, lambda tp: (request(tp, tokens(1, 2, 3)), tp.drain()))
        assert [tp.core.stats.storage_written_pages for tp in ranks] == [3, 3]
        assert [durable(tp) for tp in ranks] == [3, 3]
        with caplog.at_level(logging.WARNING):
            shutil.rmtree(tmp_path / "rank1")
            on_both(ranks, lambda tp: [tp.step() for _ in range(6)])  # noticed within a few rounds
        assert all(tp.core.backup.storage_down for tp in ranks)
        assert not any(tp.core.closed for tp in ranks)  # storage is off, the cache serves on
        assert all(tp.health()["storage_down"] and tp.health()["state"] == "open" for tp in ranks)
        assert [durable(tp) for tp in ranks] == [0, 0]  # no host mirror counts as redundant any more
        notes = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert sum("was removed" in m and "turns to misses" in m for m in notes) == 1, notes
        assert sum("storage is off on every rank" in m for m in notes) == 2, notes  # one line per rank
        written = [tp.core.stats.storage_write_issued_pages for tp in ranks]
        on_both(ranks, lambda tp: (request(tp, tokens(4, 5)), tp.drain()))
        assert [tp.core.stats.storage_write_issued_pages for tp in ranks] == written  # nothing acknowledged
        assert [tp.storage.stats()["put_ok"] for tp in ranks] == [3, 3]
        for tp in ranks:
            assert check_hits(tp, tokens(1, 2, 3)) == 3 and check_hits(tp, tokens(4, 5)) == 2
            lease, _ = tp.lock(tokens(1, 2, 3, 6))
            assert tp.prefetch(lease) is False  # no storage lookup: it would miss on rank 1
            tp.release(lease)
        on_both(ranks, lambda tp: tp.drain())
    finally:
        for tp in ranks:
            tp.close()
