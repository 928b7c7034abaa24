#!/usr/bin/env python3
"""What one round costs: prepare + all-reduce + commit, against the raw all-reduce it wraps.

    python scripts/bench_round.py --world-size 2 --json
    python scripts/bench_round.py --world-size 4 --transport torch --json

Spawns ``--world-size`` ranks on 127.0.0.1 (a gloo group). Each rank runs one TPCache on the chosen
round transport (auto: shared memory on one host) and one on gloo (metadata-only caches: copies
land at once, so what is timed is the round's own CPU work and its exchange). In interleaved blocks
it times, on the same processes:

- an empty round (nothing in flight) on the chosen transport, and on gloo;
- a round with work on each: before every timed round, untimed, one request (lock, alloc 4 pages,
  insert, release) under ``write_through``, so the timed round agrees on and commits a backup
  completion (and the evictions that the full pool then asks for); every timed work round is
  checked to have committed one;
- the raw all-reduce of the same vector on each transport, and the floor, a raw loopback TCP
  exchange of the same bytes;
- the raw shm all-reduce behind ``--busy-us`` of busy loop, timed together: how a rank's own work
  before the exchange adds to a round's wall time (on shared memory, one for one);
- on each transport, the raw all-reduce after the same untimed request as a round with work (on a
  cache of its own, whose untimed round before the request commits the last one's backup): the
  same gap between calls without the round, since gloo's latency moves with that gap;
- with ``--sglang`` (run it with SGLang's interpreter, ``.venv-sglang/bin/python``): SGLang's own
  per-step synchronisation on its floor, ``broadcast_pyobj`` of an empty list from rank 0 on the
  gloo group (what every TP scheduler runs each step to share the step's new requests, also when
  there are none).

Prints rank 0's numbers (p50 of wall time per call): round_us_p50/p99 and ratio (empty round /
raw all-reduce), work_round_us_p50/p99 and work_ratio (round with work / raw all-reduce), the
same for gloo (gloo_*), the local part of a work round (prepare and commit, thread CPU time, which
load moves little), floor_us_p50, speedup_vs_gloo, busy_raw_us_p50 (busy loop + raw all-reduce),
work_exchange_us_p50 (the all-reduce inside a round with work, wall time, waiting for the other rank
included), work_same_gap_ratio / gloo_work_same_gap_ratio: the round with work over the raw
all-reduce after the same request (not the issue's floor: that is the plain raw all-reduce above),
and work_gap_raw_ratio / gloo_work_gap_raw_ratio: that raw all-reduce over the plain one, what the
request before a round costs the exchange alone (a round with work, which adds its own prepare and
commit to it, cannot come under this ratio). With ``--sglang`` also sglang_broadcast_us_p50, the
spread (min, max) of the per-block p50s of it and of the empty and work rounds, and
sglang_broadcast_ratio / sglang_work_broadcast_ratio (an empty / work round over the broadcast).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def busy(seconds: float) -> None:
    """Spin for ``seconds`` of wall time (a rank's work before the exchange, without the cache)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class WorkRounds:
    """The request before each timed round (untimed) and the timed round that commits its backup."""

    def __init__(self, tp: Any, salt: int) -> None:
        self.tp = tp
        self.n = salt
        self.rounds = 0
        self.completed = 0
        self.cpu_local: list[float] = []  # thread CPU seconds of prepare + commit per round
        self.exchange: list[float] = []  # wall seconds of the all-reduce inside the round

    def request(self) -> None:
        self.n += 1
        tokens = [(self.n * 977 + i) % 50_000 for i in range(64)]
        tp = self.tp
        lease, m = tp.lock(tokens)
        fresh = tp.alloc(lease, m.num_pages - m.device_pages)
        tp.insert(lease, tokens, m.device_page_ids + fresh)
        tp.release(lease)

    def step(self) -> None:
        report = self.tp.step()
        self.rounds += 1
        self.completed += len(report.completed) > 0

    def split_step(self) -> None:
        """The same round in its three parts, timing the local ones (prepare, commit) in CPU time
        and the all-reduce between them in wall time (waiting for the other ranks included)."""
        driver, cpu = self.tp.driver, time.thread_time
        t0 = cpu()
        vector = driver.begin()
        t1 = cpu()
        wall = time.perf_counter()
        reduced = driver.collective.allreduce_min(vector, driver.round_timeout_s)
        t2 = cpu()
        self.exchange.append(time.perf_counter() - wall)
        report = driver.end(reduced)
        self.cpu_local.append(cpu() - t2 + t1 - t0)
        self.rounds += 1
        self.completed += len(report.completed) > 0


class GapRaw:
    """The raw all-reduce after the same untimed request a round with work follows, on its own cache:
    its setup runs the round (untimed) that commits the previous request's backup, then a request."""

    def __init__(self, tp: Any, salt: int, timed: Any) -> None:
        self.work = WorkRounds(tp, salt)
        self.timed = timed

    def setup(self) -> None:
        self.work.step()
        self.work.request()


def _block_p50s_us(samples: list[float], blocks: int) -> list[float]:
    size = max(1, len(samples) // blocks)
    return [percentile_us(samples[i : i + size]) for i in range(0, len(samples) - size + 1, size)]


def percentile_us(samples: list[float]) -> float:
    from tpcache.comm.benchutil import percentile

    return round(percentile(samples, 0.5) * 1e6, 2)


def _sglang_floor(samples: dict[str, list[float]], s: dict[str, dict], opts: dict[str, Any]) -> dict[str, Any]:
    """SGLang's empty-step broadcast against tpcache's rounds: p50s, and the spread of per-block p50s."""
    out: dict[str, Any] = {"sglang_broadcast_us_p50": s["sglang_broadcast"]["p50_us"]}
    for name in ("sglang_broadcast", "round", "work_round"):
        blocks = _block_p50s_us(samples[name], opts["blocks"])
        out[f"{name}_us_block_p50_spread"] = [min(blocks), max(blocks)]
    out["sglang_broadcast_ratio"] = round(s["round"]["p50_us"] / s["sglang_broadcast"]["p50_us"], 3)
    out["sglang_work_broadcast_ratio"] = round(s["work_round"]["p50_us"] / s["sglang_broadcast"]["p50_us"], 3)
    return out


def rank_main(rank: int, world: int, port: int, opts: dict[str, Any], results: Any) -> None:
    import torch.distributed as dist

    from tpcache.comm import make_collective
    from tpcache.comm.benchutil import TcpFloor, allreduce_fn, interleaved, percentile, summarize_us
    from tpcache.core import CacheConfig
    from tpcache.engine import TPCache

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    config = CacheConfig(page_size=16, device_pages=4096, host_pages=8192, write_policy="write_through")
    fast = TPCache(config, make_collective(opts["transport"]))
    gloo = TPCache(config, make_collective("torch"))
    floor = TcpFloor()
    vector = fast.round.layout.pack_values([0] * len(fast.round.layout.fields))
    work = WorkRounds(fast, 0)
    gloo_work = WorkRounds(gloo, 1 << 20)
    local = WorkRounds(fast, 2 << 20)

    raw = allreduce_fn(fast.collective, vector)
    gap = GapRaw(TPCache(config, fast.collective), 3 << 20, raw)  # the same collective, its own cache
    gloo_gap = GapRaw(TPCache(config, gloo.collective), 4 << 20, allreduce_fn(gloo.collective, vector))
    calls_before = fast.collective.calls
    rounds_before = fast.round.number + gap.work.tp.round.number
    extra = {}
    if opts["sglang"]:
        from sglang.srt.utils import broadcast_pyobj

        group = dist.group.WORLD  # gloo, as SGLang's TP CPU group
        extra["sglang_broadcast"] = lambda: broadcast_pyobj([], rank, group, src=0)
    samples = interleaved(
        {
            **extra,
            "round": fast.step,
            "work_round": (work.request, work.step),
            "raw": raw,
            "gloo_round": gloo.step,
            "gloo_work_round": (gloo_work.request, gloo_work.step),
            "gloo_raw": allreduce_fn(gloo.collective, vector),
            "floor": lambda: floor.exchange(vector),
            "split_work_round": (local.request, local.split_step),
            "busy_raw": lambda: (busy(opts["busy_us"] * 1e-6), raw()),
            "gap_raw": (gap.setup, gap.timed),
            "gloo_gap_raw": (gloo_gap.setup, gloo_gap.timed),
        },
        rounds=opts["rounds"],
        blocks=opts["blocks"],
        warmup=opts["warmup"],
    )
    raw_calls = 3 * (opts["rounds"] + opts["warmup"])  # the raw all-reduce alone, behind the busy loop, after a request
    rounds_run = fast.round.number + gap.work.tp.round.number - rounds_before
    per_round = (fast.collective.calls - calls_before - raw_calls) / rounds_run
    if rank == 0:
        s = {k: summarize_us(v) for k, v in samples.items()}
        cpu_local_us = round(percentile(local.cpu_local, 0.5) * 1e6, 2)
        exchange_us = round(percentile(local.exchange, 0.5) * 1e6, 2)
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
                "work_round_us_p50": s["work_round"]["p50_us"],
                "work_round_us_p99": s["work_round"]["p99_us"],
                "work_ratio": round(s["work_round"]["p50_us"] / s["raw"]["p50_us"], 3),
                "work_rounds_committed": f"{work.completed}/{work.rounds}",
                "work_local_cpu_us_p50": cpu_local_us,
                "work_exchange_us_p50": exchange_us,
                "gloo_round_us_p50": s["gloo_round"]["p50_us"],
                "gloo_work_round_us_p50": s["gloo_work_round"]["p50_us"],
                "gloo_allreduce_us_p50": s["gloo_raw"]["p50_us"],
                "gloo_ratio": round(s["gloo_round"]["p50_us"] / s["gloo_raw"]["p50_us"], 3),
                "gloo_work_ratio": round(s["gloo_work_round"]["p50_us"] / s["gloo_raw"]["p50_us"], 3),
                "gloo_work_rounds_committed": f"{gloo_work.completed}/{gloo_work.rounds}",
                "floor_us_p50": s["floor"]["p50_us"],
                "speedup_vs_gloo": round(s["gloo_round"]["p50_us"] / s["round"]["p50_us"], 2),
                "busy_us": opts["busy_us"],
                "busy_raw_us_p50": s["busy_raw"]["p50_us"],
                "work_gap_raw_us_p50": s["gap_raw"]["p50_us"],
                "work_same_gap_ratio": round(s["work_round"]["p50_us"] / s["gap_raw"]["p50_us"], 3),
                "work_gap_raw_ratio": round(s["gap_raw"]["p50_us"] / s["raw"]["p50_us"], 3),
                "gloo_work_gap_raw_us_p50": s["gloo_gap_raw"]["p50_us"],
                "gloo_work_same_gap_ratio": round(s["gloo_work_round"]["p50_us"] / s["gloo_gap_raw"]["p50_us"], 3),
                "gloo_work_gap_raw_ratio": round(s["gloo_gap_raw"]["p50_us"] / s["gloo_raw"]["p50_us"], 3),
                "open": not fast.core.closed and not gloo.core.closed,
                **(_sglang_floor(samples, s, opts) if opts["sglang"] else {}),
            }
        )
    dist.barrier()
    floor.close()
    gap.work.tp.close()
    gloo_gap.work.tp.close()
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
    parser.add_argument("--busy-us", type=float, default=40.0, help="busy loop before the busy_raw all-reduce")
    parser.add_argument("--sglang", action="store_true", help="also time SGLang's broadcast_pyobj of an empty list")
    parser.add_argument("--json", action="store_true", help="print one JSON object on one line")
    args = parser.parse_args()

    opts = {k: getattr(args, k) for k in ("rounds", "transport", "blocks", "warmup", "busy_us", "sglang")}
    from tpcache.comm.benchutil import run_ranks

    report = run_ranks(rank_main, args.world_size, opts)
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
