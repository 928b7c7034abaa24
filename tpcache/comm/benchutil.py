"""Measurement helpers for round-transport benchmarks (used by scripts/bench_transport.py and
scripts/bench_round.py): per-call latency sampling, percentiles, and the floor, a raw TCP exchange of
the same bytes between the ranks over loopback (every rank sends its vector to rank 0, which replies
with the elementwise MIN).

All functions that talk to other ranks are collective calls: every rank of the group calls them in the
same order.
"""

from __future__ import annotations

import socket
import struct
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from tpcache.comm.collective import Collective
from tpcache.comm.exchange import all_gather_json


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``samples`` by nearest rank; ``ValueError`` when empty."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize_us(samples: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / mean of per-call durations in seconds, reported in microseconds."""
    return {
        "p50_us": round(percentile(samples, 0.5) * 1e6, 2),
        "p99_us": round(percentile(samples, 0.99) * 1e6, 2),
        "mean_us": round(sum(samples) / len(samples) * 1e6, 2),
    }


def time_calls(fn: Callable[[], object], rounds: int, setup: Callable[[], object] | None = None) -> list[float]:
    """Duration in seconds of each of ``rounds`` consecutive calls of ``fn``; ``setup``, when given,
    runs untimed before each call (to give every timed call the same work)."""
    out = []
    clock = time.perf_counter
    for _ in range(rounds):
        if setup is not None:
            setup()
        start = clock()
        fn()
        out.append(clock() - start)
    return out


Timed = Callable[[], object] | tuple[Callable[[], object], Callable[[], object]]


def allreduce_fn(collective: Collective, vector: Sequence[int], timeout_s: float = 30.0) -> Callable[[], object]:
    """A zero-argument call of one round on ``collective`` (for ``time_calls``)."""
    values = array("q", vector)
    return lambda: collective.allreduce_min(values, timeout_s)


class TcpFloor:
    """Raw loopback TCP exchange of a MIN round, the floor a same-host transport is measured against.

    Setup is a collective call on ``group``: rank 0 listens on 127.0.0.1, the others connect.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._peers: list[socket.socket] = []
        self._listener: socket.socket | None = None
        port = 0
        if self.rank == 0:
            self._listener = socket.create_server(("127.0.0.1", 0), backlog=self.world_size)
            port = self._listener.getsockname()[1]
        port = all_gather_json(port, group)[0]
        if self.rank == 0:
            assert self._listener is not None
            by_rank: dict[int, socket.socket] = {}
            for _ in range(self.world_size - 1):
                conn, _ = self._listener.accept()
                peer_rank = struct.unpack("<q", _recv_exact(conn, 8))[0]
                by_rank[peer_rank] = conn
            self._peers = [by_rank[r] for r in sorted(by_rank)]
        else:
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(struct.pack("<q", self.rank))
            self._peers = [conn]
        for conn in self._peers:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exchange(self, vector: Sequence[int]) -> array:
        """One MIN round over TCP; every rank gets the result, an array('q') as the collectives hand back."""
        values = array("q", vector)
        size = 8 * len(values)
        if self.rank != 0:
            conn = self._peers[0]
            conn.sendall(values)
            return array("q", _recv_exact(conn, size))
        result = values
        received = [array("q", _recv_exact(conn, size)) for conn in self._peers]
        if received:
            result = array("q", map(min, values, *received))
        for conn in self._peers:
            conn.sendall(result)
        return result

    def close(self) -> None:
        for conn in self._peers:
            conn.close()
        if self._listener is not None:
            self._listener.close()


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the floor connection")
        got += n
    return bytes(buf)


def interleaved(fns: dict[str, Timed], rounds: int, blocks: int, warmup: int) -> dict[str, list[float]]:
    """Time each function ``rounds`` times, in ``blocks`` alternating blocks (so load drift from other
    processes hits all of them alike), after ``warmup`` untimed calls each. A value may be a pair
    ``(setup, fn)``: ``setup`` runs untimed before every call of ``fn``. A collective call: every rank
    must pass the same names in the same order.
    """
    pairs = {name: fn if isinstance(fn, tuple) else (None, fn) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for setup, fn in pairs.values():
        time_calls(fn, warmup, setup)
    per_block = max(1, rounds // blocks)
    done = 0
    while done < rounds:
        n = min(per_block, rounds - done)
        for name, (setup, fn) in pairs.items():
            samples[name].extend(time_calls(fn, n, setup))
        done += n
    return samples


def run_ranks(target: Callable[..., None], world: int, opts: dict[str, Any], timeout_s: float = 900.0) -> Any:
    """Spawn ``world`` rank processes ``target(rank, world, store_port, opts, results)`` around one
    TCPStore on 127.0.0.1 and return the first report a rank puts on ``results`` (rank 0's)."""
    import multiprocessing as mp

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, store.port, opts, results)) for r in range(world)]
    for p in procs:
        p.start()
    report = results.get(timeout=timeout_s)
    for p in procs:
        p.join(timeout=60)
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise SystemExit(f"rank processes failed with exit codes {failed}")
    return report
