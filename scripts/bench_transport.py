"""Latency of the round's MIN all-reduce per transport, in one run on the same processes.

    python scripts/bench_transport.py --world-size 2 --rounds 5000 --json

Spawns ``--world-size`` ranks on 127.0.0.1 (gloo group), then times, in interleaved blocks, a
``--vector-len`` int64 all-reduce on the chosen transport (``--transport``, default auto = shm), on gloo,
and the floor: a raw loopback TCP exchange of the same bytes. Prints rank 0's numbers as JSON:
transport, world_size, round_us_p50, round_us_p99, gloo_round_us_p50, floor_us_p50, speedup_vs_gloo.
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

    from tpcache.comm import make_collective
    from tpcache.comm.benchutil import TcpFloor, allreduce_fn, interleaved, summarize_us

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    fast = make_collective(opts["transport"], capacity=opts["vector_len"])
    gloo = make_collective("torch", capacity=opts["vector_len"])
    floor = TcpFloor()
    vector = [(rank * 7919 + i * 104729) % 1000003 - 500000 for i in range(opts["vector_len"])]
    # The three must agree before their speed means anything.
    answers = {fast.allreduce_min(vector, 30.0) == gloo.allreduce_min(vector, 30.0) == floor.exchange(vector)}
    samples = interleaved(
        {
            "fast": allreduce_fn(fast, vector),
            "gloo": allreduce_fn(gloo, vector),
            "floor": lambda: floor.exchange(vector),
        },
        rounds=opts["rounds"],
        blocks=opts["blocks"],
        warmup=opts["warmup"],
    )
    if rank == 0:
        fast_s, gloo_s, floor_s = (summarize_us(samples[k]) for k in ("fast", "gloo", "floor"))
        results.put(
            {
                "transport": fast.name,
                "world_size": world,
                "vector_len": opts["vector_len"],
                "rounds": opts["rounds"],
                "round_us_p50": fast_s["p50_us"],
                "round_us_p99": fast_s["p99_us"],
                "round_us_mean": fast_s["mean_us"],
                "gloo_round_us_p50": gloo_s["p50_us"],
                "gloo_round_us_p99": gloo_s["p99_us"],
                "floor_us_p50": floor_s["p50_us"],
                "floor_us_p99": floor_s["p99_us"],
                "speedup_vs_gloo": round(gloo_s["p50_us"] / fast_s["p50_us"], 2),
                "ratio_vs_floor": round(fast_s["p50_us"] / floor_s["p50_us"], 2),
                "results_agree": answers == {True},
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
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--vector-len", type=int, default=48)
    parser.add_argument("--transport", choices=("auto", "shm", "torch"), default="auto")
    parser.add_argument("--blocks", type=int, default=10, help="interleaved blocks per transport")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    args = parser.parse_args()

    opts = {k: getattr(args, k) for k in ("rounds", "vector_len", "transport", "blocks", "warmup")}
    from tpcache.comm.benchutil import run_ranks

    report = run_ranks(rank_main, args.world_size, opts)
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
