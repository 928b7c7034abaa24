"""Service throughput and latency against a raw ZMQ + msgpack echo floor, in one run.

    python scripts/bench_service.py --json [--window 256] [--seconds 2] [--runs 5] [--tokens 4096]

Starts a local 2-rank service (metadata only, CPU), inserts a 4,096-token prefix, then drives
``match`` requests for it (a full hit) from one DEALER with ``--window`` requests in flight, and
measures requests/s and latency. The floor is a ROUTER echo server in its own process that
decodes each request with msgpack and answers with a reply of the service's shape: the cost of
ZMQ and msgpack alone, in one process (the service also runs a second rank on the same cores).

A run is one service slice followed by one echo slice, so both halves see the same machine load;
``--runs`` runs (5 by default) alternate. ``ratio`` is the median over runs of service requests/s
over echo requests/s in the same run (target >= 0.8), ``ratio_min``/``ratio_max`` its spread and
``ratios`` every run's. ``requests_per_s`` and the latencies are the service's median run,
``echo_requests_per_s`` the echo's. ``rank0_cpu_us_per_request`` (and rank 1's, and
``echo_cpu_us_per_request``) is the CPU time the process spent per request, median over runs:
steadier than the rates on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import msgpack
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.local import free_port, spawn_ranks, stop_ranks, wait_ready  # noqa: E402
from protocol import pack_ids  # noqa: E402
from tpcache.client import Client  # noqa: E402
from tpcache.service.config import build_config  # noqa: E402


def echo_server(port: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    result = {"hit_tokens": 4096, "device_pages": 256, "host_pages": 0, "storage_pages": 0}
    result["device_page_ids"] = pack_ids(range(256))
    while True:
        identity, frame = sock.recv_multipart()
        if frame == b"stop":
            break
        request = msgpack.unpackb(frame, raw=False)
        reply = {"v": 1, "id": request["id"], "op": request["op"], "ok": True, "result": result}
        sock.send_multipart([identity, msgpack.packb(reply, use_bin_type=True)])
    sock.close()
    ctx.term()


def core_match_rate(tokens: list[int], page: int, n: int = 200) -> float:
    """Matches per second of one in-process CacheCore: what a rank's own lookup costs."""
    from array import array

    from tpcache.core import CacheConfig, CacheCore

    core = CacheCore(CacheConfig(page_size=page, device_pages=len(tokens) // page + 1))
    ids = array("i", tokens)
    lease, _ = core.lock(ids)
    core.insert(lease, ids, core.alloc(lease, len(tokens) // page))
    core.release(lease)
    start = time.perf_counter()
    for _ in range(n):
        core.match(ids)
    return n / (time.perf_counter() - start)


def drive(endpoint: str, tokens: bytes, window: int, seconds: float) -> dict[str, float]:
    """Keep ``window`` match requests in flight for ``seconds``; returns rate and latency."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    args = {"tokens": tokens}
    sent: dict[int, float] = {}
    latencies: list[float] = []
    next_id = 1
    warmup_end = time.perf_counter() + min(0.5, seconds / 4)
    end = warmup_end + seconds
    done = 0
    while True:
        now = time.perf_counter()
        if now >= end and not sent:
            break
        while now < end and len(sent) < window:
            sock.send(msgpack.packb({"v": 1, "id": next_id, "op": "match", "args": args}, use_bin_type=True))
            sent[next_id] = time.perf_counter()
            next_id += 1
        if not sock.poll(10_000):
            raise TimeoutError("no reply within 10 s")
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            reply = msgpack.unpackb(frame, raw=False)
            if not reply.get("ok"):
                raise RuntimeError(f"error reply: {reply}")
            t = time.perf_counter()
            start = sent.pop(reply["id"])
            if start >= warmup_end and start < end:
                latencies.append(t - start)
                done += 1
    sock.close()
    latencies.sort()
    n = len(latencies)
    return {
        "requests_per_s": done / seconds,
        "latency_us_p50": latencies[n // 2] * 1e6 if n else 0.0,
        "latency_us_p99": latencies[min(n - 1, int(n * 0.99))] * 1e6 if n else 0.0,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_echo(echo: subprocess.Popen, port: int) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 1000)
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send(b"stop")
    s.close()
    try:
        echo.wait(5)
    except subprocess.TimeoutExpired:
        echo.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--window", type=int, default=256, help="requests in flight [256]")
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per slice [2]")
    parser.add_argument("--runs", type=int, default=5, help="alternating service + echo runs; medians [5]")
    parser.add_argument("--slices", type=int, dest="runs", help=argparse.SUPPRESS)  # the old name
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per match request [4096]")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page [16]")
    parser.add_argument("--echo-server", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        echo_server(args.echo_server)
        return 0
    if args.runs < 1 or args.seconds <= 0:
        parser.error("--runs must be at least 1 and --seconds positive")
    page = args.page_size
    tokens = list(range(args.tokens))
    out: dict[str, Any] = {"tokens": args.tokens, "page_size": page, "window": args.window, "ranks": 2}
    out["load_average_start"] = [round(x, 2) for x in os.getloadavg()]
    out["core_match_per_s"] = core_match_rate(tokens, page)
    with tempfile.TemporaryDirectory(prefix="tpcache-bench-") as tmp:
        ready = str(Path(tmp) / "ready.json")
        config = build_config(
            cli={
                "endpoint": "tcp://127.0.0.1:0",
                "ready_file": ready,
                "page_size": page,
                "device_pages": 4096,
                "log_level": "ERROR",
            },
            env={},
        )
        procs = spawn_ranks(config, 2)
        port = free_port()
        echo = subprocess.Popen([sys.executable, __file__, "--echo-server", str(port)], env={**os.environ})
        try:
            info = wait_ready(ready, procs)
            out["transport"] = info["transport"]
            with Client(info["endpoint"], timeout_s=30) as c:
                lease = c.lock(tokens).lease
                c.insert(tokens, c.alloc(lease, args.tokens // page).device_page_ids, lease=lease)
                c.release(lease)
                assert c.match(tokens).hit_tokens == args.tokens // page * page
                # Alternate service and echo slices so both see the same machine load; a run's
                # ratio compares the two halves of that run only.
                runs: list[dict[str, Any]] = []
                for _ in range(args.runs):
                    rounds0 = c.stats().values["rounds"]
                    cpu0 = [cpu_seconds(pid) for pid in info["pids"]]
                    served = drive(info["endpoint"], pack_ids(tokens), args.window, args.seconds)
                    requests = max(served["requests_per_s"] * args.seconds, 1)
                    for r, pid in enumerate(info["pids"]):
                        served[f"rank{r}_cpu_us_per_request"] = (cpu_seconds(pid) - cpu0[r]) * 1e6 / requests
                    stats = c.stats().values
                    served["rounds_per_s"] = round((stats["rounds"] - rounds0) / args.seconds, 1)
                    served["round_us_p50"] = stats.get("round_p50_us")
                    echo_cpu0 = cpu_seconds(echo.pid)
                    echoed = drive(f"tcp://127.0.0.1:{port}", pack_ids(tokens), args.window, args.seconds)
                    echo_requests = max(echoed["requests_per_s"] * args.seconds, 1)
                    served["echo_cpu_us_per_request"] = (cpu_seconds(echo.pid) - echo_cpu0) * 1e6 / echo_requests
                    served["echo_requests_per_s"] = echoed["requests_per_s"]
                    served["echo_latency_us_p50"] = echoed["latency_us_p50"]
                    rate = echoed["requests_per_s"]
                    served["ratio"] = served["requests_per_s"] / rate if rate else 0.0
                    runs.append(served)
        finally:
            stop_ranks(procs)
            stop_echo(echo, port)
    ratios = sorted(run["ratio"] for run in runs)
    middle = sorted(runs, key=lambda run: run["requests_per_s"])[len(runs) // 2]
    for key in ("requests_per_s", "latency_us_p50", "latency_us_p99", "rounds_per_s", "round_us_p50"):
        out[key] = middle[key]
    for key in ("rank0_cpu_us_per_request", "rank1_cpu_us_per_request", "echo_cpu_us_per_request"):
        out[key] = median([run[key] for run in runs])
    out["echo_requests_per_s"] = median([run["echo_requests_per_s"] for run in runs])
    out["echo_latency_us_p50"] = median([run["echo_latency_us_p50"] for run in runs])
    out["ratio"] = median(ratios)
    out["ratio_min"], out["ratio_max"] = ratios[0], ratios[-1]
    out["ratios"] = [round(r, 3) for r in (run["ratio"] for run in runs)]
    out["runs"] = len(runs)
    out["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:24} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
