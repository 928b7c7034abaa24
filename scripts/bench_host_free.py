#!/usr/bin/env python3
"""Host pool free list: lazy merge (tpcache) against an eager merge on every free.

The eager allocator rebuilds its free list under the lock on every free, as a concatenation
(``free = free + freed``), which costs O(free list) per call; the lazy one appends the freed slots
to a release queue and merges only when an allocation needs them. Both serve the same stream of
alloc/free calls over a pool of ``--slots`` slots; the floor is the eager allocator.

    python scripts/bench_host_free.py --json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpcache.core.treecore.allocator import HostAllocator  # noqa: E402


class EagerHostAllocator:
    """Merges every free into the free list at once, under the lock."""

    def __init__(self, num_pages: int) -> None:
        self._free = list(range(num_pages - 1, -1, -1))
        self._lock = threading.Lock()

    def alloc(self, n: int) -> list[int]:
        with self._lock:
            out = self._free[-n:]
            del self._free[-n:]
            return out

    def free(self, pages: list[int]) -> None:
        with self._lock:
            self._free = self._free + pages  # a new free list per call, as a tensor cat would be


def run(alloc_cls: type, slots: int, calls: int, batch: int, seed: int) -> float:
    rng = random.Random(seed)
    pool = alloc_cls(slots)
    held: list[list[int]] = [pool.alloc(batch) for _ in range(slots // (2 * batch))]
    start = time.perf_counter()
    for _ in range(calls):
        victim = held.pop(rng.randrange(len(held)))
        pool.free(victim)
        held.append(pool.alloc(batch))
    return calls / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=262_144, help="host pool size in slots")
    ap.add_argument("--calls", type=int, default=20_000, help="free+alloc pairs")
    ap.add_argument("--batch", type=int, default=8, help="slots per alloc/free")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    eager = run(EagerHostAllocator, args.slots, args.calls, args.batch, 1)
    lazy = run(HostAllocator, args.slots, args.calls, args.batch, 1)
    out = {
        "slots": args.slots,
        "batch": args.batch,
        "lazy_pairs_per_s": round(lazy),
        "eager_pairs_per_s": round(eager),
        "floor": "eager merge on every free",
        "ratio": round(lazy / eager, 2),
    }
    print(json.dumps(out) if args.json else "\n".join(f"{k:<18} {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
