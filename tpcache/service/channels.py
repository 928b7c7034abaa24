"""The internal channel between ranks: ordered batches out from the leader, small answers back.

Topology: every follower binds a PULL socket and the leader connects one PUSH to each (batches
never drop: PUSH blocks rather than discards, and the leader cannot run ahead because every batch
ends in a round that needs every rank). The leader binds a PULL for answers (acks of per-rank
results and stop requests) and every follower connects a PUSH to it. Endpoints are exchanged once
over the torch.distributed group at startup.

Batch (msgpack map, leader -> followers):
    {"b": batch number (= the round it ends in, counted by the service),
     "s": sequence number of its first request, "n": number of requests,
     "e": [[kind, token, data], ...] in apply order, "x": true to stop}
    kind 0: a client request, token its sequence number, data the client's frame (decoded again);
    kind 1: the commit (data true) or discard of the staged buffers of registration ``token``.
Answer (follower -> leader): {"b": batch, "r": rank, "a": [[token, payload], ...]} or {"stop": rank}.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgpack
import zmq

log = logging.getLogger("tpcache.service")

REQUEST, ACTIVATE = 0, 1
MAX_INTERNAL_BYTES = 1 << 30  # a batch of max_batch requests of up to 16 MiB each is still bounded


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class Channels:
    """One rank's internal sockets. Build with ``Channels.open`` (a collective call)."""

    def __init__(self, ctx: zmq.Context, rank: int, world: int) -> None:
        self.ctx = ctx
        self.rank = rank
        self.world = world
        self.inbox: zmq.Socket | None = None  # follower: batches; leader: answers
        self.outs: list[zmq.Socket] = []  # leader: one PUSH per follower; follower: one to the leader
        self.pids: list[int] = []

    @classmethod
    def open(cls, ctx: zmq.Context, rank: int, world: int, host: str, group: Any = None) -> Channels:
        from tpcache.dist.exchange import all_gather_json

        ch = cls(ctx, rank, world)
        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.setsockopt(zmq.RCVHWM, 0)
        inbox.setsockopt(zmq.MAXMSGSIZE, MAX_INTERNAL_BYTES)
        port = inbox.bind_to_random_port(f"tcp://{host}")
        ch.inbox = inbox
        peers = all_gather_json({"endpoint": f"tcp://{host}:{port}", "pid": os.getpid()}, group)
        ch.pids = [int(p["pid"]) for p in peers]
        targets = [p["endpoint"] for p in peers[1:]] if rank == 0 else [peers[0]["endpoint"]]
        for target in targets:
            out = ctx.socket(zmq.PUSH)
            out.setsockopt(zmq.LINGER, 500)  # let a stop batch leave; a dead peer must not hold the exit
            out.setsockopt(zmq.SNDHWM, 0)
            out.connect(target)
            ch.outs.append(out)
        return ch

    def broadcast(self, frame: bytes) -> None:
        """Leader: the same batch to every follower, in order."""
        for out in self.outs:
            out.send(frame, copy=len(frame) < 65536)

    def send_up(self, obj: Any) -> None:
        """Follower: an answer or a stop request to the leader (never blocks the round loop)."""
        try:
            self.outs[0].send(pack(obj), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("rank %d: the leader is not reading answers; one was dropped", self.rank)

    def close(self) -> None:
        for sock in [*self.outs, self.inbox]:
            if sock is not None:
                sock.close()
        self.outs = []
        self.inbox = None
