#!/usr/bin/env python3
"""Rank 0's cost per plain lookup, counted where load cannot move it: the leader's loop in one process.

    python scripts/profile_leader.py [--requests 2000] [--batch 100] [--reps 3]
    valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes \\
        python scripts/profile_leader.py --callgrind --reps 1     # instructions per request

Builds the leader of ``bench_service.py``'s service (page size 16, a 4,096-token prefix cached, so
every match is a full hit) in this process: its real FrontDoor, handler and cache, one round
transport of one rank (a round has no peer to wait for) and one internal PUSH socket that nobody
reads (each batch is still sealed and sent). A DEALER in the same process queues ``--requests``
match requests, then the leader's loop runs, one iteration at a time, until every reply is back;
at most ``--batch`` requests go in one batch (``max_batch``). Prints the main thread's CPU time per
request (this machine's load moves it) for each of ``--reps`` runs.

With ``--callgrind`` (run under callgrind, instrumentation off at start) it switches instrumentation
on for the measured loop only (``callgrind_control``) and dumps at the end: the main thread's dump
(``callgrind.out.<pid>.1-01``) divided by ``--requests`` is the instructions per request, the same
from run to run within about 3 %, which is what to compare between two versions of the code (run
them one after the other; ``bench_service.py`` compares against the echo floor).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from protocol import pack_ids  # noqa: E402
from tpcache.comm.shm import ShmCollective  # noqa: E402
from tpcache.service.channels import Channels  # noqa: E402
from tpcache.service.config import build_config  # noqa: E402
from tpcache.service.handlers import RankHandler  # noqa: E402
from tpcache.service.leader import Leader  # noqa: E402
from tpcache.service.metrics import RankMetrics  # noqa: E402
from tpcache.service.process import build_cache  # noqa: E402

TOKENS = 4096
PAGE = 16


def callgrind(*args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(os.getpid())], capture_output=True, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="match requests per run [2000]")
    parser.add_argument("--batch", type=int, default=100, help="most requests in one batch [100]")
    parser.add_argument("--reps", type=int, default=3, help="runs [3]")
    parser.add_argument("--callgrind", action="store_true", help="toggle callgrind around each run")
    args = parser.parse_args()
    cli = {"endpoint": "tcp://127.0.0.1:0", "page_size": PAGE, "device_pages": 4096, "log_level": "ERROR"}
    config = build_config(cli={**cli, "max_batch": args.batch}, env={})
    collective = ShmCollective.local_group(1)[0]
    tp = build_cache(config, collective, None)
    handler = RankHandler(tp, config, lambda pool: build_cache(config, collective, None, pool))
    metrics = RankMetrics(0, storage=None, capacity={"device": 4096, "host": 0, "staging": 0}, version="profile")
    ctx = zmq.Context()
    channels = Channels(ctx, 0, 2, os.urandom(32))
    channels.inbox = ctx.socket(zmq.PULL)
    channels.inbox.bind("tcp://127.0.0.1:*")
    sink = ctx.socket(zmq.PULL)  # the follower that never reads: batches are sealed and sent all the same
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}")
    channels.outs = [out]
    leader = Leader(handler, channels, config, metrics, ctx)
    leader.door.router.setsockopt(zmq.RCVHWM, 0)
    tokens = list(range(TOKENS))
    lease, _ = tp.lock(tokens)
    tp.insert(lease, tokens, tp.alloc(lease, TOKENS // PAGE))
    tp.release(lease)
    tp.step()
    assert tp.match(tokens).device_pages == TOKENS // PAGE
    client = ctx.socket(zmq.DEALER)
    for option in (zmq.SNDHWM, zmq.RCVHWM):
        client.setsockopt(option, 0)
    client.connect(leader.endpoint)
    data = pack_ids(tokens)
    next_id = 0

    def queue(n: int) -> None:
        nonlocal next_id
        for rid in range(next_id, next_id + n):
            client.send(msgpack.packb({"v": 1, "id": rid, "op": "match", "args": {"tokens": data}}, use_bin_type=True))
        next_id += n
        time.sleep(0.3 + n / 20_000)  # until the leader's socket holds them all

    def serve(n: int) -> None:
        got = 0
        while got < n:
            leader.run(iter((False, True)).__next__)  # one iteration of the loop
            while True:
                try:
                    client.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got += 1

    leader.stop = lambda: None  # type: ignore[method-assign]  # run() ends every iteration with it
    queue(200)
    serve(200)  # warm-up, and the connection's handshake
    for _ in range(args.reps):
        queue(args.requests)
        gc.collect()
        if args.callgrind:
            callgrind("-i", "on")
        cpu = time.thread_time()
        serve(args.requests)
        cpu = time.thread_time() - cpu
        if args.callgrind:
            callgrind("-i", "off")
        print(f"main thread CPU {cpu / args.requests * 1e6:.2f} us per request", flush=True)
    if args.callgrind:
        callgrind("-d", "end")
    os._exit(0)  # the leader's sockets and the one-rank segment go with the process


if __name__ == "__main__":
    sys.exit(main())
