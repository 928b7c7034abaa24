"""File backend: crash safety, on-disk damage, capacity, restart, shared directories."""

from __future__ import annotations

import errno
import os
import random
import shutil
from pathlib import Path

import pytest

from tests.storage.storage_helpers import flip_byte, make_keys, make_page, segment_files
from tpcache.comm.parallel import ParallelGroup
from tpcache.io.storage.base import StorageError
from tpcache.io.storage.file import FileBackend
from tpcache.io.storage.keys import StorageKey, StorageKeyError
from tpcache.io.storage.record import HEADER, HEADER_SIZE, RECORD_VERSION, encode_header, payload_checksum

PAGE = 4096


def rec_len(key: StorageKey, page: int = PAGE) -> int:
    return HEADER_SIZE + len(key.encode()) + page


def read_all(b: FileBackend, keys: list[StorageKey], page: int = PAGE) -> tuple[list[bool], list[bytes]]:
    out = [bytearray(page) for _ in keys]
    return b.get(keys, out), [bytes(o) for o in out]


def test_restart_gets_hits_for_completed_puts(tmp_path: Path) -> None:
    keys = make_keys(10)
    with FileBackend(tmp_path, capacity_bytes=1 << 20, fsync="always") as b:
        assert b.put(keys, [make_page(i, PAGE) for i in range(10)]) == [True] * 10
        b.delete([keys[3]])
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b:
        ok, data = read_all(b, keys)
        assert ok == [i != 3 for i in range(10)]
        assert all(data[i] == make_page(i, PAGE) for i in range(10) if i != 3)
        # It keeps working after the restart: new puts land in a new segment.
        assert b.put(make_keys(2, base=100), [make_page(7, PAGE)] * 2) == [True, True]
        assert b.stats()["records"] == 11
    assert len(segment_files(tmp_path)) == 2


def test_newest_write_wins_after_restart(tmp_path: Path) -> None:
    key = make_keys(1)
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b:
        b.put(key, [make_page(1, PAGE)])
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b:
        b.put(key, [make_page(2, PAGE)])
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b:
        assert read_all(b, key) == ([True], [make_page(2, PAGE)])
        assert b.stats()["records"] == 1


def test_second_instance_of_same_shard_is_refused(tmp_path: Path) -> None:
    b = FileBackend(tmp_path, capacity_bytes=1 << 20, shard=(0, 2))
    with pytest.raises(StorageError, match="in use"):
        FileBackend(tmp_path, capacity_bytes=1 << 20, shard=(0, 2))
    other = FileBackend(tmp_path, capacity_bytes=1 << 20, shard=(1, 2))  # another rank may share
    other.close()
    b.close()
    FileBackend(tmp_path, capacity_bytes=1 << 20, shard=(0, 2)).close()


def test_ranks_sharing_a_directory_read_only_their_shard(tmp_path: Path) -> None:
    b0 = FileBackend(tmp_path, capacity_bytes=1 << 20, shard=(0, 2))
    b1 = FileBackend(tmp_path, capacity_bytes=1 << 20, shard=(1, 2))
    k0, k1 = StorageKey("ns", 1, 0, 2, 42), StorageKey("ns", 1, 1, 2, 42)
    assert b0.put([k0], [make_page(0, PAGE)]) == [True]
    assert b1.put([k1], [make_page(1, PAGE)]) == [True]
    assert read_all(b0, [k0]) == ([True], [make_page(0, PAGE)])
    assert read_all(b1, [k1]) == ([True], [make_page(1, PAGE)])
    b0.close()
    b1.close()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_flipped_byte_is_a_corrupt_miss(tmp_path: Path, where: str) -> None:
    keys = make_keys(3)
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b:
        b.put(keys, [make_page(i, PAGE) for i in range(3)])
        seg = segment_files(tmp_path)[0]
        start = rec_len(keys[0]) * 1
        flip_byte(seg, start + (rec_len(keys[1]) - 100 if where == "payload" else 20))
        ok, data = read_all(b, keys)
        assert ok == [True, False, True]
        assert data[1] == bytes(PAGE)  # the caller's buffer holds no corrupt bytes
        assert b.stats()["misses_corrupt"] == 1
        assert read_all(b, keys)[0] == [True, False, True]  # dropped, now plainly missing
        assert b.stats()["misses_missing"] == 1


def test_flipped_payload_byte_found_at_start_with_verify(tmp_path: Path) -> None:
    keys = make_keys(3)
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b:
        b.put(keys, [make_page(i, PAGE) for i in range(3)])
    flip_byte(segment_files(tmp_path)[0], rec_len(keys[0]) + rec_len(keys[1]) - 1)
    with FileBackend(tmp_path, capacity_bytes=1 << 20, verify_on_open=True) as b:
        assert b.stats()["startup_discarded_corrupt"] == 1
        assert b.exists(keys) == [True, False, True]
        assert read_all(b, keys)[0] == [True, False, True]


@pytest.mark.parametrize("indexed", [True, False])
def test_corrupt_header_at_start_hides_that_record(tmp_path: Path, indexed: bool) -> None:
    keys = make_keys(3)
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b:
        b.put(keys, [make_page(i, PAGE) for i in range(3)])
    flip_byte(segment_files(tmp_path)[0], rec_len(keys[0]) + 12)  # seq field of record 1
    if indexed:
        # The index still locates every record: the damaged one fails its checks at get.
        with FileBackend(tmp_path, capacity_bytes=1 << 20) as b:
            assert b.stats()["startup_indexed_segments"] == 1
            ok, data = read_all(b, keys)
            assert ok == [True, False, True]
            assert data[0] == make_page(0, PAGE) and data[1] == bytes(PAGE) and data[2] == make_page(2, PAGE)
            assert b.stats()["misses_corrupt"] == 1
        return
    for idx in (tmp_path / "all").glob("*.idx"):
        idx.unlink()
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b:
        assert b.stats()["startup_discarded_corrupt"] == 1
        ok, data = read_all(b, keys)
        assert ok[0] and data[0] == make_page(0, PAGE)
        assert not ok[1]
        # Record 2 follows an unreadable header, so it cannot be located: a miss, never wrong data.
        assert not ok[2] or data[2] == make_page(2, PAGE)


def test_truncated_file_is_a_short_miss_then_discarded(tmp_path: Path) -> None:
    keys = make_keys(3)
    b = FileBackend(tmp_path, capacity_bytes=1 << 20)
    b.put(keys, [make_page(i, PAGE) for i in range(3)])
    seg = segment_files(tmp_path)[0]
    os.truncate(seg, 2 * rec_len(keys[0]) + 500)
    ok, data = read_all(b, keys)
    assert ok == [True, True, False] and data[2] == bytes(PAGE)
    assert b.stats()["misses_short"] == 1
    b.close()
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b2:
        assert b2.stats()["startup_discarded_torn"] == 1
        assert read_all(b2, keys)[0] == [True, True, False]


@pytest.mark.parametrize("other", [dict(layout=2), dict(rank=1)])
def test_record_of_another_layout_or_rank_is_foreign(tmp_path: Path, other: dict) -> None:
    mine = StorageKey("ns", 1, 0, 2, 9)
    theirs = StorageKey("ns", other.get("layout", 1), other.get("rank", 0), 2, 9)
    shard_theirs = (theirs.tp_rank, 2)
    with FileBackend(tmp_path / "b", capacity_bytes=1 << 20, shard=shard_theirs) as b:
        b.put([theirs], [make_page(1, PAGE)])
    theirs_seg = segment_files(tmp_path / "b", f"r{shard_theirs[0]}of2")[0]
    a = FileBackend(tmp_path / "a", capacity_bytes=1 << 20, shard=(0, 2))
    a.put([mine], [make_page(0, PAGE)])
    # Another shard's/layout's bytes land where this key's record was (same length).
    shutil.copyfile(theirs_seg, segment_files(tmp_path / "a", "r0of2")[0])
    ok, data = read_all(a, [mine])
    assert ok == [False] and data[0] == bytes(PAGE)
    assert a.stats()["misses_foreign"] == 1
    a.close()
    shutil.copyfile(theirs_seg, tmp_path / "a" / "r0of2" / "0000000009.seg")
    with FileBackend(tmp_path / "a", capacity_bytes=1 << 20, shard=(0, 2)) as a2:
        assert a2.exists([mine]) == [False]
        if "rank" in other:
            assert a2.stats()["startup_discarded_foreign"] >= 1


def test_stages_sharing_a_directory_read_only_their_own_slice(tmp_path: Path) -> None:
    group = ParallelGroup(pp_size=2, tp_size=2)
    s0, s1 = group.place(0), group.place(2)  # tensor rank 0 of stage 0 and of stage 1
    k0, k1 = StorageKey.of("ns", 1, s0, 9), StorageKey.of("ns", 1, s1, 9)
    with FileBackend(tmp_path, capacity_bytes=1 << 20, shard=s1) as b1:
        assert b1.put([k1], [make_page(1, PAGE)]) == [True]
        with pytest.raises(StorageKeyError, match="p0of2.r0of2 given to the storage of shard p1of2.r0of2"):
            b1.get([k0], [bytearray(PAGE)])
    b0 = FileBackend(tmp_path, capacity_bytes=1 << 20, shard=s0)
    assert b0.put([k0], [make_page(0, PAGE)]) == [True]
    # Stage 1's record where stage 0's was (the same page, same length): foreign, never served.
    shutil.copyfile(segment_files(tmp_path, "p1of2.r0of2")[0], segment_files(tmp_path, "p0of2.r0of2")[0])
    ok, data = read_all(b0, [k0])
    assert ok == [False] and data[0] == bytes(PAGE)
    assert b0.stats()["misses_foreign"] == 1
    b0.close()


def test_record_of_a_newer_format_version_is_foreign(tmp_path: Path) -> None:
    key = make_keys(1)[0]
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b:
        b.put([key], [make_page(0, PAGE)])
        seg = segment_files(tmp_path)[0]
        enc = key.encode().encode()
        raw = bytearray(encode_header(enc, 1, PAGE, payload_checksum(make_page(0, PAGE))))
        fields = list(HEADER.unpack_from(raw))
        fields[1] = RECORD_VERSION + 1
        raw[:HEADER_SIZE] = HEADER.pack(*fields)
        fd = os.open(seg, os.O_RDWR)
        os.pwrite(fd, bytes(raw[:HEADER_SIZE]), 0)
        os.close(fd)
        assert read_all(b, [key])[0] == [False]
        assert b.stats()["misses_foreign"] == 1


def test_full_disk_fails_only_that_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = make_keys(3)
    real = os.pwritev
    calls = {"n": 0}

    def flaky(fd: int, bufs: list, offset: int) -> int:
        # Call 1 writes the batch at once and fails partway; the backend retries key by key, and
        # the disk is full again for the second key (call 3) only.
        calls["n"] += 1
        if calls["n"] in (1, 3):
            os.pwrite(fd, b"x" * 100, offset)  # partial bytes, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)

    b = FileBackend(tmp_path, capacity_bytes=1 << 20)
    monkeypatch.setattr(os, "pwritev", flaky)
    assert b.put(keys, [make_page(i, PAGE) for i in range(3)]) == [True, False, True]
    monkeypatch.setattr(os, "pwritev", real)
    s = b.stats()
    assert (s["put_failures_no_space"], s["put_ok"]) == (1, 2)
    assert read_all(b, keys) == ([True, False, True], [make_page(0, PAGE), bytes(PAGE), make_page(2, PAGE)])
    assert b.put([keys[1]], [make_page(1, PAGE)]) == [True]  # space came back
    b.close()
    with FileBackend(tmp_path, capacity_bytes=1 << 20) as b2:
        s2 = b2.stats()
        assert s2["startup_discarded_torn"] + s2["startup_discarded_corrupt"] == 0
        assert read_all(b2, keys) == ([True] * 3, [make_page(i, PAGE) for i in range(3)])


def test_io_error_on_batch_sync_withdraws_the_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = make_keys(3)
    b = FileBackend(tmp_path, capacity_bytes=1 << 20, fsync="batch")
    assert b.put(keys[:1], [make_page(0, PAGE)]) == [True]

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    assert b.put(keys[1:], [make_page(1, PAGE), make_page(2, PAGE)]) == [False, False]
    monkeypatch.undo()
    assert b.stats()["put_failures_io_error"] == 2
    assert b.exists(keys) == [True, False, False]
    b.close()


def test_page_larger_than_capacity_is_too_large(tmp_path: Path) -> None:
    with FileBackend(tmp_path, capacity_bytes=64 << 10) as b:
        assert b.put(make_keys(2), [bytes(128 << 10), bytes(1024)]) == [False, True]
        assert b.stats()["put_failures_too_large"] == 1


def test_capacity_is_a_bound_with_lru_eviction(tmp_path: Path) -> None:
    cap = 1 << 20
    page = 64 << 10
    b = FileBackend(tmp_path, capacity_bytes=cap)
    keys = make_keys(40)
    for i in range(8):
        assert b.put([keys[i]], [make_page(i, page)]) == [True]
    for i in range(8, 40):
        assert b.get([keys[0]], [bytearray(page)]) == [True]  # keep key 0 hot
        assert b.put([keys[i]], [make_page(i, page)]) == [True]
        assert b.stats()["bytes_used"] <= cap
    s = b.stats()
    assert s["evictions"] > 0
    present = b.exists(keys)
    assert present[0] and present[39]
    assert not any(present[1:8])  # the cold early pages went first
    ok, data = read_all(b, [k for k, p in zip(keys, present, strict=True) if p], page)
    assert all(ok)
    assert data == [make_page(i, page) for i, p in enumerate(present) if p]
    b.close()
    with FileBackend(tmp_path, capacity_bytes=cap // 2) as small:  # a smaller bound holds at start
        assert small.stats()["bytes_used"] <= cap // 2


def test_compaction_keeps_data_and_bound_deterministically(tmp_path: Path) -> None:
    cap, page = 2 << 20, 16 << 10  # 128 KiB segments: several records each
    rng = random.Random(7)
    ops = [(rng.random(), rng.randrange(300)) for _ in range(600)]

    def run(root: Path) -> tuple[list[bool], dict[str, int]]:
        b = FileBackend(root, capacity_bytes=cap, fsync="never")
        keys = make_keys(300)
        for r, i in ops:
            if r < 0.6:
                assert b.put([keys[i]], [make_page(i, page)]) == [True]
            elif r < 0.8:
                b.delete([keys[i]])
            else:
                b.get([keys[i]], [bytearray(page)])
            assert b.stats()["bytes_used"] <= cap
        present = b.exists(keys)
        ok, data = read_all(b, [k for k, p in zip(keys, present, strict=True) if p], page)
        assert all(ok) and data == [make_page(i, page) for i, p in enumerate(present) if p]
        stats = b.stats()
        b.close()
        return present, stats

    p1, s1 = run(tmp_path / "one")
    p2, s2 = run(tmp_path / "two")
    assert s1["compactions"] > 0 and s1["evictions"] > 0
    assert p1 == p2 and s1 == s2  # the same calls give the same state
    with FileBackend(tmp_path / "one", capacity_bytes=cap) as again:
        assert again.exists(make_keys(300)) == p1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_ops_against_a_model_with_restarts(tmp_path: Path, seed: int) -> None:
    """Any mix of puts (mixed sizes), overwrites, deletes, gets and restarts: the backend holds a
    subset of the model, returns only exact bytes, keeps the bound, and a restart keeps its set."""
    cap = 1 << 20
    rng = random.Random(seed)
    keys = make_keys(200)
    model: dict[int, bytes] = {}
    work = {"compactions": 0, "evictions": 0}
    b = FileBackend(tmp_path, capacity_bytes=cap, fsync="never", segment_bytes=48 << 10)
    for step in range(500):
        i = rng.randrange(len(keys))
        r = rng.random()
        if r < 0.5:
            size = rng.choice([1024, 4096, 16 << 10, 40 << 10])
            data = make_page(step, size)
            assert b.put([keys[i]], [data]) == [True]
            model[i] = data
        elif r < 0.65:
            b.delete([keys[i]])
            assert b.exists([keys[i]]) == [False]
            model.pop(i, None)
        elif r < 0.95 and i in model:
            out = bytearray(len(model[i]))
            if b.get([keys[i]], [out]) == [True]:
                assert bytes(out) == model[i]
        else:
            present = b.exists(keys)
            work = {k: v + b.stats()[k] for k, v in work.items()}
            b.close()
            b = FileBackend(tmp_path, capacity_bytes=cap, fsync="never", segment_bytes=48 << 10)
            assert b.exists(keys) == present
        assert b.stats()["bytes_used"] <= cap
    present = b.exists(keys)
    assert all(model.get(i) is not None for i, p in enumerate(present) if p)
    for i, p in enumerate(present):
        if p:
            out = bytearray(len(model[i]))
            assert b.get([keys[i]], [out]) == [True] and bytes(out) == model[i]
    s = b.stats()
    assert s["misses_corrupt"] + s["misses_foreign"] + s["misses_short"] == 0
    assert work["compactions"] + s["compactions"] > 0  # the run exercised both
    assert work["evictions"] + s["evictions"] > 0
    b.close()
