"""Benchmark: put and get through the shared storage layout (shards of the model's KV heads and
layers, the transpose included) against the same shards moved without it, and against whole pages.

For each backend (``file``, ``redis``, ``mooncake``) and each rank page size (64 KiB: a 1-layer
model; 1 MiB: 16 layers; both 8 KV heads of dim 128, bf16, 16-token pages, read by TP=1, so a page
is 8 or 64 shards of 8 or 16 KiB):

- ``sharded``: ``ShardedStorage.put`` / ``get`` of whole pages (split and transposed on put,
  assembled on get, every shard checksummed);
- ``backend_shards``: tpcache's backend moving the pre-split shards (records, checksums): what the
  layout adds beyond it is the split, the transpose and the keys;
- ``raw_shards``: the store's own client moving the same number of values of the same sizes
  (Mooncake ``batch_put_from`` / ``batch_get_into`` on a registered buffer, Redis pipelined
  ``SET`` / ``GET``); for the file store, ``FileBackend`` moving the pre-split shards (its own
  floor against raw file I/O is ``bench_storage.py``'s);
- ``raw_pages``: the same client moving whole pages (what the per-shape layout moves).

Each repeat alternates which side runs first; medians are printed. Read amplification: for each
writer/reader TP pair, the shard bytes a reader rank reads over the bytes of its slice.

Usage: ``python scripts/bench_shards.py --json [--backend file|redis|mooncake] [--total-mib N]``
(the stores are started on loopback as the tests do; Mooncake needs a private network namespace).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from scripts.bench_store import _Raw, local_store  # noqa: E402
from tpcache.comm.parallel import Shard  # noqa: E402
from tpcache.io.kv_pool import KVLayout  # noqa: E402
from tpcache.io.storage import StorageKey, parse_storage_url  # noqa: E402
from tpcache.io.storage.file import FileBackend  # noqa: E402
from tpcache.io.storage.sharded import ModelShape, ShardedStorage  # noqa: E402
from tpcache.io.storage.url import _open  # noqa: E402

HEADS, DIM, TOKENS = 8, 128, 16
LAYERS_FOR = {64 << 10: 1, 1 << 20: 16}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _inner(backend: str, url: str, work: Path) -> Any:
    if backend == "file":
        return FileBackend(work, capacity_bytes=4 << 30, owner="bench")
    return _open(parse_storage_url(url), None, 1 << 30)  # type: ignore[arg-type]


def amplification() -> list[dict[str, Any]]:
    """Shard bytes a reader rank reads over its slice's bytes, per writer/reader TP pair."""
    out = []
    for layers in (32,):
        for writer in (1, 2, 4, 8):
            for reader in (1, 2, 4, 8):
                lay = KVLayout.from_model(layers, HEADS, DIM, reader, torch.bfloat16, TOKENS)
                model = ModelShape.of_rank("bench", lay, Shard(0, reader))
                ranges = model.ranges(lay, Shard(0, reader))
                read = len(ranges) * model.shard_bytes
                out.append({"writer_tp": writer, "reader_tp": reader, "read_amplification": read / lay.page_bytes})
    return out


class _Rep:
    """One repeat of one page size: a fresh store, the three sides' batched put and get."""

    def __init__(self, backend: str, url: str, lay: KVLayout, per_batch: int, rep: int) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="tpcache-bench-shards-"))
        self.inner = _inner(backend, url, self.work)
        model = ModelShape.of_rank("bench", lay, Shard(0, 1))
        self.store = ShardedStorage(self.inner, model, Shard(0, 1), lay)
        self.page_bytes, self.per_batch, self.rep, self.sb = lay.page_bytes, per_batch, rep, model.shard_bytes
        self.pages = [torch.randint(0, 256, (lay.page_bytes,), dtype=torch.uint8) for _ in range(per_batch)]
        self.outs = [torch.empty(lay.page_bytes, dtype=torch.uint8) for _ in range(per_batch)]
        self.split = self.store._split([self.store._page(p, writable=False) for p in self.pages])
        self.shard_outs = [torch.empty(self.sb, dtype=torch.uint8) for _ in self.split]
        self.raw = _Raw(self.inner, per_batch * lay.page_bytes) if backend != "file" else None
        if self.raw is not None:
            self.raw.fill(memoryview(torch.cat(self.pages).numpy()))

    def keys(self, tag: str, bt: int, n: int) -> list[StorageKey]:
        return [StorageKey(tag, self.rep, 0, 1, bt * n + i) for i in range(n)]

    def names(self, tag: str, bt: int, n: int) -> list[str]:
        return [f"bench-{tag}/{self.page_bytes}/{self.rep}/{bt}/{i}" for i in range(n)]

    def sharded(self, bt: int, get: bool) -> None:
        keys = self.keys("b", bt, self.per_batch)
        assert all(self.store.get(keys, self.outs) if get else self.store.put(keys, self.pages))

    def backend_shards(self, bt: int, get: bool) -> None:
        keys = self.keys("r", bt, len(self.split))
        assert all(self.inner.get(keys, self.shard_outs) if get else self.inner.put(keys, self.split))

    def raw_shards(self, bt: int, get: bool) -> None:
        if self.raw is None:
            self.backend_shards(bt, get)
        else:
            (self.raw.get if get else self.raw.put)(self.names("s", bt, len(self.split)), self.sb)

    def raw_pages(self, bt: int, get: bool) -> None:
        if self.raw is None:
            keys = self.keys("p", bt, self.per_batch)
            assert all(self.inner.get(keys, self.outs) if get else self.inner.put(keys, self.pages))
        else:
            (self.raw.get if get else self.raw.put)(self.names("p", bt, self.per_batch), self.page_bytes)

    def close(self, batches: int) -> None:
        with contextlib.suppress(Exception):
            if self.raw is not None:
                for bt in range(batches):
                    self.raw.remove(self.names("s", bt, len(self.split)) + self.names("p", bt, self.per_batch))
                    self.inner.delete(self.store._all_keys(self.keys("b", bt, self.per_batch)))
                    self.inner.delete(self.keys("r", bt, len(self.split)))
        self.store.close()
        shutil.rmtree(self.work, ignore_errors=True)


def run(backend: str, url: str, total: int, repeats: int, batch_bytes: int) -> list[dict[str, Any]]:
    cases = []
    for page_bytes, layers in LAYERS_FOR.items():
        lay = KVLayout.from_model(layers, HEADS, DIM, 1, torch.bfloat16, TOKENS)
        assert lay.page_bytes == page_bytes
        per_batch = max(1, batch_bytes // page_bytes)
        batches = max(1, total // (per_batch * page_bytes))
        moved = batches * per_batch * page_bytes
        sides_ = ("sharded", "backend_shards", "raw_shards", "raw_pages")
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in sides_}
        shards = shard_bytes = 0
        for rep in range(repeats):
            r = _Rep(backend, url, lay, per_batch, rep)
            shards, shard_bytes = len(r.split) // per_batch, r.sb
            sides = {name: getattr(r, name) for name in sides_}
            if backend == "file":  # the file store's floor is its own backend (see the docstring)
                del sides["raw_shards"]
            for side in sides.values():  # warm up: first calls allocate and fault pages in
                side(batches, False)
                side(batches, True)
            for name in list(sides) if rep % 2 == 0 else list(reversed(sides)):
                side = sides[name]
                tp = sum(_timed(functools.partial(side, bt, False)) for bt in range(batches))
                tg = sum(_timed(functools.partial(side, bt, True)) for bt in range(batches))
                runs[name].append((moved / tp / 1e9, moved / tg / 1e9))
            if backend == "file":
                runs["raw_shards"].append(runs["backend_shards"][-1])
            r.close(batches + 1)
        for k, op in enumerate(("put", "get")):
            med = {name: statistics.median(x[k] for x in runs[name]) for name in runs}
            cases.append(
                {
                    "backend": backend,
                    "op": op,
                    "page_bytes": page_bytes,
                    "shards_per_page": shards,
                    "shard_bytes": shard_bytes,
                    "sharded_gbps": round(med["sharded"], 3),
                    "backend_shards_gbps": round(med["backend_shards"], 3),
                    "raw_shards_gbps": round(med["raw_shards"], 3),
                    "raw_pages_gbps": round(med["raw_pages"], 3),
                    "vs_backend_shards": round(med["sharded"] / med["backend_shards"], 3),
                    "vs_raw_shards": round(med["sharded"] / med["raw_shards"], 3),
                    "vs_raw_pages": round(med["sharded"] / med["raw_pages"], 3),
                }
            )
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (the only output format)")
    ap.add_argument("--backend", choices=("file", "redis", "mooncake"), default="file")
    ap.add_argument("--total-mib", type=int, default=32, help="bytes moved per case and side")
    ap.add_argument("--batch-mib", type=int, default=4, help="bytes per put/get call")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        url = "" if args.backend == "file" else stack.enter_context(local_store(args.backend))
        cases = run(args.backend, url, args.total_mib << 20, args.repeats, args.batch_mib << 20)
    print(json.dumps({"cases": cases, "amplification": amplification(), "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
