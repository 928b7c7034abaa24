"""How long a running 2-rank service takes to stop on SIGTERM, with requests in flight.

    python scripts/bench_stop.py --json [--runs 3] [--launcher local|torchrun] [--window 64]

Each run starts the service (``launcher local``, or ``torchrun ... -m launcher serve``), keeps
``--window`` match requests in flight from one client, sends SIGTERM to the launcher and measures
until the launcher and every rank have exited. Every request must be answered, with a result or
with "the service is stopping"; ``unanswered`` counts those that were not (within 10 s). The floor
is the same measurement for a bare Python process that exits on SIGTERM (interpreter start-up
excluded, teardown included). Prints medians and spreads over the runs; ``ratio`` = stop / floor.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import protocol as p  # noqa: E402
from launcher.local import free_port  # noqa: E402
from tpcache.client import Client  # noqa: E402

FLOOR = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
    "print(1, flush=True); time.sleep(60)"
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def drive(endpoint: str, window: int, counts: dict[str, int]) -> None:
    """Keep ``window`` matches in flight until the service says it is stopping (as a client
    would, it then sends nothing new); collect every reply."""
    with Client(endpoint, timeout_s=10) as c:
        pending: list[int] = []
        stopping = False
        while pending or not stopping:
            if not stopping:
                pending += c.submit_many(p.MatchRequest(tokens=list(range(64))) for _ in range(window - len(pending)))
            try:
                c.wait(pending.pop(0))
                counts["ok"] += 1
            except p.CacheClosed:
                counts["stopping"] += 1
                stopping = True
            except p.RequestTimeout:
                counts["unanswered"] += 1
                stopping = True


def one_run(kind: str, window: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tpcache-stop-") as tmp:
        ready = Path(tmp) / "ready.json"
        options = ["--endpoint", "tcp://127.0.0.1:0", "--ready-file", str(ready), "--log-level", "WARNING"]
        if kind == "local":
            argv = [sys.executable, "-m", "launcher", "local", "--nproc", "2", *options]
        else:
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
            argv = [*torchrun, "--master-port", str(free_port()), "-m", "launcher", "serve", *options]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TPCACHE_")}
        env["PYTHONPATH"] = str(REPO)
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            while not ready.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"the service exited with {proc.returncode} before it was ready")
                time.sleep(0.05)
            info = json.loads(ready.read_text())
            counts = {"ok": 0, "stopping": 0, "unanswered": 0}
            client = threading.Thread(target=drive, args=(info["endpoint"], window, counts))
            client.start()
            while counts["ok"] < 10 * window:  # the service is busy serving
                time.sleep(0.01)
            start = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            while any(alive(pid) for pid in info["pids"]):
                time.sleep(0.001)
            seconds = time.perf_counter() - start
            client.join(30)
            return {"seconds": seconds, "exit_code": proc.returncode, **counts}
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def floor_run() -> float:
    proc = subprocess.Popen([sys.executable, "-c", FLOOR], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--runs", type=int, default=3, help="runs of each measurement [3]")
    parser.add_argument("--launcher", choices=("local", "torchrun"), default="local")
    parser.add_argument("--window", type=int, default=64, help="requests in flight [64]")
    args = parser.parse_args()
    runs = [one_run(args.launcher, args.window) for _ in range(args.runs)]
    floors = [floor_run() for _ in range(args.runs)]
    stops = [r["seconds"] for r in runs]
    out = {
        "launcher": args.launcher,
        "window": args.window,
        "stop_s_median": round(statistics.median(stops), 3),
        "stop_s_min": round(min(stops), 3),
        "stop_s_max": round(max(stops), 3),
        "floor_s_median": round(statistics.median(floors), 4),
        "ratio": round(statistics.median(stops) / statistics.median(floors), 1),
        "answered_stopping": sum(r["stopping"] for r in runs),
        "unanswered": sum(r["unanswered"] for r in runs),
        "exit_codes": [r["exit_code"] for r in runs],
    }
    print(json.dumps(out) if args.json else "\n".join(f"{k:20} {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
