#!/usr/bin/env python3
"""What one round costs: prepare + all-reduce + commit, against the raw all-reduce it wraps.

    python scripts/bench_round.py --world-size 2 --json
    python scripts/bench_round.py --world-size 4 --transport torch --json

Spawns ``--world-size`` ranks on 127.0.0.1 (a gloo group). Each rank runs one TPCache on the chosen
round transport (auto: shared memory on one host) and one on gloo, with a request between rounds
so that commits have completions to apply. In interleaved blocks it times, on the same processes:
the round on the chosen transport, a raw all-reduce of the same vector on that transport, the
round on gloo, and the floor, a raw loopback TCP exchange of the same bytes. Prints rank 0's
numbers: world_size, transport, collectives_per_round, round_us_p50/p99, allreduce_us_p50, ratio
(round / raw all-reduce), gloo_round_us_p50, floor_us_p50, speedup_vs_gloo.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_main(rank: int, world: int, port: int, opts: dict[str, Any], results: Any) -> None:
    import torch.distributed as dist

    from tpcache.core import CacheConfig
    from tpcache.dist import make_collective
    from tpcache.dist.benchutil import TcpFloor, allreduce_fn, interleaved, summarize_us
    from tpcache.engine import TPCache

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    config = CacheConfig(page_size=16, device_pages=4096, host_pages=8192, write_policy="write_through")
    fast = TPCache(config, make_collective(opts["transport"]))
    gloo = TPCache(config, make_collective("torch"))
    floor = TcpFloor()
    vector = fast.round.layout.pack_values([0] * len(fast.round.layout.fields))
    counter = {"fast": 0, "gloo": 0}

    def round_of(tp: TPCache, name: str):  # noqa: ANN202
        def run() -> None:
            # A request per round (untimed work is excluded by timing only step()).
            n = counter[name] = counter[name] + 1
            tokens = [(n * 977 + i) % 50_000 for i in range(64)]
            lease, m = tp.lock(tokens)
            fresh = tp.alloc(lease, m.num_pages - m.device_pages)
            tp.insert(lease, tokens, m.device_page_ids + fresh)
            tp.release(lease)

        return run

    prepare = {"fast": round_of(fast, "fast"), "gloo": round_of(gloo, "gloo")}

    calls_before = fast.collective.calls
    rounds_before = fast.round.number
    samples = interleaved(
        {
            "round": lambda: fast.step(),
            "request": prepare["fast"],
            "raw": allreduce_fn(fast.collective, vector),
            "gloo_round": lambda: gloo.step(),
            "gloo_request": prepare["gloo"],
            "floor": lambda: floor.exchange(vector),
        },
        rounds=opts["rounds"],
        blocks=opts["blocks"],
        warmup=opts["warmup"],
    )
    raw_calls = opts["rounds"] + opts["warmup"]
    per_round = (fast.collective.calls - calls_before - raw_calls) / (fast.round.number - rounds_before)
    if rank == 0:
        s = {k: summarize_us(v) for k, v in samples.items()}
        results.put(
            {
                "world_size": world,
                "transport": fast.collective.name,
                "collectives_per_round": per_round,
                "rounds": opts["rounds"],
                "vector_len": len(vector),
                "round_us_p50": s["round"]["p50_us"],
                "round_us_p99": s["round"]["p99_us"],
                "allreduce_us_p50": s["raw"]["p50_us"],
                "ratio": round(s["round"]["p50_us"] / s["raw"]["p50_us"], 3),
                "gloo_round_us_p50": s["gloo_round"]["p50_us"],
                "floor_us_p50": s["floor"]["p50_us"],
                "speedup_vs_gloo": round(s["gloo_round"]["p50_us"] / s["round"]["p50_us"], 2),
                "request_us_p50": s["request"]["p50_us"],
                "open": not fast.core.closed and not gloo.core.closed,
            }
        )
    dist.barrier()
    floor.close()
    fast.close()
    gloo.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--transport", choices=("auto", "shm", "torch"), default="auto")
    parser.add_argument("--blocks", type=int, default=10, help="interleaved blocks per measurement")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print one JSON object on one line")
    args = parser.parse_args()

    opts = {k: getattr(args, k) for k in ("rounds", "transport", "blocks", "warmup")}
    from tpcache.dist.benchutil import run_ranks

    report = run_ranks(rank_main, args.world_size, opts)
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
