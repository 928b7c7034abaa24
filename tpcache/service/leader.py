"""Rank 0: the client front door, the sequencer and the pace of rounds.

Loop: wait for client frames (or answers from followers, or a heartbeat); take everything
waiting, up to ``max_batch``; decode each frame (a bad one gets its error reply at once and never
reaches the cache); number the requests that every rank must apply; send the ordered batch to
every follower; apply it here in the same order; run the round; then reply. A reply is sent only
after the round covering its request committed; if that round closed the cache, replies that
would report a hit become CACHE_CLOSED errors. Requests that need every rank's own answer
(stats, buffers, inline pages) wait for the followers' answers, with a deadline.

Rounds: one per batch. The leader also runs (empty) rounds while copies are in flight, so they
complete, and at least every ``heartbeat_s`` when idle, so a dead rank is noticed.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

import protocol as p
from tpcache.service.channels import ACTIVATE, REQUEST, Channels, pack, unpack
from tpcache.service.config import ServiceConfig
from tpcache.service.handlers import FANOUT_OPS, GATHER_OPS, Deferred, RankHandler, to_protocol_error
from tpcache.service.metrics import RankMetrics

log = logging.getLogger("tpcache.service")

MAX_ENVELOPE_FRAMES = 4
MAX_PEERS = 65_536  # authenticated identities remembered (oldest forgotten first)
MAX_TOTAL_PENDING = 262_144
STOPPING = "the service is stopping (a rank got SIGINT or SIGTERM); retry once it is back"
STOP_QUIET_MS = 50
STOP_DRAIN_S = 1.0
# Socket flags as plain ints: pyzmq's send_multipart combines enum flags per call (~1.4 us a reply).
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK


@dataclass
class Item:
    """One accepted client request on its way through a batch."""

    envelope: list[bytes]
    request: p.Request
    frame: bytes = b""  # the client's frame, forwarded as is (it passed every check here)
    token: int = 0  # sequence number when fanned out
    outcome: Any = None  # Body, Deferred or ProtocolError


@dataclass
class Waiter:
    """A reply waiting for every follower's own answer (GATHER_OPS)."""

    item: Item
    need: set[int]
    deadline: float
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    activating: bool = False  # register_buffers: waiting for its commit batch


class Leader:
    def __init__(
        self,
        handler: RankHandler,
        channels: Channels,
        config: ServiceConfig,
        metrics: RankMetrics,
        ctx: zmq.Context,
    ) -> None:
        self.h = handler
        self.ch = channels
        self.config = config
        self.metrics = metrics
        self.request_counts: dict[tuple[str, str], int] = {}
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, p.DEFAULT_LIMITS.max_message_bytes + 1024)
        self.router.setsockopt(zmq.RCVHWM, 100_000)
        self.router.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint = self._bind(config.endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        assert channels.inbox is not None
        self.poller.register(channels.inbox, zmq.POLLIN)
        self.peers: dict[bytes, p.ServerConnection] = {}
        self.in_flight = 0  # accepted requests not yet answered, over all clients
        self.authed: OrderedDict[bytes, None] = OrderedDict()
        self.secret = config.secret.encode()
        self.next_seq = 1
        self.batch_no = 0
        self.internal: list[list[Any]] = []  # entries decided by the leader, sent with the next batch
        self.waiters: dict[int, Waiter] = {}
        self.activations: dict[int, Waiter] = {}
        self.stop_requested = False
        self.last_round = time.monotonic()
        self.last_progress = True

    def _bind(self, endpoint: str) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = self.router.bind_to_random_port(endpoint[: endpoint.rindex(":")])
            return f"{endpoint[: endpoint.rindex(':')]}:{port}"
        self.router.bind(endpoint)
        return str(self.router.getsockopt(zmq.LAST_ENDPOINT).decode())

    # ------------------------------------------------------------------ main loop

    def run(self, should_stop: Any) -> None:
        cfg = self.config
        while not should_stop() and not self.stop_requested:
            timeout_ms = self._poll_timeout_ms()
            ready = dict(self.poller.poll(timeout_ms))
            items: list[Item] = []
            if self.router in ready:
                items = self._read_clients()
            if self.ch.inbox in ready:
                self._read_answers()
            due = time.monotonic() - self.last_round >= cfg.heartbeat_s
            if items or self.internal or self._copies_in_flight() or due:
                self._run_batch(items)
            self._expire_waiters()
            self._flush_request_counts()
        self.stop()

    def _flush_request_counts(self) -> None:
        """Replies are counted per loop, not per request: a labelled Prometheus inc costs ~2 us."""
        for (op, label), n in self.request_counts.items():
            self.metrics.requests.labels(op, label).inc(n)
        self.request_counts.clear()

    def _copies_in_flight(self) -> bool:
        tp = self.h.tp
        return any(tp.core.inflight.values()) and not tp.collective.closed

    def _poll_timeout_ms(self) -> int:
        if self.internal:
            return 0
        if self._copies_in_flight():
            return 0 if self.last_progress else 1
        left = self.config.heartbeat_s - (time.monotonic() - self.last_round)
        if self.waiters:
            left = min(left, 0.05)
        return max(0, min(int(left * 1000) + 1, 100))

    # ------------------------------------------------------------------ client frames

    def _read_clients(self) -> list[Item]:
        items: list[Item] = []
        while len(items) < self.config.max_batch:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            if len(frames) < 2 or len(frames) > MAX_ENVELOPE_FRAMES:
                continue  # not a DEALER/REQ envelope: nothing sensible to answer
            envelope, frame = frames[:-1], frames[-1]
            item = self._accept(envelope, frame)
            if item is not None:
                items.append(item)
        return items

    def _accept(self, envelope: list[bytes], frame: bytes) -> Item | None:
        identity = envelope[0]
        conn = self.peers.get(identity)
        if conn is None:
            conn = p.ServerConnection(max_pending=self.config.max_pending_per_client)
        try:
            request = conn.receive(frame)
        except p.ProtocolError as exc:
            self._send(envelope, conn.reject(exc), None, "error")
            return None
        self.peers[identity] = conn
        self.in_flight += 1  # accepted: exactly one _reply ends it
        try:
            self._authorize(identity, request)
            if self.in_flight > MAX_TOTAL_PENDING:
                raise p.Overloaded("the server has too many requests in flight; retry later")
            if request.op == "hello":
                self._reply(Item(envelope, request, outcome=self.h.hello()))
                return None
            self.h.precheck(request.body)
        except p.ProtocolError as exc:
            self._reply(Item(envelope, request, outcome=exc))
            return None
        return Item(envelope, request, frame)

    def _authorize(self, identity: bytes, request: p.Request) -> None:
        if not self.secret:
            return
        if not identity.startswith(b"\x00"):
            # libzmq's generated identities start with a zero byte and are never reused; a
            # client-chosen one could take over an authenticated peer's identity after it left.
            raise p.Unauthorized("clients may not choose their routing id on a server that needs a secret")
        if request.op == "hello":
            token = request.body.token or ""
            if not hmac.compare_digest(token.encode(), self.secret):
                self.authed.pop(identity, None)
                raise p.Unauthorized("wrong or missing shared secret")
            self.authed[identity] = None
            self.authed.move_to_end(identity)
            while len(self.authed) > MAX_PEERS:
                self.authed.popitem(last=False)
        elif identity not in self.authed:
            raise p.Unauthorized("send hello with the shared secret first")

    # ------------------------------------------------------------------ one batch, one round

    def _run_batch(self, items: list[Item]) -> None:
        entries: list[list[Any]] = list(self.internal)
        self.internal = []
        first_seq = self.next_seq
        for item in items:
            if item.request.op in FANOUT_OPS:
                item.token = self.next_seq
                self.next_seq += 1
        for item in items:
            if item.token:
                entries.append([REQUEST, item.token, item.frame])
        count = self.next_seq - first_seq
        batch = {"b": self.batch_no, "s": first_seq, "n": count, "e": entries, "x": False}
        # Send first, even a batch of leader-only lookups: followers apply their part in parallel
        # and are already waiting in the round (asleep, no CPU) when rank 0 gets there, instead of
        # rank 0 waiting for them to wake (measured: round p50 about 840 -> 470 us under load).
        if self.ch.outs:
            self.ch.broadcast(pack(batch))
        activated: list[tuple[int, Any]] = []
        for kind, token, data in entries:
            if kind == ACTIVATE:
                try:
                    activated.append((token, self.h.activate(token, bool(data))))
                except p.ProtocolError as exc:
                    activated.append((token, exc))
        for item in items:
            try:
                item.outcome = self.h.apply(item.request.body, item.token)
            except p.ProtocolError as exc:
                item.outcome = exc
        start = time.perf_counter()
        report = self.h.tp.step()
        self.metrics.observe_round(time.perf_counter() - start, len(items))
        self.batch_no += 1
        self.last_round = time.monotonic()
        self.last_progress = bool(report.completed)
        closed = self.h.tp.core.closed
        for item in items:
            self._finish(item, report, closed)
        for token, outcome in activated:
            waiter = self.activations.pop(token, None)
            if waiter is not None:
                waiter.item.outcome = outcome
                self._reply(waiter.item)
        if self.metrics.due():
            self.metrics.publish(self.h.stats_values(), self.h.tp.health())

    def _finish(self, item: Item, report: Any, closed: bool) -> None:
        outcome = item.outcome
        if isinstance(outcome, Deferred):
            try:
                outcome = outcome.finish(report)
            except Exception as exc:  # noqa: BLE001 - mapped to a typed error
                outcome = to_protocol_error(exc)
        hit = isinstance(outcome, (p.MatchResult, p.LockResult)) and outcome.hit_tokens > 0
        if closed and (hit or isinstance(outcome, p.LoadResult)):
            # Never a hit from a closed cache: the round that covers this reply did not agree.
            outcome = p.CacheClosed(f"the cache closed in round {report.round}: {self.h.tp.core.closed_reason}")
        item.outcome = outcome
        if item.request.op in GATHER_OPS:
            waiter = Waiter(item, set(range(1, self.ch.world)), time.monotonic() + self.config.round_timeout_s + 5.0)
            if waiter.need:
                self.waiters[item.token] = waiter
            else:
                self._complete(waiter)
            return
        self._reply(item)

    # ------------------------------------------------------------------ per-rank answers

    def _read_answers(self) -> None:
        assert self.ch.inbox is not None
        while True:
            try:
                data = self.ch.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = unpack(data)
            except Exception:  # noqa: BLE001 - the internal channel is trusted, but never crash on it
                log.error("unreadable message on the internal channel")
                continue
            if "stop" in msg:
                log.info("rank %s asked the group to stop", msg["stop"])
                self.stop_requested = True
                continue
            rank = int(msg.get("r", -1))
            for token, payload in msg.get("a", ()):
                waiter = self.waiters.get(token)
                if waiter is None or rank not in waiter.need:
                    continue
                waiter.need.discard(rank)
                waiter.answers[rank] = payload
                if not waiter.need:
                    del self.waiters[token]
                    self._complete(waiter)

    def _complete(self, waiter: Waiter) -> None:
        item = waiter.item
        if item.request.op == "register_buffers":
            self._decide_registration(waiter)
            return
        outcome = item.outcome
        failed = sorted((r, a) for r, a in waiter.answers.items() if "error" in a)
        if isinstance(outcome, p.ProtocolError):
            pass
        elif failed:
            rank, answer = failed[0]
            outcome = p.exception_for(answer["error"], f"rank {rank}: {answer.get('message', '')}")
        elif isinstance(outcome, p.StatsResult):
            outcome = p.StatsResult(self._merge_stats(dict(outcome.values), waiter.answers))
        elif isinstance(outcome, p.GetPagesResult):
            parts = [outcome.data] + [waiter.answers[r].get("data", b"") for r in sorted(waiter.answers)]
            outcome = p.GetPagesResult(b"".join(parts))
        item.outcome = outcome
        self._reply(item)

    def _merge_stats(self, values: dict[str, Any], answers: dict[int, dict[str, Any]]) -> dict[str, Any]:
        per_rank = {0: values, **{r: a.get("values", {}) for r, a in answers.items()}}
        for r in sorted(per_rank):
            for key in ("digest", "rounds", "seq", "closed", "leases", "device_pages_used", "host_pages_used"):
                values[f"rank{r}.{key}"] = per_rank[r].get(key)
        digests = {per_rank[r].get("digest") for r in per_rank}
        values["digests_equal"] = len(digests) == 1 and None not in digests
        return values

    def _decide_registration(self, waiter: Waiter) -> None:
        """All ranks staged (or failed to): commit or discard in the next batch, on every rank."""
        item = waiter.item
        failures = [f"rank {r}: {a.get('message', '')}" for r, a in sorted(waiter.answers.items()) if "error" in a]
        ok = not isinstance(item.outcome, p.ProtocolError) and not failures
        self.internal.append([ACTIVATE, item.token, ok])
        if ok:
            self.activations[item.token] = waiter
            return
        if not isinstance(item.outcome, p.ProtocolError):
            item.outcome = p.InvalidArgument("; ".join(failures))
        self._reply(item)

    def _expire_waiters(self) -> None:
        if not self.waiters:
            return
        now = time.monotonic()
        for token, waiter in list(self.waiters.items()):
            if now < waiter.deadline:
                continue
            del self.waiters[token]
            missing = ", ".join(str(r) for r in sorted(waiter.need))
            if waiter.item.request.op == "register_buffers":
                self.internal.append([ACTIVATE, token, False])
            waiter.item.outcome = p.RequestTimeout(f"rank(s) {missing} did not answer in time")
            self._reply(waiter.item)

    # ------------------------------------------------------------------ replies

    def _reply(self, item: Item) -> None:
        outcome = item.outcome
        rid = item.request.id
        identity = item.envelope[0]
        conn = self.peers.get(identity)
        if conn is not None and conn.is_pending(rid):
            self.in_flight -= 1
        try:
            if isinstance(outcome, p.ProtocolError):
                label = outcome.code.name.lower()
                response = p.error_response(rid, outcome)
                frame = conn.send(response) if conn is not None else p.encode_response(response)
            else:
                label = "ok"
                frame = conn.send_ok(rid, outcome) if conn is not None else p.encode_ok(rid, outcome)
        except p.ProtocolError as exc:  # the result itself is too large to send
            frame = p.encode_response(p.error_response(rid, exc))
            label = "too_large"
        if conn is not None and not conn.num_pending:
            del self.peers[identity]  # nothing in flight: the per-peer state is not needed
        self._send(item.envelope, frame, item.request.op, label)

    def _send(self, envelope: list[bytes], frame: bytes, op: str | None, label: str) -> None:
        key = (op or "invalid", label)
        self.request_counts[key] = self.request_counts.get(key, 0) + 1  # to Prometheus once per loop
        with contextlib.suppress(zmq.ZMQError):  # the client is gone or not reading: reply dropped
            # as send_multipart does, part by part (a ROUTER drops what it cannot route, whole)
            send = self.router.send
            for part in envelope:
                send(part, _MORE_NOBLOCK)
            send(frame, _NOBLOCK)

    # ------------------------------------------------------------------ shutdown

    def stop(self) -> None:
        """Answer every request still in flight with "the service is stopping" (those waiting for
        followers and those not yet read), then fan out the stop batch; every follower exits
        after reading it."""
        for waiter in [*self.waiters.values(), *self.activations.values()]:
            waiter.item.outcome = p.CacheClosed(STOPPING)
            self._reply(waiter.item)
        self.waiters.clear()
        self.activations.clear()
        # Frames still arriving (sent before the stop, in transit) are answered too, until the
        # socket has been quiet for STOP_QUIET_MS; bounded in count and time.
        deadline = time.monotonic() + STOP_DRAIN_S
        answered = 0
        while answered < MAX_TOTAL_PENDING and time.monotonic() < deadline and self.router.poll(STOP_QUIET_MS):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                continue
            answered += 1
            if 2 <= len(frames) <= MAX_ENVELOPE_FRAMES:
                item = self._accept(frames[:-1], frames[-1])
                if item is not None:
                    item.outcome = p.CacheClosed(STOPPING)
                    self._reply(item)
        self._flush_request_counts()
        if self.ch.outs:
            self.ch.broadcast(pack({"b": self.batch_no, "s": self.next_seq, "n": 0, "e": [], "x": True}))
        self.router.close()
