"""One rank of a multi-process collective test, forked by test_dist_transports.py (``run_rank``) or
run as a script.

Usage: dist_worker.py SCENARIO RANK WORLD_SIZE STORE_PORT ARGS_JSON
Joins a gloo group (NCCL when ARGS_JSON has "backend": "nccl") through the parent's TCPStore on
127.0.0.1, runs the scenario and prints one JSON line (its report) on stdout. Vectors are derived from
(seed, round, rank) so every rank can compute the expected MIN itself and check both transports.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tpcache.comm import (
    CollectiveClosed,
    CollectiveError,
    CollectiveTimeout,
    WrongThreadError,
    make_collective,
)
from tpcache.comm.collective import INT64_MAX, INT64_MIN
from tpcache.comm.shm import ShmCollective, ShmUnavailable

SHM_DIR = "/dev/shm"


def vector(seed: int, rnd: int, rank: int, n: int) -> list[int]:
    rng = random.Random(f"{seed}:{rnd}:{rank}")
    out = []
    for _ in range(n):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(rng.randint(-5, 5))
        elif kind == 1:
            out.append(rng.randint(INT64_MIN, INT64_MAX))
        else:
            out.append(rng.choice((INT64_MIN, INT64_MAX, 0, -1)))
    return out


def round_length(seed: int, rnd: int, capacity: int) -> int:
    return random.Random(f"{seed}:{rnd}:len").randint(1, capacity)


def scenario_compare(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Both transports in the same processes, checked against the locally computed MIN."""
    seed, capacity = args["seed"], args["capacity"]
    shm = make_collective("auto", capacity=capacity)
    torch_c = make_collective("torch", capacity=capacity)
    segment = getattr(shm, "segment_name", "")
    report: dict[str, Any] = {
        "shm_name": shm.name,
        "torch_name": torch_c.name,
        "segment": segment,
        "segment_linked_after_setup": bool(segment) and os.path.exists(os.path.join(SHM_DIR, segment)),
    }
    wrong = {"shm": 0, "torch": 0}
    rounds = args["rounds"]
    jitter_s = args.get("jitter_ms", 0) / 1000
    for rnd in range(rounds + args.get("shm_only_rounds", 0)):
        n = round_length(seed, rnd, capacity)
        vectors = [vector(seed, rnd, r, n) for r in range(world)]
        expected = array("q", map(min, *vectors) if world > 1 else vectors[0])  # what a collective hands back
        if jitter_s:  # arrive late by a rank-dependent delay, so waiters go through every wait phase
            time.sleep(random.Random(f"{seed}:{rnd}:{rank}:jitter").random() * jitter_s)
        if shm.allreduce_min(vectors[rank], 10.0) != expected:
            wrong["shm"] += 1
        if rnd < rounds and torch_c.allreduce_min(vectors[rank], 10.0) != expected:
            wrong["torch"] += 1
    report["wrong"] = wrong
    if args.get("checks"):
        report["checks"] = {c.name: local_checks(c, capacity) for c in (shm, torch_c)}
    report["calls"] = {"shm": shm.calls, "torch": torch_c.calls}
    shm.close()
    torch_c.close()
    try:
        shm.allreduce_min([1], 1.0)
        report["closed_raises"] = False
    except CollectiveClosed:
        report["closed_raises"] = True
    dist.barrier()
    dist.destroy_process_group()
    return report


def local_checks(c: Any, capacity: int) -> dict[str, Any]:
    """Bad input raises ValueError before any communication and leaves the collective usable."""
    out: dict[str, Any] = {}
    calls = c.calls
    for label, bad in (
        ("too_long", [0] * (capacity + 1)),
        ("overflow", [INT64_MAX + 1]),
        ("underflow", [INT64_MIN - 1]),
        ("float", [1.5]),
        ("str", ["1"]),
    ):
        try:
            c.allreduce_min(bad, 5.0)
            out[label] = "no error"
        except ValueError:
            out[label] = "ValueError"
    caught: list[str] = []

    def from_thread() -> None:
        try:
            c.allreduce_min([1], 5.0)
            caught.append("no error")
        except WrongThreadError as exc:
            caught.append(type(exc).__name__)

    t = threading.Thread(target=from_thread)
    t.start()
    t.join()
    out["worker_thread"] = caught[0]
    out["calls_unchanged"] = c.calls == calls
    out["still_works"] = c.allreduce_min([c.rank, -c.rank], 5.0).tolist() == [0, -(c.world_size - 1)]
    return out


def scenario_stall(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One rank stops taking part; on each transport in turn the survivors must fail with
    CollectiveTimeout (never hang), and the collective stays broken afterwards. A sleeping victim
    stays asleep until every survivor has its outcome (each touches ``done-<rank>`` in
    ``sync_dir``), however slowly the machine runs them. ``stall_timeouts`` may give the stalled
    call a timeout of its own per transport (by its name)."""
    victim, mode, timeout = args["victim"], args["mode"], args["timeout"]
    sync = Path(args["sync_dir"])
    collectives = [make_collective(t, capacity=8) for t in args["transports"]]
    for c in collectives:
        for i in range(args["rounds_before"]):
            assert c.allreduce_min([rank, i], timeout).tolist() == [0, i]
    report: dict[str, Any] = {"segments": [getattr(c, "segment_name", None) for c in collectives]}
    if rank == victim:
        if mode == "exit":
            os._exit(0)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        # "sleep": alive but not participating, until the survivors are done (bounded).
        survivors = [sync / f"done-{r}" for r in range(world) if r != victim]
        deadline = time.monotonic() + args["sleep_s"]
        while not all(f.exists() for f in survivors) and time.monotonic() < deadline:
            time.sleep(0.02)
        return report
    for c in collectives:
        outcome: dict[str, Any] = {}
        start = time.perf_counter()
        try:
            c.allreduce_min([rank, 99], args.get("stall_timeouts", {}).get(c.name, timeout))
            outcome["error"] = None
        except CollectiveTimeout as exc:
            outcome.update(error="CollectiveTimeout", missing=exc.missing_ranks, message=str(exc))
        except CollectiveError as exc:
            outcome.update(error=type(exc).__name__, message=str(exc))
        outcome["elapsed_s"] = time.perf_counter() - start
        try:
            c.allreduce_min([rank, 100], timeout)
            outcome["after"] = "no error"
        except CollectiveClosed:
            outcome["after"] = "CollectiveClosed"
        report[c.name] = outcome
    (sync / f"done-{rank}").touch()
    return report


def scenario_fallback(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 cannot see the shm directory: every rank must fall back to torch alike (auto) or refuse
    alike (forced shm), with the choice logged on tpcache.comm."""
    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    log = logging.getLogger("tpcache.comm")
    log.addHandler(Capture())
    log.setLevel(logging.INFO)
    shm_dir = args["missing_dir"] if rank == 1 else SHM_DIR
    auto = make_collective("auto", capacity=4, shm_dir=shm_dir)
    result = auto.allreduce_min([rank, -rank], 5.0).tolist()
    try:
        make_collective("shm", capacity=4, shm_dir=shm_dir)
        forced = "no error"
    except ShmUnavailable:
        forced = "ShmUnavailable"
    return {"auto": auto.name, "result": result, "forced": forced, "log": messages}


def scenario_torn(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 publishes round 1's generation with a record whose checksum does not match its data (what
    a reader on a weakly ordered CPU can observe mid-write): rank 0 must not use it, and time out."""
    c = make_collective("shm", capacity=4)
    assert isinstance(c, ShmCollective)
    report: dict[str, Any] = {}
    if rank == 1:
        seg = c._seg
        assert seg is not None
        b = seg.buf(1, 1)
        seg.w[b + 2], seg.w[b + 3], seg.w[b + 1] = 1, -999, 12345  # n, value, wrong checksum
        seg.w[b] = 1  # generation of round 1
        time.sleep(args["timeout"] + 1.0)
        return report
    start = time.perf_counter()
    try:
        report["result"] = c.allreduce_min([5], args["timeout"]).tolist()
    except CollectiveTimeout as exc:
        report.update(error="CollectiveTimeout", missing=exc.missing_ranks)
    report["elapsed_s"] = time.perf_counter() - start
    return report


SCENARIOS = {
    "compare": scenario_compare,
    "stall": scenario_stall,
    "fallback": scenario_fallback,
    "torn": scenario_torn,
}


def main() -> None:
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    args = json.loads(sys.argv[5])
    timeout = datetime.timedelta(seconds=args.get("pg_timeout_s", 60))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    backend = args.get("backend", "gloo")
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    report = SCENARIOS[scenario](rank, world, args)
    report["rank"] = rank
    report["pid"] = os.getpid()
    print(json.dumps(report), flush=True)
    # Survivors of a broken group may hold in-flight gloo work; skip interpreter teardown.
    os._exit(0)


def run_rank(argv: list[str], stdout_path: str, stderr_path: str) -> None:
    """``main`` in a process forked from a server that has imported torch already (the script's
    imports cost seconds of CPU a rank), with its stdout and stderr written to the given files."""
    import warnings

    warnings.simplefilter("ignore")
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    sys.argv = [__file__, *argv]
    main()


if __name__ == "__main__":
    main()
