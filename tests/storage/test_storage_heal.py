"""File storage that heals: a capacity the filesystem cannot hold is lowered at start, a full disk
(ENOSPC) evicts the oldest segments and writing goes on, a directory removed or made read-only
turns the backend to misses and failed writes instead of acknowledging what nobody can read."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from tests.storage.storage_helpers import make_keys, make_page
from tpcache.io.storage import FileBackend

PAGE = 64 << 10


def put_and_read_back(b: FileBackend, keys, first: int) -> tuple[int, int]:
    """Put pages ``first..`` under ``keys``; (puts that succeeded, pages read back byte-exact)."""
    pages = [make_page(first + i, PAGE) for i in range(len(keys))]
    ok = b.put(keys, pages)
    out = [bytearray(PAGE) for _ in keys]
    got = b.get(keys, out)
    return sum(ok), sum(1 for g, o, p in zip(got, out, pages, strict=True) if g and bytes(o) == p)


def test_a_capacity_above_the_filesystem_is_lowered_with_a_warning(tmpfs: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, "tpcache.storage"):
        b = FileBackend(tmpfs, capacity_bytes=1 << 30, shard=(0, 1))
    try:
        cap = b.stats()["capacity_bytes"]
        assert cap < 4 << 20
        assert "storage capacity 1 GiB is more than" in caplog.text and "using 3.8 MiB" in caplog.text
        keys = make_keys(3 * (4 << 20) // PAGE)  # three times what the filesystem holds
        for i in range(0, len(keys), 8):
            assert put_and_read_back(b, keys[i : i + 8], i) == (8, 8)
        s = b.stats()
        assert s["put_failures"] == 0 and s["evictions"] > 0 and s["bytes_used"] <= cap
    finally:
        b.close()


def test_a_full_filesystem_evicts_the_oldest_segments_and_writing_goes_on(tmpfs: Path, caplog) -> None:
    b = FileBackend(tmpfs, capacity_bytes=3 << 20, shard=(0, 1))
    try:
        keys = make_keys(120)
        assert put_and_read_back(b, keys[:16], 0) == (16, 16)
        (tmpfs / "someone-elses-file").write_bytes(bytes(2 << 20))  # the disk now holds less than capacity
        with caplog.at_level(logging.WARNING, "tpcache.storage"):
            for i in range(16, 120, 8):  # later prefixes: each is stored and served
                assert put_and_read_back(b, keys[i : i + 8], i) == (8, 8), b.stats()
        s = b.stats()
        assert s["put_failures"] == 0 and s["evictions"] >= 16
        assert s["capacity_bytes"] < 3 << 20  # lowered to what the disk held when it filled
        assert caplog.text.count("is full at") == 1
        newest = keys[112:]
    finally:
        b.close()
    with FileBackend(tmpfs, capacity_bytes=3 << 20, shard=(0, 1)) as again:  # and survive a restart
        out = [bytearray(PAGE) for _ in newest]
        assert again.get(newest, out) == [True] * 8
        assert [bytes(o) for o in out] == [make_page(112 + i, PAGE) for i in range(8)]


@pytest.mark.parametrize("fault", ["removed", "read_only"])
def test_a_directory_removed_or_made_read_only_turns_to_misses_and_failed_writes(tmp_path: Path, caplog, fault) -> None:
    b = FileBackend(tmp_path / "store", capacity_bytes=1 << 24, shard=(0, 1))
    try:
        keys = make_keys(8)
        assert put_and_read_back(b, keys[:4], 0) == (4, 4)
        assert b.unusable() is None
        with caplog.at_level(logging.WARNING, "tpcache.storage"):
            if fault == "removed":
                shutil.rmtree(tmp_path / "store")
            else:
                os.chmod(b._dir, 0o555)  # type: ignore[attr-defined]
            assert b.put(keys[4:], [make_page(i, PAGE) for i in range(4, 8)]) == [False] * 4
            assert b.exists(keys) == [False] * 8
            assert b.get(keys[:4], [bytearray(PAGE) for _ in range(4)]) == [False] * 4
            b.put(keys[4:], [make_page(i, PAGE) for i in range(4, 8)])
        reason = b.unusable()
        assert reason is not None and ("removed" in reason if fault == "removed" else "not writable" in reason)
        s = b.stats()
        assert s["put_failures_unusable"] == 8 and s["misses_unusable"] == 4 and s["capacity_bytes"] == 0
        assert caplog.text.count("WARNING") == 1 and "turns to misses" in caplog.text
    finally:
        if fault == "read_only":
            os.chmod(b._dir, 0o755)  # type: ignore[attr-defined]
        b.close()
