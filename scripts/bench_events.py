"""What the KV-event stream costs rank 0: CPU time per request with events on and off.

    python scripts/bench_events.py --json [--runs 5] [--requests 300] [--pages 8]

Starts two local 2-rank services (metadata only, CPU) that differ only in ``--events-endpoint``:
each with a small device tier and a host tier kept full (``write_through``), so that every request
(lock, alloc, insert, release of ``--pages`` new pages, a quarter of them behind a shared prefix)
inserts pages and evicts others on both tiers. The events-on service has the reference subscriber
connected (``tpcache.events.Subscriber``, in a process of its own, so that the driving client's pace
is the same for both services), reading every batch and checking every digest. A run drives
``--requests`` requests through each service in ``--slices`` alternating slices (off, on, on, off,
...) and sums rank 0's CPU time (all threads, /proc schedstat) around each slice. Rank r of both
services (every thread) is pinned to CPU r (modulo the CPUs; ``--no-pin``: not), so that the two
services run on the same cores and a rank never migrates: on a shared machine that narrows the
spread several times over (calibrated 0.99-1.05 pinned against 0.84-1.41 unpinned). ``--calibrate``
runs both services with events off: the ratio's noise on this machine; ``--no-subscriber`` leaves
the stream without a subscriber; ``--batch-ms`` sets the events-on service's ``--events-batch-ms``.

``core_us_per_request_off`` / ``_on`` and ``core_ratio`` come first: the round thread's share
alone, in this process (a core's requests with and without its feed published; this thread's CPU
time, which other processes' load moves far less than a whole service's).

Printed: ``cpu_us_per_request_off`` / ``_on`` (medians over runs), ``ratio`` = the median over runs
of off / on (1.0: events cost nothing; the target is >= 0.95), ``ratio_min`` / ``ratio_max`` its
spread and ``ratios`` every run's; the subscriber's counters (batches, digests checked,
mismatches, resyncs) and the publisher's (pages stored and removed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.local import spawn_ranks, stop_ranks, wait_ready  # noqa: E402
from protocol.errors import NoSpace  # noqa: E402
from tpcache.client import Client  # noqa: E402
from tpcache.events import Subscriber  # noqa: E402
from tpcache.service.config import build_config  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` so far, all its threads, to the nanosecond (Linux
    /proc/PID/task/*/schedstat; /proc/PID/stat counts 10 ms ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def subscriber_process(endpoint: str, replay_endpoint: str) -> int:
    """Follow the group until stdin closes, then print the subscriber's counters (a router's
    process: the driving client's pace stays the same with events on and off)."""
    sub = Subscriber()
    group = sub.follow(endpoint, replay_endpoint)
    print("following", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
        sub.poll(0.05)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        sub.poll(0.1)
    print(json.dumps(group.counters), flush=True)
    sub.close()
    return 0


def core_cost(pages: int, page: int, runs: int, n: int = 2000) -> dict[str, Any]:
    """The round thread's share, in one process: a core's requests (lock, alloc, insert, release,
    the round's completions) with and without its change feed published (PUB socket, nobody
    subscribed), this thread's CPU time per request, alternating, median over ``runs``."""
    import zmq

    from tpcache.core import CacheConfig, CacheCore
    from tpcache.core.treecore.feed import ChangeFeed
    from tpcache.events.publisher import EventPublisher
    from tpcache.replay import drain

    def one(on: bool, seed: int) -> float:
        core = CacheCore(CacheConfig(page_size=page, device_pages=8 * pages, host_pages=16 * pages))
        pub = None
        if on:
            core.feed = feed = ChangeFeed()
            identity = {"incarnation": 1, "page_size": page}
            pub = EventPublisher(
                zmq.Context.instance(), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", identity, page_size=page
            )
        rng = random.Random(seed)
        prompts = [[rng.randrange(1 << 30) for _ in range(pages * page)] for _ in range(n)]
        start = time.thread_time()
        for tokens in prompts:
            lease, _ = core.lock(tokens)
            core.insert(lease, tokens, core.alloc(lease, pages))
            core.release(lease)
            drain(core)
            if pub is not None:
                pub.publish(feed.drain())
        spent = time.thread_time() - start
        if pub is not None:
            pub.close()
        return spent * 1e6 / n

    results = []
    for run in range(runs):
        order = (False, True) if run % 2 == 0 else (True, False)
        results.append({on: one(on, run) for on in order})
    ratios = sorted(r[False] / r[True] for r in results)
    return {
        "core_us_per_request_off": round(median(r[False] for r in results), 1),
        "core_us_per_request_on": round(median(r[True] for r in results), 1),
        "core_ratio": round(median(ratios), 3),
        "core_ratio_min": round(ratios[0], 3),
        "core_ratio_max": round(ratios[-1], 3),
    }


def requests(c: Client, rng: random.Random, n: int, pages: int, page: int) -> int:
    """``n`` requests (lock, alloc, insert, release); returns those that inserted."""
    inserted = 0
    shared = [rng.randrange(1 << 30) for _ in range(2 * page)]
    for _ in range(n):
        fresh = [rng.randrange(1 << 30) for _ in range(pages * page)]
        tokens = shared + fresh[: (pages - 2) * page] if rng.random() < 0.25 else fresh
        lk = c.lock(tokens, prefetch="none")
        have = list(c.match(tokens).device_page_ids)
        if len(have) == lk.hit_tokens // page and len(have) < pages:
            try:
                new = list(c.alloc(lk.lease, pages - len(have)).device_page_ids)
                c.insert(tokens, have + new, lease=lk.lease)
                inserted += 1
            except NoSpace:
                pass
        c.release(lk.lease)
    return inserted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--runs", type=int, default=5, help="alternating off/on runs; medians [5]")
    parser.add_argument("--requests", type=int, default=300, help="requests per service per run [300]")
    parser.add_argument("--pages", type=int, default=8, help="pages per request [8]")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page [16]")
    parser.add_argument("--slices", type=int, default=10, help="alternating slices per run [10]")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per service [2]")
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="leave the ranks unpinned (default: rank r of both on CPU r)"
    )
    parser.add_argument(
        "--calibrate", action="store_true", help="events off in both services: the ratio's noise on this machine"
    )
    parser.add_argument("--batch-ms", type=float, default=None, help="--events-batch-ms of the events-on service")
    parser.add_argument("--no-subscriber", action="store_true", help="events on, but nobody subscribed")
    parser.add_argument("--core-only", action="store_true", help="only the in-process round-thread share")
    parser.add_argument("--follow", nargs=2, help=argparse.SUPPRESS)  # the subscriber's own process
    args = parser.parse_args()
    if args.follow:
        return subscriber_process(*args.follow)
    if args.runs < 1 or args.requests < 1 or args.pages < 3 or args.ranks < 1:
        parser.error("--runs, --requests and --ranks must be at least 1, --pages at least 3")
    page = args.page_size
    out: dict[str, Any] = {"requests": args.requests, "pages": args.pages, "page_size": page, "ranks": args.ranks}
    out["events_batch_ms"] = args.batch_ms
    out["load_average_start"] = [round(x, 2) for x in os.getloadavg()]
    out.update(core_cost(args.pages, page, args.runs))
    if args.core_only:
        print(json.dumps(out))
        return 0
    with tempfile.TemporaryDirectory(prefix="tpcache-bench-events-") as tmp:
        services: dict[str, Any] = {}
        try:
            for mode in ("off", "on"):
                cli = {
                    "endpoint": "tcp://127.0.0.1:0",
                    "ready_file": str(Path(tmp) / f"ready-{mode}.json"),
                    "page_size": page,
                    "device_pages": 8 * args.pages,
                    "host_pages": 16 * args.pages,
                    "write_policy": "write_through",
                    "log_level": "ERROR",
                }
                if mode == "on" and not args.calibrate:
                    cli["events_endpoint"] = "0"
                    if args.batch_ms is not None:
                        cli["events_batch_ms"] = args.batch_ms
                procs = spawn_ranks(build_config(cli=cli, env={}), args.ranks)
                services[mode] = {"procs": procs, "info": wait_ready(cli["ready_file"], procs)}
                if args.pin:
                    cpus = sorted(os.sched_getaffinity(0))
                    for rank, pid in enumerate(services[mode]["info"]["pids"]):
                        for task in os.listdir(f"/proc/{pid}/task"):  # every thread of the rank
                            os.sched_setaffinity(int(task), {cpus[rank % len(cpus)]})
            info_on = services["on"]["info"]["events"]
            follower = None
            if info_on and not args.no_subscriber:
                cmd = [sys.executable, __file__, "--follow", info_on["endpoint"], info_on["replay_endpoint"]]
                follower = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                assert follower.stdout is not None and follower.stdout.readline().strip() == "following"
            clients = {mode: Client(s["info"]["endpoint"], timeout_s=30) for mode, s in services.items()}
            rng = {mode: random.Random(1) for mode in services}
            for mode, c in clients.items():  # warm up: fill both tiers
                requests(c, rng[mode], 40, args.pages, page)
            runs: list[dict[str, float]] = []
            per_slice = max(1, args.requests // args.slices)
            for run in range(args.runs):
                cpu = {"off": 0.0, "on": 0.0}
                for i in range(args.slices):  # fine-grained alternation: both see the same machine load
                    for mode in ("off", "on") if (run + i) % 2 == 0 else ("on", "off"):
                        pid = services[mode]["info"]["pids"][0]
                        cpu0 = cpu_seconds(pid)
                        requests(clients[mode], rng[mode], per_slice, args.pages, page)
                        cpu[mode] += cpu_seconds(pid) - cpu0
                runs.append({mode: t * 1e6 / (per_slice * args.slices) for mode, t in cpu.items()})
            counters = None
            if follower is not None:
                out_text, _ = follower.communicate("", timeout=60)  # closes its stdin: it reports and exits
                counters = json.loads(out_text.strip().splitlines()[-1])
            stats = clients["on"].stats().values
            for c in clients.values():
                c.close()
        finally:
            for s in services.values():
                stop_ranks(s["procs"])
    ratios = sorted(r["off"] / r["on"] for r in runs)
    out["cpu_us_per_request_off"] = round(median(r["off"] for r in runs), 1)
    out["cpu_us_per_request_on"] = round(median(r["on"] for r in runs), 1)
    out["ratio"] = round(median(ratios), 3)
    out["ratio_min"], out["ratio_max"] = round(ratios[0], 3), round(ratios[-1], 3)
    out["ratios"] = [round(r["off"] / r["on"], 3) for r in runs]
    out["subscriber"] = counters
    out["publisher"] = {k: v for k, v in stats.items() if k.startswith("event_") or k.startswith("rank0.event_")}
    out["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
