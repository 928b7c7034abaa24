"""Page copy throughput of the transfer engine against a plain tensor copy of the same bytes.

For page sizes 16 KiB .. 1 MiB and both host layouts, back up (d2h) and load (h2d) a random,
non-contiguous list of pages through `TransferEngine` and compare with `dst.copy_(src)` of one
contiguous tensor of the same total size, measured in the same run (on a GPU: device <-> pinned host,
i.e. PCIe). Prints one JSON object with --json, a table otherwise.

    .venv/bin/python scripts/bench_transfer.py --json [--runs 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpcache.io import native  # noqa: E402
from tpcache.io.kv_pool import HOST_LAYOUTS, DevicePool, HostPool, KVLayout  # noqa: E402
from tpcache.io.transfer import TransferEngine  # noqa: E402

# 8 layers, 4 KV heads per rank, head_dim 128, bf16: one K block is page_size KiB, a page 16 x that.
LAYERS, HEADS, HEAD_DIM = 8, 4, 128
PAGE_TOKENS = (1, 4, 16, 64)  # -> 16 KiB, 64 KiB, 256 KiB, 1 MiB pages


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CacheFlush:
    """Writes a scratch buffer twice the size of a large L3 so that every timed copy starts from
    memory, not from what the previous copy left in the cache (ops here move about one L3's worth)."""

    def __init__(self, nbytes: int = 128 << 20) -> None:
        self.scratch = torch.empty(nbytes, dtype=torch.uint8)

    def __call__(self) -> None:
        self.scratch.fill_(1)


def _best_pair(
    op: Callable[[], None], floor: Callable[[], None], device: torch.device, repeats: int, flush: Callable[[], None]
):
    """Best times of `op` and `floor`, measured alternately so both see the same machine load."""
    best = [float("inf"), float("inf")]
    for fn in (op, floor):  # warm-up: page faults, allocator caches, thread start
        fn()
    for _ in range(repeats):
        for i, fn in enumerate((op, floor)):
            flush()
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def _op(submit: Callable, ids: Iterator[int], src: list[int], dst: list[int]) -> None:
    done = submit(next(ids), src, dst).wait()
    if not done.ok:
        raise RuntimeError(f"transfer failed: {done.error}")


def run(moved_bytes: int, repeats: int, seed: int, threads: int | None, use_native: bool | None) -> dict[str, object]:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if threads is None:
        # a CPU rank shares the host's cores with its peers; one thread per rank is the realistic case
        threads = torch.get_num_threads() if device.type == "cuda" else 1
    torch.set_num_threads(threads)
    rng = random.Random(seed)
    flush = CacheFlush() if device.type == "cpu" else (lambda: None)
    cases: list[dict[str, object]] = []
    for tokens in PAGE_TOKENS:
        layout = KVLayout(LAYERS, HEADS, HEAD_DIM, torch.bfloat16, tokens)
        pages = max(1, moved_bytes // layout.page_bytes)
        pool_pages = 4 * pages  # the pages moved are a random quarter of each pool
        dev = DevicePool(layout, pool_pages, device)
        dev.kv.view(torch.uint8).random_(generator=torch.Generator(device).manual_seed(seed))
        nbytes = pages * layout.page_bytes
        floor_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        pinned = device.type == "cuda"
        floor_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        # Write both before timing: memory never written reads as the kernel's one shared zero page,
        # which sits in the cache and would make the floor's first copies look far too fast.
        floor_src.fill_(1)
        floor_host.fill_(2)
        floors = {
            "d2h": partial(floor_host.copy_, floor_src, non_blocking=pinned),
            "h2d": partial(floor_src.copy_, floor_host, non_blocking=pinned),
        }
        for host_layout in HOST_LAYOUTS:
            host = HostPool(layout, pool_pages, host_layout)
            dev_pages = rng.sample(range(pool_pages), pages)
            host_slots = rng.sample(range(pool_pages), pages)
            with TransferEngine(dev, host, use_native=use_native) as engine:
                ids = itertools.count(1)
                backup = partial(_op, engine.submit_backup, ids, dev_pages, host_slots)
                load = partial(_op, engine.submit_load, ids, host_slots, dev_pages)
                timed = {
                    "d2h": _best_pair(backup, floors["d2h"], device, repeats, flush),
                    "h2d": _best_pair(load, floors["h2d"], device, repeats, flush),
                }
            for direction in ("d2h", "h2d"):
                gbps = nbytes / timed[direction][0] / 1e9
                floor_gbps = nbytes / timed[direction][1] / 1e9
                cases.append(
                    {
                        "direction": direction,
                        "layout": host_layout,
                        "page_bytes": layout.page_bytes,
                        "row_bytes": layout.row_bytes,
                        "pages": pages,
                        "gbps": round(gbps, 3),
                        "floor_gbps": round(floor_gbps, 3),
                        "ratio": round(gbps / floor_gbps, 3),
                    }
                )
            del host
    return {
        "device": str(device),
        "layers": LAYERS,
        "moved_bytes": moved_bytes,
        "torch_threads": torch.get_num_threads(),
        "copier": "cuda" if device.type == "cuda" else ("native" if native_copier(use_native) else "torch"),
        "cases": cases,
    }


def native_copier(use_native: bool | None) -> bool:
    return native.AVAILABLE if use_native is None else use_native


def median_of_runs(results: list[dict[str, object]]) -> dict[str, object]:
    """Per case, the run with the median ratio (lower median for an even count): on a shared machine
    one run can be far off, and both figures of a case then still come from the same run."""
    merged = dict(results[0], runs=len(results))
    cases = []
    for per_run in zip(*(r["cases"] for r in results), strict=True):  # type: ignore[call-overload]
        ranked = sorted(per_run, key=lambda case: case["ratio"])
        cases.append(ranked[(len(ranked) - 1) // 2])
    merged["cases"] = cases
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--mib", type=int, default=32, help="MiB moved per op (default 32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on CPU)")
    parser.add_argument(
        "--runs",
        type=int,
        default=3,
        help="whole measurements; each case reports its median run (default 3: one run on a shared machine is noisy)",
    )
    parser.add_argument(
        "--copier",
        choices=("auto", "native", "torch"),
        default="auto",
        help="CPU copy path: the native row copy, the torch planner, or auto (native where it was built)",
    )
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    use_native = {"auto": None, "native": True, "torch": False}[args.copier]
    runs = [run(args.mib << 20, args.repeats, args.seed, args.threads, use_native) for _ in range(args.runs)]
    result = median_of_runs(runs)
    if args.json:
        print(json.dumps(result))
        return
    print(f"device {result['device']} ({result['copier']} copies), {result['layers']} layers, {args.mib} MiB per op")
    print(f"{'dir':4} {'layout':12} {'page':>8} {'GB/s':>8} {'floor':>8} {'ratio':>6}")
    for case in result["cases"]:  # type: ignore[union-attr]
        print(
            f"{case['direction']:4} {case['layout']:12} {case['page_bytes'] >> 10:>6}Ki "
            f"{case['gbps']:>8.2f} {case['floor_gbps']:>8.2f} {case['ratio']:>6.2f}"
        )


if __name__ == "__main__":
    main()
