"""Run a scenario on N real rank processes (gloo over 127.0.0.1), for the multi-process test ring.

Each rank joins a gloo group, builds the round's collective (shared memory by default, as the
service does on one host), runs the named scenario and sends back a small result. The parent
kills every rank on timeout or on the first failure, so a test never hangs.

Ranks are forked from a multiprocessing fork server that imported torch and the scenarios once
(per test process), instead of each rank importing them afresh: the imports cost seconds of CPU a
rank, the fork milliseconds. The server imports only; it starts no threads, opens no group and
touches no shared memory, so every rank still begins with no state of its own.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any

from tpcache.testing.registry import SCENARIOS, rank_rng, scenario

SCENARIO_MODULES = ("tpcache.testing.scenarios", "tpcache.testing.store_scenarios", "tpcache.testing.group_scenarios")

__all__ = ["SCENARIOS", "GroupFailed", "free_port", "rank_rng", "run_group", "scenario"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GroupFailed(RuntimeError):
    pass


def run_group(
    world: int,
    name: str,
    args: dict[str, Any] | None = None,
    transport: str = "auto",
    timeout_s: float = 120.0,
    allow_dead: bool = False,
) -> list[Any]:
    """Run scenario ``name`` on ``world`` ranks; returns each rank's result in rank order.

    A rank process that exits without a result fails the run, unless ``allow_dead``: then its
    result is None and the others are still collected."""
    _register()
    ctx = _context()
    results: Any = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, world, port, transport, name, args or {}, results), daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    dead: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(dead) < world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(out) - dead)
                raise GroupFailed(f"ranks {missing} sent no result within {timeout_s} s")
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and r not in dead and p.exitcode is not None and results.empty():
                        if not allow_dead:
                            raise GroupFailed(f"rank {r} exited with code {p.exitcode} and no result") from None
                        dead.add(r)
                continue
            if not ok:
                raise GroupFailed(f"rank {rank} failed:\n{value}")
            out[rank] = value
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [out.get(r) for r in range(world)]


def _entry(rank: int, world: int, port: int, transport: str, name: str, args: dict[str, Any], results: Any) -> None:
    import torch.distributed as dist

    from tpcache.comm import make_collective
    from tpcache.comm.store import loopback_store

    _register()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    collective = None
    try:
        store = loopback_store("127.0.0.1", port, world, rank, 60.0)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
        )
        collective = make_collective(transport)
        value = SCENARIOS[name](rank=rank, world=world, collective=collective, **args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - the parent reports it with the traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if args.get("exit_hard"):
            os._exit(0)
        if collective is not None:
            # A broken group cannot close cleanly; the process ends anyway.
            with contextlib.suppress(Exception):
                collective.close()


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    # Takes effect when the server starts (the first rank of this process); later calls are no-ops.
    ctx.set_forkserver_preload(["torch.distributed", __name__, *SCENARIO_MODULES])
    return ctx


def _register() -> None:
    for module in SCENARIO_MODULES:
        importlib.import_module(module)  # each registers its scenarios
