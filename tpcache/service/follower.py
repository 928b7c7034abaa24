"""Ranks 1..N-1: apply the leader's batches in order, one round per batch, answer when asked.

A follower never decides anything: it applies what it received, in the order received, and runs
exactly one round per batch, so every rank runs the same number of rounds. What it cannot apply
(a request it cannot decode, a batch it lost) it skips: its sequence number then differs from the
other ranks' and the round's sequence check closes the cache everywhere, which health reports.
A follower on the leader's host watches the leader's process (a pidfd): once it is gone the
follower closes its cache and exits at once (``EXIT_LEADER_GONE``), idle or busy, releasing its
storage, so that a restarted group finds nothing held. A follower on another host watches its
connection to the leader instead: the leader's kernel closes it once the process is gone, and the
follower closes its cache and exits on that disconnect (unless a batch or a reconnect arrives within
``LAST_BATCH_WAIT_MS``: the leader's stop batch is read first). A follower that hears nothing from
the leader for longer than a round can take (the leader sends a heartbeat batch when idle), as when
its host vanished, does the same. A leader that is alive but stopped or slow is no reason to exit:
the round timeout decides about it. A follower whose
round collective failed exits at once (``EXIT_GROUP_BROKEN``): the group can never agree again
and must be restarted (torchrun ``--max-restarts`` does it).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

import protocol as p
from tpcache.service.batch import EXIT_GROUP_BROKEN, REQUEST, apply_batch
from tpcache.service.channels import MAX_ANSWER_BYTES, Batch, Channels
from tpcache.service.config import ServiceConfig
from tpcache.service.frontdoor import release_free_memory
from tpcache.service.handlers import RankHandler
from tpcache.service.metrics import RankMetrics
from tpcache.service.ops import gathered_payload

log = logging.getLogger("tpcache.service")

EXIT_LEADER_GONE = 3
FOLLOWER_YIELD_S = 20e-6  # the shm round's yield phase on a follower (500 us by default)
MAX_MISSED_BATCHES = 64  # rounds run for batches that never came (the leader's PUSH never drops one)
LAST_BATCH_WAIT_MS = 200  # once the leader has exited, how long its last frames may take to arrive
# For tests only: "1" makes a follower watch the leader as if it ran on another host (its
# connection, not its pid), so that path can be tested on one machine.
TEST_NO_PIDFD_ENV = "TPCACHE_TEST_NO_PIDFD"
TRIM_AFTER_BYTES = 4 << 20  # page bytes answered since memory was last handed back ...
TRIM_QUIET_S = 0.5  # ... and none answered for this long: hand free memory back to the OS


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
        self.answered_bytes = 0  # page bytes sent to the leader since free memory was handed back
        self.answered_at = 0.0  # when the last of them was sent
        self.connected = True  # the connection to the leader is up (watched where no pidfd is)
        collective = handler.tp.collective  # (a buffer registration rebuilds tp on the same collective)
        if hasattr(collective, "yield_s"):
            # A follower waits in a round for the leader, which first reads its clients: yielding
            # for long would spend, on the cores the leader and its clients need, what sleeping on
            # the round's futex spares (the leader wakes it the moment the round is complete).
            collective.yield_s = min(collective.yield_s, FOLLOWER_YIELD_S)

    def _watch_leader(self) -> int | None:
        """A pidfd of the leader's process when it runs on this host (None: it cannot be watched
        here); -1 when it has exited already."""
        if not self.ch.leader_local or not hasattr(os, "pidfd_open") or not self.ch.pids:
            return None
        if os.environ.get(TEST_NO_PIDFD_ENV) == "1":
            return None
        try:
            return os.pidfd_open(self.ch.pids[0])
        except ProcessLookupError:
            return -1
        except OSError:  # (no pidfd on this kernel)
            return None

    def _leader_gone(self, why: str) -> int:
        reason = f"the leader (rank 0, pid {self.ch.pids[0]}) {why}"
        self.h.tp.core.close(reason)
        log.error("rank %d: %s; exiting", self.ch.rank, reason)
        return EXIT_LEADER_GONE

    def run(self, should_stop: Any) -> int:
        """Serve until the leader's stop batch; returns the process exit code."""
        leader = self._watch_leader()
        # No pidfd: watch the connection to the leader (its answer socket) for the transport's
        # disconnect. Only this connecting socket is watched: anyone may connect to and leave a
        # follower's bound inbox, but only the leader's process holds the other end of this one.
        monitor = None
        if leader is None and self.ch.outs:
            monitor = self.ch.outs[0].get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            monitor.setsockopt(zmq.LINGER, 0)
        try:
            return self._serve(should_stop, leader, monitor)
        finally:
            if leader is not None and leader >= 0:
                os.close(leader)
            if monitor is not None:
                self.ch.outs[0].disable_monitor()
                monitor.close()

    def _serve(self, should_stop: Any, leader: int | None, monitor: zmq.Socket | None) -> int:
        cfg = self.config
        inbox = self.ch.inbox
        assert inbox is not None
        if leader == -1:
            return self._leader_gone("exited before this rank started serving")
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        if leader is not None:
            poller.register(leader, zmq.POLLIN)  # readable once the process has exited
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
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
            ready = dict(poller.poll(100))
            if self.answered_bytes >= TRIM_AFTER_BYTES and time.monotonic() - self.answered_at >= TRIM_QUIET_S:
                self.answered_bytes = 0  # large answers, and none for a while: the burst is over
                release_free_memory()
            if leader is not None and leader in ready and not self._batch_waiting(LAST_BATCH_WAIT_MS):
                return self._leader_gone("exited")
            if monitor is not None and (monitor in ready or not self.connected):
                self._read_monitor(monitor)
                if not self.connected and not self._batch_waiting(LAST_BATCH_WAIT_MS):
                    self._read_monitor(monitor)  # (a reconnect within the wait: the leader is alive)
                    if not self.connected:
                        return self._leader_gone("closed its connection (its process is gone)")
            if inbox in ready:
                batch = self.ch.receive_batch()  # None: a foreign frame, dropped and counted
                self.h.service_counters["internal_rejected_frames"] = self.ch.rejected
                if batch is None:
                    continue
                last = time.monotonic()  # only the leader's own batches prove it is alive
                if batch.stop:
                    return 0
                self._batch(batch)
                if self.h.tp.collective.closed and leader is not None and _exited(leader):
                    return self._leader_gone("exited during a round")
                if self.h.tp.collective.closed and monitor is not None:
                    monitor.poll(LAST_BATCH_WAIT_MS, zmq.POLLIN)  # (the disconnect may trail the round's error)
                    self._read_monitor(monitor)
                    if not self.connected:
                        return self._leader_gone("closed its connection during a round (its process is gone)")
                if self.h.tp.collective.closed:
                    log.error(
                        "rank %d: the group is broken and must be restarted: %s",
                        self.ch.rank,
                        self.h.tp.core.closed_reason,
                    )
                    return EXIT_GROUP_BROKEN
            elif now - last > orphan_s:
                reason = f"no batch from the leader (rank 0) for {orphan_s:.0f} s: it is gone"
                self.h.tp.core.close(reason)
                log.error("rank %d: %s; exiting", self.ch.rank, reason)
                return EXIT_LEADER_GONE

    def _read_monitor(self, monitor: zmq.Socket) -> None:
        """Apply the connection events waiting on ``monitor`` to ``self.connected``."""
        while monitor.poll(0, zmq.POLLIN):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False

    def _batch_waiting(self, wait_ms: int) -> bool:
        """Whether a frame waits in the inbox (or arrives within ``wait_ms``): the leader's last
        batches, its stop batch above all, are read before its exit is taken for a death."""
        inbox = self.ch.inbox
        return inbox is not None and bool(inbox.poll(wait_ms, zmq.POLLIN))

    def _batch(self, batch: Batch) -> None:
        rank = self.ch.rank
        b = batch.number
        if b < self.expected_batch:
            log.error("rank %d: batch %d arrived after batch %d; ignored", rank, b, self.expected_batch - 1)
            return
        for missed in range(self.expected_batch, min(b, self.expected_batch + MAX_MISSED_BATCHES)):
            # Keep the round count aligned; this rank's sequence now lags and the round says so.
            log.error("rank %d: batch %d never arrived; running its round without it", rank, missed)
            self.h.tp.step()
        if batch.first_seq != self.expected_seq:
            log.error("rank %d: requests %d..%d are missing", rank, self.expected_seq, batch.first_seq - 1)
        self.expected_seq = batch.first_seq + batch.count
        entries = [] if b == self.drop_batch else batch.entries
        apply_batch(self.h, self.metrics, entries)
        self.expected_batch = b + 1
        answers = [
            [e.token, gathered_payload(e.body, e.outcome)]
            for e in entries
            if e.kind == REQUEST and e.body is not None and e.body.route() == p.GATHERED
        ]
        self._send_answers(b, answers)
        if self.metrics.due():
            self.metrics.publish(self.h.stats_values(), self.h.tp.health())

    def _send_answers(self, b: int, answers: list[list[Any]]) -> None:
        """The gathered answers of batch ``b``, in frames of at most MAX_ANSWER_BYTES of page data."""
        chunk: list[list[Any]] = []
        size = 0
        for answer in answers:
            data = len(answer[1].get("data", b""))
            if chunk and size + data > MAX_ANSWER_BYTES:
                self.ch.send_up({"b": b, "r": self.ch.rank, "a": chunk})
                chunk, size = [], 0
            chunk.append(answer)
            size += data
            if data:
                self.answered_bytes += data
                self.answered_at = time.monotonic()
        if chunk:
            self.ch.send_up({"b": b, "r": self.ch.rank, "a": chunk})


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (its pidfd is readable)."""
    import select

    return bool(select.select([pidfd], [], [], 0)[0])
