"""The shared-store half of ``bench_storage.py``: a Mooncake or Redis backend against the store's
own client moving the same bytes, in the same run, with the same batches.

Floors: Mooncake ``batch_put_from`` / ``batch_get_into`` on a buffer registered with the store
(the client's zero-copy batched path); Redis pipelined ``SET`` of ``bytes`` values and one ``MGET``
per batch (the client's fastest calls for many values: ``MSET`` costs more client CPU than the
pipeline, ``MGET`` less than pipelined ``GET``), each value then copied into one buffer, where a
reader keeps what it read (as Mooncake's ``batch_get_into`` delivers it). The backend adds its
record header and a checksum of every page both ways. Mooncake: pages under ``direct_put`` /
``direct_get`` (256 KiB each) are copied through its staging buffer; larger pages are put from the
caller's memory after one ``batch_is_exist`` and read into it. Redis: each record is copied into
one value.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from tpcache.io.storage import StorageKey, open_storage, parse_storage_url


@contextlib.contextmanager
def local_store(backend: str) -> Iterator[str]:
    """A store of ``backend`` on loopback, as the tests start it; yields its storage URL."""
    from tpcache.testing import netns
    from tpcache.testing.servers import MooncakeStore, RedisServer

    work = tempfile.mkdtemp(prefix="tpcache-bench-store-")
    if backend == "mooncake":
        reason = netns.isolate()
        if reason:
            raise SystemExit(f"a local Mooncake Store needs a private network namespace: {reason}")
        with MooncakeStore(work, holder_bytes=1 << 30) as store:
            yield store.url
    else:
        with RedisServer(work) as server:
            yield server.url


class _Raw:
    """The store's own client doing the floor's batched put/get."""

    def __init__(self, b: Any, nbytes: int) -> None:
        self.b = b
        if hasattr(b, "_store"):
            self.buf = mmap.mmap(-1, nbytes)
            self.anchor = ctypes.c_char.from_buffer(self.buf)
            self.base = ctypes.addressof(self.anchor)
            if b._store.register_buffer(self.base, nbytes) != 0:
                raise RuntimeError("cannot register the floor's buffer")

    def fill(self, data: memoryview) -> None:
        if hasattr(self.b, "_store"):
            self.buf[: len(data)] = data
        else:
            self.data = data
            self.out = bytearray(len(data))

    def put(self, names: list[str], page: int) -> None:
        if hasattr(self.b, "_store"):
            ptrs = [self.base + i * page for i in range(len(names))]
            codes = self.b._store.batch_put_from(names, ptrs, [page] * len(names))
            if any(c != 0 for c in codes):
                raise RuntimeError(f"raw put failed: {set(codes)}")
            return
        pipe = self.b._client.pipeline(transaction=False)
        for i, n in enumerate(names):
            pipe.set(n, bytes(self.data[i * page : (i + 1) * page]))
        if not all(pipe.execute()):
            raise RuntimeError("raw SET failed")

    def get(self, names: list[str], page: int) -> None:
        if hasattr(self.b, "_store"):
            ptrs = [self.base + i * page for i in range(len(names))]
            codes = self.b._store.batch_get_into(names, ptrs, [page] * len(names))
            if any(c != page for c in codes):
                raise RuntimeError(f"raw get failed: {set(codes)}")
            return
        out = memoryview(self.out)
        for i, v in enumerate(self.b._client.mget(names)):
            if v is None or len(v) != page:
                raise RuntimeError("raw MGET missed")
            out[i * page : (i + 1) * page] = v  # where the reader keeps them, as batch_get_into does

    def remove(self, names: list[str]) -> None:
        if hasattr(self.b, "_store"):
            self.b._store.batch_remove(names, True)
        else:
            self.b._client.delete(*names)


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_store_bench(args: Any, page_sizes: tuple[int, ...]) -> dict[str, Any]:
    total_mib = args.total_mib or 128
    batch_bytes = args.batch_mib << 20
    batches = max(1, (total_mib << 20) // batch_bytes)
    data = memoryview(bytearray(os.urandom(batch_bytes)))
    out = memoryview(bytearray(batch_bytes))
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_store(args.backend))
        spec = parse_storage_url(url)
        if spec.backend != args.backend:
            raise SystemExit(f"--url {url!r} is a {spec.backend} URL, not {args.backend}")
        b = stack.enter_context(open_storage(spec, shard=(0, 1)))
        raw = _Raw(b, batch_bytes)
        raw.fill(data)
        cases = []
        for page in page_sizes:
            per = batch_bytes // page
            pages = [data[i * page : (i + 1) * page] for i in range(per)]
            outs = [out[i * page : (i + 1) * page] for i in range(per)]
            runs: dict[str, list[float]] = {"put": [], "get": [], "floor_put": [], "floor_get": []}
            for rep in range(args.repeats):
                keys = [[StorageKey("bench", rep, 0, 1, bt * per + i) for i in range(per)] for bt in range(batches)]
                names = [[f"bench-raw/{page}/{rep}/{bt}/{i}" for i in range(per)] for bt in range(batches)]

                for prefix in ("", "floor_") if rep % 2 == 0 else ("floor_", ""):
                    if prefix:
                        t_put, t_get = _raw_pass(raw, names, page)
                    else:
                        t_put, t_get = _backend_pass(b, keys, pages, outs)
                    runs[prefix + "put"].append(batch_bytes * batches / t_put / 1e9)
                    runs[prefix + "get"].append(batch_bytes * batches / t_get / 1e9)
                for ks, ns in zip(keys, names, strict=True):
                    b.delete(ks)
                    raw.remove(ns)
            for op in ("put", "get"):
                ratios = [x / f for x, f in zip(runs[op], runs[f"floor_{op}"], strict=True)]
                cases.append(
                    {
                        "op": op,
                        "page_bytes": page,
                        "gbps": round(statistics.median(runs[op]), 3),
                        "floor_gbps": round(statistics.median(runs[f"floor_{op}"]), 3),
                        "ratio": round(statistics.median(runs[op]) / statistics.median(runs[f"floor_{op}"]), 3),
                        "ratio_min": round(min(ratios), 3),
                        "ratio_max": round(max(ratios), 3),
                        "batch_pages": per,
                        "total_bytes": batch_bytes * batches,
                    }
                )
    return {"backend": args.backend, "store": spec.describe(), "cases": cases, "repeats": args.repeats}


def _backend_pass(b: Any, keys: list[list[StorageKey]], pages: list[Any], outs: list[Any]) -> tuple[float, float]:
    t_put = _timed(lambda: [_check(b.put(ks, pages), b) for ks in keys])
    t_get = _timed(lambda: [_check(b.get(ks, outs), b) for ks in keys])
    if bytes(outs[-1]) != bytes(pages[-1]):
        raise RuntimeError("get returned the wrong bytes")
    return t_put, t_get


def _raw_pass(raw: _Raw, names: list[list[str]], page: int) -> tuple[float, float]:
    t_put = _timed(lambda: [raw.put(ns, page) for ns in names])
    return t_put, _timed(lambda: [raw.get(ns, page) for ns in names])


def _check(results: list[bool], b: Any) -> None:
    if not all(results):
        raise RuntimeError(f"the backend missed: {b.stats()}")
