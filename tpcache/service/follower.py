"""Ranks 1..N-1: apply the leader's batches in order, one round per batch, answer when asked.

A follower never decides anything: it applies what it received, in the order received, and runs
exactly one round per batch, so every rank runs the same number of rounds. What it cannot apply
(a request it cannot decode, a batch it lost) it skips: its sequence number then differs from the
other ranks' and the round's sequence check closes the cache everywhere, which health reports.
A follower that hears nothing from the leader for longer than a round can take (the leader sends
a heartbeat batch when idle) closes its cache and exits: the leader is gone.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

import protocol as p
from tpcache.service.batch import REQUEST, Entry, apply_batch
from tpcache.service.channels import Channels, unpack
from tpcache.service.config import ServiceConfig
from tpcache.service.handlers import RankHandler, gathered_payload
from tpcache.service.metrics import RankMetrics

log = logging.getLogger("tpcache.service")

EXIT_LEADER_GONE = 3


def _fault_drop_batch() -> int:
    """Fault injection for tests: drop the requests of this batch number (env, followers only)."""
    try:
        return int(os.environ.get("TPCACHE_FAULT_DROP_BATCH", "-1"))
    except ValueError:
        return -1


class Follower:
    def __init__(self, handler: RankHandler, channels: Channels, config: ServiceConfig, metrics: RankMetrics) -> None:
        self.h = handler
        self.ch = channels
        self.config = config
        self.metrics = metrics
        self.expected_batch = 0
        self.expected_seq = 1
        self.drop_batch = _fault_drop_batch()

    def run(self, should_stop: Any) -> int:
        """Serve until the leader's stop batch; returns the process exit code."""
        cfg = self.config
        inbox = self.ch.inbox
        assert inbox is not None
        orphan_s = 2 * cfg.round_timeout_s + cfg.heartbeat_s + 5.0
        last = time.monotonic()
        stop_sent: float | None = None
        while True:
            now = time.monotonic()
            if stop_sent is None and should_stop():
                self.ch.send_up({"stop": self.ch.rank})  # the leader fans the stop out to everyone
                stop_sent = now
            if stop_sent is not None and now - stop_sent > cfg.round_timeout_s + 5.0:
                log.error("rank %d: no stop from the leader after a signal; exiting", self.ch.rank)
                return 1
            if inbox.poll(100, zmq.POLLIN):
                last = time.monotonic()
                try:
                    msg = unpack(inbox.recv())
                except Exception:  # noqa: BLE001 - a corrupt batch: skip it, the round will disagree
                    log.error("rank %d: unreadable batch skipped", self.ch.rank)
                    continue
                if msg.get("x"):
                    return 0
                self._batch(msg)
            elif now - last > orphan_s:
                reason = f"no batch from the leader (rank 0) for {orphan_s:.0f} s: it is gone"
                self.h.tp.core.close(reason)
                log.error("rank %d: %s; exiting", self.ch.rank, reason)
                return EXIT_LEADER_GONE

    def _batch(self, msg: dict[str, Any]) -> None:
        rank = self.ch.rank
        b = int(msg["b"])
        if b < self.expected_batch:
            log.error("rank %d: batch %d arrived after batch %d; ignored", rank, b, self.expected_batch - 1)
            return
        for missed in range(self.expected_batch, b):
            # Keep the round count aligned; this rank's sequence now lags and the round says so.
            log.error("rank %d: batch %d never arrived; running its round without it", rank, missed)
            self.h.tp.step()
        if int(msg["s"]) != self.expected_seq:
            log.error("rank %d: requests %d..%d are missing", rank, self.expected_seq, int(msg["s"]) - 1)
        self.expected_seq = int(msg["s"]) + int(msg["n"])
        wire = [] if b == self.drop_batch else msg["e"]
        entries = [Entry(kind, token, conn, data) for kind, token, conn, data in wire]
        apply_batch(self.h, self.metrics, entries)
        self.expected_batch = b + 1
        answers = [
            [e.token, gathered_payload(e.body, e.outcome)]
            for e in entries
            if e.kind == REQUEST and e.body is not None and e.body.route() == p.GATHERED
        ]
        if answers:
            self.ch.send_up({"b": b, "r": rank, "a": answers})
        if self.metrics.due():
            self.metrics.publish(self.h.stats_values(), self.h.tp.health())
