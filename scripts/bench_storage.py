"""Benchmark: a storage backend's batched put/get against the same bytes moved by its floor.

``--backend file`` (default): FileBackend against raw file I/O in the same directory.
``--backend mooncake|redis``: the backend against the store's own client doing the same batched
put/get of the same bytes in the same run (Mooncake: ``batch_put_from``/``batch_get_into`` on a
registered buffer; Redis: pipelined ``SET``, ``MGET``). With ``--url`` it measures that store;
without, it starts local servers as the tests do (``tpcache.testing.servers``; Mooncake in a
private network namespace, which needs root). Each repeat alternates which side runs first;
the median of the repeats is kept, with the spread of the per-repeat ratios.

File backend, for each page size (64 KiB, 1 MiB) and each repeat, in a fresh subdirectory of ``--dir``:

- floor put: the same bytes written sequentially to one new file with ``os.write`` in page-sized
  writes, one ``fsync`` of its directory after creating it and one ``fsync`` per batch (the
  durability the backend gives with ``fsync="batch"``, which also syncs the directory once per new
  segment);
- floor get: that file read back sequentially in page-sized reads after ``fsync`` +
  ``POSIX_FADV_DONTNEED`` (cold: from the device, not the page cache);
- backend put: ``FileBackend.put`` in batches of ``--batch-mib``;
- backend get: after the same cache drop on every segment file, ``FileBackend.get`` of the same
  batches into preallocated buffers (every page verified by checksum).

The best of ``--repeats`` is kept for each of the four numbers (the device here is shared and
noisy); ``ratio_median`` and ``ratio_spread`` are the median and range of the per-repeat ratios
(backend and floor of one repeat run back to back, alternating which goes first).

Cold restart (``--restart-pages``, default 20,000 pages of 64 KiB): a FileBackend is filled and
closed, then each repeat drops the page cache of every segment and index file (``fsync`` +
``POSIX_FADV_DONTNEED``; the kernel's directory and inode caches stay warm) and times opening it
again, which reads the per-segment indexes. The same restart with the indexes removed (the full
header scan a missing or corrupt index falls back to) is timed too, as the reference. Prints
``cold_restart_s`` (median wall time) with its spread, ``cold_restart_cpu_s`` (median process CPU
time, which the machine's load moves less) and ``cold_restart_scan_s``.

Prints one JSON object: ``{"cases": [{"op", "page_bytes", "gbps", "floor_gbps", "ratio", ...}],
"cold_restart_s", ...}``; with ``--layouts`` it also measures the rejected one-file-per-page layout.

``--shards``: put and get through the shared storage layout (shards of the model's KV heads and
layers, the transpose included) against the store's raw client moving the same shards and whole
pages, and the read amplification of each writer/reader TP pair (``bench_shards.py``).

Usage: ``python scripts/bench_storage.py --json [--backend file|mooncake|redis] [--url URL] [--total-mib N]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpcache.io.storage.file import FileBackend  # noqa: E402
from tpcache.io.storage.keys import StorageKey  # noqa: E402

PAGE_SIZES = (64 << 10, 1 << 20)


def drop_cache(path: Path) -> None:
    """Write back and evict ``path`` from the page cache so the next read hits the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_tree(root: Path) -> None:
    for p in sorted(root.rglob("*.seg")) + sorted(root.rglob("*.idx")):
        drop_cache(p)


def cold_restart(root: Path, pages: int, repeats: int, batch_pages: int = 256) -> dict[str, object]:
    """Seconds to reopen a FileBackend of ``pages`` 64 KiB pages from a dropped page cache."""
    page = 64 << 10
    capacity = 2 * pages * (page + 256) + (256 << 20)
    data = memoryview(bytearray(os.urandom(page)))
    backend = FileBackend(root, capacity_bytes=capacity, fsync="never")
    try:
        for start in range(0, pages, batch_pages):
            n = min(batch_pages, pages - start)
            keys = [StorageKey("bench", 1, 0, 1, start + i) for i in range(n)]
            if not all(backend.put(keys, [data] * n)):
                raise RuntimeError(f"put failed: {backend.stats()}")
    finally:
        backend.close()

    def reopen() -> tuple[float, float, dict[str, int]]:
        drop_tree(root)
        t0, c0 = time.perf_counter(), time.process_time()
        b = FileBackend(root, capacity_bytes=capacity, fsync="never")
        t, c = time.perf_counter() - t0, time.process_time() - c0
        try:
            if b.stats()["records"] != pages:
                raise RuntimeError(f"restart found {b.stats()['records']} of {pages} records")
            stats = b.stats()
        finally:
            b.close()
        return t, c, stats

    indexed, cpu = [], []
    for _ in range(repeats):
        t, c, stats = reopen()
        if stats["startup_scanned_segments"]:
            raise RuntimeError(f"restart scanned segments despite their indexes: {stats}")
        indexed.append(t)
        cpu.append(c)
    scans = []
    for _ in range(max(1, repeats // 2)):
        for idx in root.rglob("*.idx"):
            idx.unlink()
        t, _, stats = reopen()  # its close writes the indexes again
        scans.append(t)
    return {
        "cold_restart_s": round(statistics.median(indexed), 4),
        "cold_restart_spread_s": [round(min(indexed), 4), round(max(indexed), 4)],
        "cold_restart_cpu_s": round(statistics.median(cpu), 4),
        "cold_restart_scan_s": round(statistics.median(scans), 4),
        "restart_pages": pages,
        "restart_segments": stats["segments"],
        "cold": "page cache of every segment and index file dropped (fsync + POSIX_FADV_DONTNEED)",
    }


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def raw_write(path: Path, batch: memoryview, page: int, batches: int) -> float:
    def run() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)  # the new file's name is durable too, as each new segment's is
            finally:
                os.close(dfd)
            for _ in range(batches):
                for off in range(0, len(batch), page):
                    os.write(fd, batch[off : off + page])
                os.fsync(fd)
        finally:
            os.close(fd)

    return timed(run)


def raw_read(path: Path, out: memoryview, page: int) -> float:
    drop_cache(path)

    def run() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            views = [out[off : off + page] for off in range(0, len(out), page)]
            while True:
                n = 0
                for v in views:
                    got = os.readv(fd, [v])
                    n += got
                    if got < page:
                        break
                if n < len(out):
                    return
        finally:
            os.close(fd)

    return timed(run)


def backend_put_get(root: Path, batch: memoryview, out: memoryview, page: int, batches: int) -> tuple[float, float]:
    per_batch = len(batch) // page
    keys = [[StorageKey("bench", 1, 0, 1, b * per_batch + i) for i in range(per_batch)] for b in range(batches)]
    pages = [batch[off : off + page] for off in range(0, len(batch), page)]
    outs = [out[off : off + page] for off in range(0, len(out), page)]
    total = len(batch) * batches
    backend = FileBackend(root, capacity_bytes=2 * total + (256 << 20), fsync="batch")
    try:

        def put_all() -> None:
            for ks in keys:
                if not all(backend.put(ks, pages)):
                    raise RuntimeError(f"put failed: {backend.stats()}")

        t_put = timed(put_all)
        drop_tree(root)

        def get_all() -> None:
            for ks in keys:
                if not all(backend.get(ks, outs)):
                    raise RuntimeError(f"get missed: {backend.stats()}")

        t_get = timed(get_all)
        if bytes(outs[-1]) != bytes(pages[-1]):
            raise RuntimeError("get returned the wrong bytes")
    finally:
        backend.close()
    return t_put, t_get


def file_per_page(root: Path, batch: memoryview, page: int, fsync: str) -> float:
    """The rejected layout: temp file + rename per page, fsync per page or per batch."""
    root.mkdir()

    def run() -> None:
        fds = []
        for i, off in enumerate(range(0, len(batch), page)):
            tmp = root / f".{i}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, batch[off : off + page])
            if fsync == "page":
                os.fsync(fd)
            fds.append((fd, tmp, root / f"{i}"))
        for fd, tmp, final in fds:
            if fsync == "batch":
                os.fsync(fd)
            os.close(fd)
            os.rename(tmp, final)
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)

    return timed(run)


def run_repeat(
    work: Path, batch: memoryview, out: memoryview, page: int, batches: int, *, floor_first: bool
) -> dict[str, float]:
    """Seconds for floor_put, floor_get, put and get of one repeat in ``work``."""
    times: dict[str, float] = {}

    def floor() -> None:
        raw = work / "raw.bin"
        times["floor_put"] = raw_write(raw, batch, page, batches)
        times["floor_get"] = raw_read(raw, out, page)
        raw.unlink()

    def backend() -> None:
        times["put"], times["get"] = backend_put_get(work / "backend", batch, out, page, batches)
        shutil.rmtree(work / "backend")

    # Alternate which side runs first, and let the deletes (online discard on some filesystems)
    # finish before the next timed phase, so neither side pays for the other's cleanup.
    for phase in (floor, backend) if floor_first else (backend, floor):
        phase()
        os.sync()
    return times


def main() -> int:
    if "--shards" in sys.argv[1:]:  # the shared layout's own options (bench_shards.py)
        import bench_shards

        sys.argv.remove("--shards")
        return bench_shards.main()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shards",
        action="store_true",
        help="the shared storage layout against the raw client moving the same shards (bench_shards.py)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    ap.add_argument("--dir", default=None, help="directory to measure in (default: system temp dir)")
    ap.add_argument("--backend", choices=("file", "mooncake", "redis"), default="file")
    ap.add_argument("--url", default="", help="an existing store's storage URL; default: start local servers")
    ap.add_argument("--total-mib", type=int, default=0, help="bytes written and read per case (file 256, stores 128)")
    ap.add_argument("--batch-mib", type=int, default=16, help="bytes per put/get call")
    ap.add_argument("--repeats", type=int, default=4, help="keep the best of this many runs")
    ap.add_argument("--layouts", action="store_true", help="also time the one-file-per-page layout")
    ap.add_argument("--restart-pages", type=int, default=20_000, help="64 KiB pages for the cold restart (0: skip)")
    args = ap.parse_args()
    if args.backend != "file":
        from bench_store import run_store_bench

        print(json.dumps(run_store_bench(args, PAGE_SIZES)))
        return 0
    args.total_mib = args.total_mib or 256

    base = Path(tempfile.mkdtemp(prefix="tpcache-bench-storage-", dir=args.dir))
    batch_bytes = args.batch_mib << 20
    batches = max(1, (args.total_mib << 20) // batch_bytes)
    total = batch_bytes * batches
    batch = memoryview(bytearray(os.urandom(batch_bytes)))
    out = memoryview(bytearray(batch_bytes))
    cases = []
    layouts = []
    try:
        for page in PAGE_SIZES:
            best = {"put": 0.0, "get": 0.0, "floor_put": 0.0, "floor_get": 0.0}
            ratios: dict[str, list[float]] = {"put": [], "get": []}
            for rep in range(args.repeats):
                work = base / f"{page}-{rep}"
                work.mkdir()
                times = run_repeat(work, batch, out, page, batches, floor_first=rep % 2 == 0)
                for name, t in times.items():
                    best[name] = max(best[name], total / t / 1e9)
                for op in ratios:
                    ratios[op].append(times[f"floor_{op}"] / times[op])
                shutil.rmtree(work)
            for op in ("put", "get"):
                cases.append(
                    {
                        "op": op,
                        "page_bytes": page,
                        "gbps": round(best[op], 3),
                        "floor_gbps": round(best[f"floor_{op}"], 3),
                        "ratio": round(best[op] / best[f"floor_{op}"], 3),
                        "ratio_median": round(statistics.median(ratios[op]), 3),
                        "ratio_spread": [round(min(ratios[op]), 3), round(max(ratios[op]), 3)],
                        "batch_pages": batch_bytes // page,
                        "total_bytes": total,
                        "fsync": "batch",
                    }
                )
        restart = cold_restart(base / "restart", args.restart_pages, args.repeats) if args.restart_pages else {}
        if args.layouts:
            page = 64 << 10
            for mode in ("page", "batch"):
                t = file_per_page(base / f"perfile-{mode}", batch, page, mode)
                layouts.append(
                    {
                        "layout": f"file_per_page_fsync_{mode}",
                        "page_bytes": page,
                        "gbps": round(batch_bytes / t / 1e9, 3),
                        "pages_per_s": round(batch_bytes // page / t),
                    }
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result: dict[str, object] = {"backend": "file", "cases": cases, "repeats": args.repeats, "dir": str(base.parent)}
    result.update(restart)
    if layouts:
        result["layouts"] = layouts
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
