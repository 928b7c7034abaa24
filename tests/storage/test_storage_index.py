"""File backend segment indexes: a restart from them equals the full scan; a missing, torn, corrupt or
stale index falls back to the scan; a crash between a segment and its index loses nothing."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.storage.storage_helpers import flip_byte, make_keys, make_page, segment_files
from tpcache.io.storage.file import FileBackend
from tpcache.io.storage.record import HEADER_SIZE

REPO = Path(__file__).resolve().parents[2]
PAGE = 4096
CAP = 1 << 20  # 64 KiB segments (capacity / 16): about 15 records each


def index_files(root: Path, owner: str = "all") -> list[Path]:
    return sorted((root / owner).glob("*.idx"))


def snapshot(b: FileBackend, keys: list) -> dict:
    """What a restart decided: every key's record location (in LRU order), hits and bytes, gauges."""
    out = [bytearray(PAGE) for _ in keys]
    ok = b.get(keys, out)
    stats = b.stats()
    return {
        "index": [
            (k, (loc.segno, loc.offset, loc.record_len, loc.payload_len, loc.seq)) for k, loc in b._index.items()
        ],
        "hits": ok,
        "data": [bytes(o) for o in out],
        "gauges": {k: stats[k] for k in ("records", "live_bytes", "bytes_used", "segments")},
    }


def fill(root: Path) -> list:
    """Several segments with overwrites, deletes and evictions: every way a record dies."""
    keys = make_keys(400)
    with FileBackend(root, capacity_bytes=CAP, fsync="never") as b:
        for start in range(0, 400, 20):
            b.put(keys[start : start + 20], [make_page(start + i, PAGE) for i in range(20)])
            b.put(keys[start : start + 3], [make_page(1000 + start + i, PAGE) for i in range(3)])  # overwrites
            b.delete(keys[start + 5 : start + 7])
        assert b.stats()["evictions"] > 0 and b.stats()["segments"] > 4
    return keys


def test_restart_from_indexes_equals_the_scan(tmp_path: Path) -> None:
    keys = fill(tmp_path)
    with FileBackend(tmp_path, capacity_bytes=CAP) as b:
        stats = b.stats()
        assert stats["startup_scanned_segments"] == 0
        assert stats["startup_indexed_segments"] == stats["segments"] == len(index_files(tmp_path))
        indexed = snapshot(b, keys)
    for idx in index_files(tmp_path):
        idx.unlink()
    with FileBackend(tmp_path, capacity_bytes=CAP) as b:
        assert b.stats()["startup_indexed_segments"] == 0
        scanned = snapshot(b, keys)
    assert indexed == scanned
    assert 0 < sum(indexed["hits"]) < len(keys)
    for i, hit in enumerate(indexed["hits"]):
        if hit:  # the newest bytes written for the key, never an older or other key's page
            assert indexed["data"][i] in (make_page(i, PAGE), make_page(1000 + i, PAGE))
            assert indexed["data"][i] == make_page(1000 + i if i % 20 < 3 else i, PAGE)


def _damage_truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _damage_flip(path: Path) -> None:
    flip_byte(path, path.stat().st_size - 20)  # inside the entries/keys, under the checksum


def _damage_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip, _damage_garbage])
def test_torn_or_corrupt_index_falls_back_to_the_scan(tmp_path: Path, damage) -> None:  # noqa: ANN001
    keys = fill(tmp_path)
    with FileBackend(tmp_path, capacity_bytes=CAP) as b:
        before = snapshot(b, keys)
    damaged = index_files(tmp_path)[1]
    damage(damaged)
    with FileBackend(tmp_path, capacity_bytes=CAP) as b:
        stats = b.stats()
        assert stats["startup_index_fallbacks"] == 1 and stats["startup_scanned_segments"] == 1
        assert snapshot(b, keys) == before
    # Its close wrote a good index again.
    with FileBackend(tmp_path, capacity_bytes=CAP) as b:
        assert b.stats()["startup_scanned_segments"] == 0


def test_index_of_another_incarnation_of_the_segment_is_not_used(tmp_path: Path) -> None:
    """Same segment number and length, other records: the tail check refuses the old index."""
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    with FileBackend(old_root, capacity_bytes=CAP, fsync="never") as b:
        b.put(make_keys(5), [make_page(i, PAGE) for i in range(5)])
    keys = make_keys(5, base=100)  # same key length: the segment has exactly the same size
    with FileBackend(new_root, capacity_bytes=CAP, fsync="never") as b:
        b.put(keys, [make_page(100 + i, PAGE) for i in range(5)])
    assert segment_files(old_root)[0].stat().st_size == segment_files(new_root)[0].stat().st_size
    shutil.copy(index_files(old_root)[0], index_files(new_root)[0])
    with FileBackend(new_root, capacity_bytes=CAP) as b:
        assert b.stats()["startup_index_fallbacks"] == 1
        assert b.exists(make_keys(5)) == [False] * 5  # nothing from the stale index
        out = [bytearray(PAGE) for _ in keys]
        assert b.get(keys, out) == [True] * 5  # and nothing durable lost
        assert [bytes(o) for o in out] == [make_page(100 + i, PAGE) for i in range(5)]


def test_index_with_a_grown_segment_falls_back(tmp_path: Path) -> None:
    keys = make_keys(5)
    with FileBackend(tmp_path, capacity_bytes=CAP, fsync="never") as b:
        b.put(keys, [make_page(i, PAGE) for i in range(5)])
    with open(segment_files(tmp_path)[0], "ab") as f:
        f.write(b"\0" * 100)  # a torn tail the index never saw
    with FileBackend(tmp_path, capacity_bytes=CAP) as b:
        stats = b.stats()
        assert stats["startup_index_fallbacks"] == 1
        assert stats["startup_discarded_torn"] + stats["startup_discarded_corrupt"] == 1
        assert b.exists(keys) == [True] * 5


def test_index_left_without_its_segment_is_removed(tmp_path: Path) -> None:
    fill(tmp_path)
    orphan = index_files(tmp_path)[0].with_name("9999999999.idx")
    shutil.copy(index_files(tmp_path)[0], orphan)
    with FileBackend(tmp_path, capacity_bytes=CAP):
        assert not orphan.exists()


# The child writes pages across several segments and stops at a chosen point: after a segment is
# sealed, just before its index is renamed into place (CRASH=index), or after a delete of a key in
# a sealed segment and an eviction (CRASH=after). The parent kills it there; no close runs.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from tpcache.io.storage.file import FileBackend
    from tests.storage.storage_helpers import make_keys, make_page
    root, page, crash = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    b = FileBackend(root, capacity_bytes=1 << 20, fsync="batch")
    keys = make_keys(300)
    def stop(*args):
        print("crash", flush=True)
        time.sleep(60)
    acked = 0
    for start in range(0, 300, 10):
        if crash == "index" and start == 40:
            os.replace = stop  # the next seal writes the index's temp file, then stops
        assert b.put(keys[start : start + 10], [make_page(start + i, page) for i in range(10)]) == [True] * 10
        acked = start + 10
        print("acked", acked, flush=True)
    assert b.delete(keys[250:251]) == [True]  # a sealed segment (the active one is further on)
    print("crash", flush=True)
    time.sleep(60)
    """
)


def _run_child(root: Path, crash: str) -> int:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), str(PAGE), crash], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    assert proc.stdout is not None
    acked = 0
    try:
        for line in proc.stdout:
            if line.startswith("acked"):
                acked = int(line.split()[1])
            if line.strip() == "crash":
                break
        else:
            pytest.fail(f"child exited early with {proc.wait()}")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    return acked


@pytest.mark.multiprocess
def test_crash_between_segment_and_index_loses_nothing(tmp_path: Path) -> None:
    acked = _run_child(tmp_path, "index")
    assert acked == 40
    owner = tmp_path / "all"
    assert list(owner.glob("*.idx.tmp")), "the child should have stopped with the index unrenamed"
    keys = make_keys(300)
    with FileBackend(tmp_path, capacity_bytes=CAP) as b:
        stats = b.stats()
        assert stats["startup_scanned_segments"] >= 1  # the segment whose index never landed
        assert not list(owner.glob("*.idx.tmp"))
        out = [bytearray(PAGE) for _ in keys]
        ok = b.get(keys, out)
        assert all(ok[:acked])  # every acked put survives
        for i, hit in enumerate(ok):
            assert bytes(out[i]) == (make_page(i, PAGE) if hit else bytes(PAGE))


@pytest.mark.multiprocess
def test_crash_after_delete_and_eviction_with_stale_indexes(tmp_path: Path) -> None:
    """Indexes written at seal time still list records evicted later (no close rewrote them): those
    miss at get, never serve wrong bytes; a deleted key does not come back; no acked page is lost
    unless it was evicted."""
    acked = _run_child(tmp_path, "after")
    assert acked == 300
    keys = make_keys(300)
    with FileBackend(tmp_path, capacity_bytes=CAP) as b:
        stats = b.stats()
        assert stats["startup_indexed_segments"] >= 1
        assert b.exists(keys[250:251]) == [False]
        listed = b.exists(keys)
        out = [bytearray(PAGE) for _ in keys]
        ok = b.get(keys, out)
        for i, hit in enumerate(ok):
            assert bytes(out[i]) == (make_page(i, PAGE) if hit else bytes(PAGE))
        assert not all(ok) and all(ok[290:300])  # the oldest were evicted, the newest are all there
        assert sum(listed) > sum(ok)  # the seal-time indexes listed records evicted since
        assert b.stats()["misses_foreign"] == sum(listed) - sum(ok)  # their dead marks fail them at get
        assert b.exists(keys) == ok  # a stale entry that missed is gone from the index


def _crash(b: FileBackend) -> None:
    """What a SIGKILL leaves on disk: every write done so far, and no close (no index rewritten)."""
    with b._lock:
        b._closed = True
        b._release()


@pytest.mark.parametrize("seed", range(6))
def test_crash_anywhere_gives_the_scans_hits_and_loses_no_live_page(tmp_path: Path, seed: int) -> None:
    """Random puts, overwrites and deletes under a tight capacity (evictions, compactions into
    segments sealed meanwhile), then a crash: the indexes give exactly the hits the scan gives, and
    every page live before the crash is still there with its newest bytes."""
    import random

    rng = random.Random(seed)
    keys = make_keys(120)
    version = {}
    b = FileBackend(tmp_path, capacity_bytes=CAP, fsync="never")
    for step in range(rng.randrange(400, 700)):
        i = rng.randrange(len(keys))
        if rng.random() < 0.15:
            b.delete([keys[i]])
            version.pop(i, None)
        else:
            assert b.put([keys[i]], [make_page(step * 1000 + i, PAGE)]) == [True]
            version[i] = step * 1000 + i
    assert b.stats()["compactions"] > 0
    live = b.exists(keys)
    _crash(b)

    def hits() -> tuple[list[bool], list[bytes]]:
        with FileBackend(tmp_path, capacity_bytes=CAP) as r:
            out = [bytearray(PAGE) for _ in keys]
            return r.get(keys, out), [bytes(o) for o in out]

    via_index = hits()
    for idx in index_files(tmp_path):
        idx.unlink()
    assert hits() == via_index
    ok, data = via_index
    assert ok == live  # nothing lost, nothing deleted or evicted comes back
    for i, hit in enumerate(ok):
        assert data[i] == (make_page(version[i], PAGE) if hit else bytes(PAGE))


def test_crash_after_a_compaction_that_sealed_its_destination(tmp_path: Path) -> None:
    """A compaction that fills the active segment seals it mid-copy: the copies in it must be in its
    index before the victim is deleted, or a crash then loses them."""
    keys = make_keys(30)
    b = FileBackend(tmp_path, capacity_bytes=CAP, fsync="never")
    per_segment = (CAP // 16) // (HEADER_SIZE + len(keys[0].encode()) + PAGE)
    assert b.put(keys[:per_segment], [make_page(i, PAGE) for i in range(per_segment)]) == [True] * per_segment
    rest = keys[per_segment : per_segment + per_segment - 3]
    assert b.put(rest, [make_page(per_segment + i, PAGE) for i in range(len(rest))]) == [True] * len(rest)
    assert b.stats()["segments"] == 2
    b.delete(keys[:2])
    with b._lock:
        b._compact(b._segments[1])  # what _make_room does under pressure, forced here
    assert b.stats()["segments"] == 2 and 1 not in b._segments  # the copies went to segments 2 and 3
    live = keys[2:per_segment] + rest
    _crash(b)
    with FileBackend(tmp_path, capacity_bytes=CAP) as r:
        assert r.stats()["startup_scanned_segments"] == 1  # only the active one had no index
        out = [bytearray(PAGE) for _ in live]
        assert r.get(live, out) == [True] * len(live)
