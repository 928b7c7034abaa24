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
  ``SET`` and ``MGET``); for the file store, ``FileBackend`` moving the pre-split shards (its own
  floor against raw file I/O is ``bench_storage.py``'s);
- ``raw_pages``: the same client moving whole pages (what the per-shape layout moves).

Each repeat alternates which side runs first. Printed per case: each side's median throughput, and
the sharded side's ratio to each other side, by wall time (``vs_raw_shards``) and by process CPU
time (``vs_raw_shards_cpu``, steadier on a loaded machine), each the median of the per-repeat
ratios with their range (``_spread``). Read amplification: for each writer/reader TP pair, the
bytes the reader's ranks read from a store the writer's ranks filled, over the bytes of their
slices (or the line that refuses the pair).

Usage: ``python scripts/bench_storage.py --shards --json [--backend file|redis|mooncake] [--total-mib N]``
(this module is its implementation; the stores are started on loopback as the tests do; Mooncake
needs a private network namespace).
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
from tpcache.io.errors import KVLayoutError  # noqa: E402
from tpcache.io.kv_pool import KVLayout  # noqa: E402
from tpcache.io.storage import StorageKey, parse_storage_url  # noqa: E402
from tpcache.io.storage.file import FileBackend  # noqa: E402
from tpcache.io.storage.memory import MemoryBackend  # noqa: E402
from tpcache.io.storage.sharded import ModelShape, ShardedStorage, ShardLayoutError  # noqa: E402
from tpcache.io.storage.url import _open  # noqa: E402

HEADS, DIM, TOKENS = 8, 128, 16
LAYERS_FOR = {64 << 10: 1, 1 << 20: 16}


def _timed(fn: Any) -> tuple[float, float]:
    """Wall and process CPU seconds of ``fn()``."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _inner(backend: str, url: str, work: Path) -> Any:
    if backend == "file":
        return FileBackend(work, capacity_bytes=4 << 30, owner="bench")
    return _open(parse_storage_url(url), None, 1 << 30)  # type: ignore[arg-type]


class _Counting(MemoryBackend):
    """A store that counts the bytes its gets return."""

    read_bytes = 0

    def get(self, keys: Any, out: Any) -> list[bool]:
        found = super().get(keys, out)
        self.read_bytes += sum(memoryview(b).nbytes for b, ok in zip(out, found, strict=True) if ok)
        return found


def amplification(layers: int = 32, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> list[dict[str, Any]]:
    """Per writer/reader TP pair: the bytes the reader's ranks read from the store over the bytes of
    their slices, measured on one page the writer's ranks stored (a shape that would split a shard
    is refused at start: its line is given instead)."""
    out = []
    for writer in sizes:
        for reader in sizes:
            row: dict[str, Any] = {"writer_tp": writer, "reader_tp": reader}
            store = _Counting()
            try:
                for tp, write in ((writer, True), (reader, False)):
                    for rank in range(tp):
                        lay = KVLayout.from_model(layers, HEADS, DIM, tp, torch.bfloat16, TOKENS)
                        model = ModelShape.of_rank("bench", lay, Shard(rank, tp))
                        view = ShardedStorage(store, model, Shard(rank, tp), lay)
                        page = torch.zeros(lay.page_bytes, dtype=torch.uint8)
                        key = StorageKey("bench", 1, 0, 1, 7)
                        assert (view.put if write else view.get)([key], [page]) == [True]
                        if not write:
                            row["needed"] = row.get("needed", 0) + lay.page_bytes
                row["read_amplification"] = round(store.read_bytes / row.pop("needed"), 3)
            except (ShardLayoutError, KVLayoutError) as exc:
                row["refused"] = str(exc)
            out.append(row)
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
        # per side, per repeat: (put, get) throughput by wall time and by process CPU time
        runs: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in sides_}
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
                tp = [_timed(functools.partial(side, bt, False)) for bt in range(batches)]
                tg = [_timed(functools.partial(side, bt, True)) for bt in range(batches)]
                runs[name].append(tuple(moved / sum(t[i] for t in ts) / 1e9 for ts in (tp, tg) for i in (0, 1)))
            if backend == "file":
                runs["raw_shards"].append(runs["backend_shards"][-1])
            r.close(batches + 1)
        for k, op in enumerate(("put", "get")):
            wall, cpu = 2 * k, 2 * k + 1
            med = {name: statistics.median(x[wall] for x in runs[name]) for name in runs}
            case: dict[str, Any] = {
                "backend": backend,
                "op": op,
                "page_bytes": page_bytes,
                "shards_per_page": shards,
                "shard_bytes": shard_bytes,
                **{f"{name}_gbps": round(med[name], 3) for name in sides_},
            }
            # ratios of one repeat's sides (run back to back), their median and range (min-max)
            for floor in ("backend_shards", "raw_shards", "raw_pages"):
                for label, i in (("", wall), ("_cpu", cpu)):
                    ratios = [a[i] / b[i] for a, b in zip(runs["sharded"], runs[floor], strict=True)]
                    case[f"vs_{floor}{label}"] = round(statistics.median(ratios), 3)
                    case[f"vs_{floor}{label}_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
            cases.append(case)
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
