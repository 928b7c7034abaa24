"""Rank 0: the client front door, the sequencer and the pace of rounds.

Loop: wait for client frames (or answers from followers, or a heartbeat); take everything
waiting, up to ``max_batch``; decode each frame (a bad one gets its error reply at once and never
reaches the cache); route each request as its message declares (``protocol.messages``): a
``local`` one is answered here alone, a ``sequenced`` or ``gathered`` one is numbered and sent to
every follower in the ordered batch; apply the batch here in the same order (``batch.apply_batch``,
the code every rank shares); run the round; then reply. A reply is sent only after the round
covering its request committed; if that round closed the cache, replies that would report a hit
become CACHE_CLOSED errors. Gathered requests (stats, buffers, inline pages) also wait for every
follower's own answer, with a deadline.

Plain lookups (a match without storage, rank 0's own answer) are the hot path: read with the C
reader straight out of the transport's frame into their token bytes (``protocol.match_tokens``)
and applied as they are read while nothing sequenced precedes them in the batch, which is their
place in the order; a batch that opens with one is sent to the followers at once, empty, and
takes only lookups from then on (the first other request opens the next batch), so the followers
wake while rank 0 still reads. While rank 0 waits in a round, the shm transport lets it read more
lookups into that batch (after its entries, before its commit: a read changes nothing the round
agrees on). Their replies, like every reply, wait for the batch's round.

Rounds: one per batch. The leader also runs (empty) rounds while copies are in flight, so they
complete, and at least every ``heartbeat_s`` when idle, so a dead rank is noticed.

A round whose collective failed (a rank died or stalled past the round timeout) breaks the group
for good: its ranks can no longer agree, and an agreed flush cannot reopen it. Rank 0 then answers
every request that needs a round with CACHE_CLOSED ("the group must be restarted"), lookups with
misses, and after ``broken_group_exit_s`` returns ``EXIT_GROUP_BROKEN`` so that the process exits
non-zero and torchrun (``--max-restarts``) starts the group again; followers exit at once.

Clients are connections (``frontdoor``): authentication, requests in flight and leases belong to
one connection. The leader alone decides when a lease is abandoned (its connection is gone, or
it sat unused past ``lease_ttl_s`` by rank 0's clock) and sequences its release as an ``EXPIRE``
entry that every rank applies; no other rank ever looks at a clock to change the cache.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

import protocol as p
from tpcache.service.batch import ACTIVATE, EXIT_GROUP_BROKEN, EXPIRE, REQUEST, Entry, apply_batch
from tpcache.service.channels import MAX_BATCH_BYTES, Answers, Channels, Stop
from tpcache.service.config import ServiceConfig
from tpcache.service.events import EventStream
from tpcache.service.expiry import LeaseExpiry
from tpcache.service.frontdoor import Conn, FrontDoor, Message, default_unread_bytes
from tpcache.service.handlers import RankHandler
from tpcache.service.metrics import RankMetrics
from tpcache.service.ops import Ctx, Watch, match_body, merge_gathered, to_protocol_error

log = logging.getLogger("tpcache.service")

MAX_TOTAL_PENDING = 262_144
# A batch takes no more requests once the large replies it will build (inline pages) pass this: its
# round stays short, so a request read after it (a new client's hello) waits little.
MAX_BATCH_REPLY_BYTES = 16 << 20
_LOOKUPS_PER_POLL = 4  # read per call while a round waits: the round looks at its peers in between
WATCH_ROUND_S = 0.002  # while a reply waits for a storage prefetch, rounds run at least this often
STOPPING = "the service is stopping (a rank got SIGINT or SIGTERM); retry once it is back"
STOP_QUIET_MS = 50  # on stop, frames still arriving are answered until the socket is this quiet
STOP_DRAIN_S = 1.0  # ... for at most this long


@dataclass
class Item:
    """One accepted client request on its way through a batch."""

    msg: Message
    request: p.Request
    entry: Entry  # what every rank applies (the client's frame, forwarded as is: it passed every check here)
    reply_bytes: int = 0  # counted against its connection's large replies in flight
    route: str = p.LOCAL  # as its message declares (``Body.route``)

    @property
    def outcome(self) -> Any:
        return self.entry.outcome

    @outcome.setter
    def outcome(self, value: Any) -> None:
        self.entry.outcome = value


# A plain match request, applied as it was read (``Leader._lookup``): what its reply needs, as a
# tuple (the hot path makes one per request): the message, its request id, and what the match
# found (``ops.Found``) or a ProtocolError.
Lookup = tuple[Message, int, Any]


class BindError(Exception):
    """Rank 0 could not bind the endpoint a setting names (``name``)."""

    def __init__(self, name: str, exc: zmq.ZMQError) -> None:
        super().__init__(str(exc))
        self.name = name


@dataclass
class Waiter:
    """A reply waiting for every follower's own answer (gathered ops)."""

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
        # The KV-event stream (``events_endpoint``): what each round changed, published after its
        # commit. Bound before the front door, which is closed again if it cannot bind.
        self.events: EventStream | None = None
        if config.events_endpoint:
            try:
                self.events = EventStream(config, ctx, handler.tp.core, channels.world)
            except zmq.ZMQError as exc:
                name = "events_replay_endpoint" if config.events_replay_endpoint else "events_endpoint"
                raise BindError(name, exc) from None
        try:
            self.door = FrontDoor(
                ctx,
                config.endpoint,
                config.max_pending_per_client,
                config.max_unread_reply_bytes or default_unread_bytes(),
                config.max_connections,
            )
        except zmq.ZMQError as exc:
            if self.events is not None:
                self.events.close()
            raise BindError("endpoint", exc) from None
        self.endpoint = self.door.endpoint
        self.poller = zmq.Poller()
        for sock in self.door.sockets():
            self.poller.register(sock, zmq.POLLIN)
        assert channels.inbox is not None
        self.poller.register(channels.inbox, zmq.POLLIN)
        self.in_flight = 0  # accepted requests not yet answered, over all clients
        self.secret = config.secret.encode()
        self.next_seq = 1
        self.batch_no = 0
        self.internal: list[Entry] = []  # entries decided by the leader, sent with the next batch
        self.lookups: list[Lookup] = []  # plain matches of the batch being read, applied already
        self.carry: Message | None = None  # read while a round ran, not a lookup: first of the next batch
        self.in_round = False
        self.announced = False  # the batch being read was sent already (``_announce``)
        self.waiters: dict[int, Waiter] = {}
        self.activations: dict[int, Waiter] = {}
        self.watches: list[tuple[Item, Watch, float]] = []  # replies waiting on a storage prefetch
        self.expiry = LeaseExpiry(handler.book, config.lease_ttl_s, time.monotonic())
        self.stop_requested = False
        self.broken: str | None = None  # why the group can no longer agree (its collective failed)
        self.broken_since = 0.0
        self.last_round = time.monotonic()
        self.last_progress = True
        collective = handler.tp.collective  # (a buffer registration rebuilds tp on the same collective)
        if hasattr(collective, "while_waiting"):  # last: a leader that failed to start is not kept alive
            collective.while_waiting = self._while_round

    # ------------------------------------------------------------------ main loop

    def run(self, should_stop: Any) -> int:
        """Serve until stopped; returns the process exit code."""
        cfg = self.config
        door = self.door
        while not should_stop() and not self.stop_requested:
            if self.broken is not None and 0 <= cfg.broken_group_exit_s <= time.monotonic() - self.broken_since:
                log.error("exiting so that the group is restarted: %s", self.broken)
                self.stop()
                return EXIT_GROUP_BROKEN
            timeout_ms = self._poll_timeout_ms()
            if self.events is not None:  # rounds waiting for their event batch: sent when it is due
                timeout_ms = self.events.publisher.tick(timeout_ms)
            ready = dict(self.poller.poll(timeout_ms))
            if door.zap in ready:
                door.answer_zap()
            if door.monitor in ready:
                door.read_monitor()
            # Answers and expiries first: what they add to the batch applies before the clients'
            # requests read next (``_read_clients`` applies plain lookups as it reads them).
            if self.ch.inbox in ready:
                self._read_answers()
                self.h.service_counters["internal_rejected_frames"] = self.ch.rejected
            self._expire_abandoned()
            items: list[Item] = []
            if door.router in ready or self.carry is not None:
                items = self._read_clients()
            idle = time.monotonic() - self.last_round
            due = idle >= cfg.heartbeat_s or self.watches and idle >= WATCH_ROUND_S
            if items or self.lookups or self.internal or self._copies_in_flight() or due:
                self._run_batch(items)
            self._expire_waiters()
            door.flush()
            self._flush_request_counts()
        self.stop()
        return EXIT_GROUP_BROKEN if self.broken is not None else 0

    def _flush_request_counts(self) -> None:
        """Replies are counted per loop, not per request: a labelled Prometheus inc costs ~2 us."""
        for (op, label), n in self.request_counts.items():
            self.metrics.requests.labels(op, label).inc(n)
        self.request_counts.clear()

    def _copies_in_flight(self) -> bool:
        tp = self.h.tp
        return tp.core.ops_in_flight() > 0 and not tp.collective.closed

    def _poll_timeout_ms(self) -> int:
        if self.internal or self.carry is not None:
            return 0
        if self.door.backlogged:
            return 1  # replies wait for a client's socket queue: look again soon
        if self._copies_in_flight():
            return 0 if self.last_progress else 1
        left = self.config.heartbeat_s - (time.monotonic() - self.last_round)
        if self.watches:
            left = min(left, WATCH_ROUND_S - (time.monotonic() - self.last_round))
        if self.waiters:
            left = min(left, 0.05)
        return max(0, min(int(left * 1000) + 1, 100))

    # ------------------------------------------------------------------ client frames

    def _read_clients(self) -> list[Item]:
        items: list[Item] = []
        lookups = self.lookups
        size = 0  # bytes of the batch's client frames: every rank holds the batch at once
        # Plain lookups read before anything of this batch that every rank applies (nothing the
        # leader decided waits, no sequenced request read yet) apply as they are read: that is
        # their place in the batch's order, as nothing else changes this rank's cache before it,
        # and their frames are let go at once instead of waiting, cold, for the batch to end.
        early = self.broken is None and not self.internal
        limit = self.config.max_batch
        replies = 0  # bytes of the large replies this batch's requests will build
        while len(items) + len(lookups) < limit and size < MAX_BATCH_BYTES and replies < MAX_BATCH_REPLY_BYTES:
            msg, self.carry = self.carry or self.door.receive(), None
            if msg is None:
                break
            if early and self._lookup(msg):
                if not items and not self.announced:
                    self._announce()
                continue
            if self.announced:  # the batch was sent without entries: this one opens the next
                self.carry = msg
                break
            item = self._accept(msg)
            if item is not None:
                items.append(item)
                size += len(msg.frame)
                replies += item.reply_bytes
                early = early and item.route == p.LOCAL
        return items

    def _announce(self) -> None:
        """Send the batch being read to the followers now, empty: it opens with a lookup, and from
        here it takes only lookups (the first other request waits for the next batch, ``carry``).
        The followers wake and wait in its round while rank 0 still reads, instead of rank 0
        waiting in the round for them to wake: when every request in flight is a lookup waiting
        for that round, its wake-ups are what the clients wait for."""
        self.announced = True
        if self.ch.outs:
            self.ch.broadcast({"b": self.batch_no, "s": self.next_seq, "n": 0, "e": [], "x": False})

    def _while_round(self) -> bool:
        """While rank 0 waits in a round for the other ranks (the round transport calls this between
        its polls): read plain lookups and apply them as part of the batch whose round it is. They
        come after its entries and before its commit, and a lookup reads only, so that is a place
        in the order like any other; they are answered after the round, with the batch. The first
        frame that is not a plain lookup stops it and waits (``carry``) to open the next batch, so
        that nothing read after it is applied before it. Returns whether it read anything."""
        if not self.in_round or self.carry is not None or len(self.lookups) >= self.config.max_batch:
            return False
        counters = self.h.service_counters
        try:
            for n in range(_LOOKUPS_PER_POLL):
                msg = self.door.receive()
                if msg is None:
                    return n > 0
                if not self._lookup(msg):
                    self.carry = msg
                    counters["round_wait_carried"] = counters.get("round_wait_carried", 0) + 1
                    return True
                counters["round_wait_lookups"] = counters.get("round_wait_lookups", 0) + 1
        except Exception:  # noqa: BLE001 - never into the round transport; the loop sees it again
            log.exception("reading lookups during a round failed")
            return False
        return True

    def _lookup(self, msg: Message) -> bool:
        """Apply ``msg`` now if it is a plain match request this connection may send (what
        ``_accept`` would accept and route LOCAL), reading its tokens straight out of the frame;
        False, with nothing changed, for anything else (``_accept`` then decides, errors included)."""
        found = p.match_tokens(msg.raw)
        if found is None:
            return False
        rid, tokens, storage = found
        conn = msg.conn
        if storage or (self.secret and not conn.authed) or conn.refused or self.in_flight >= MAX_TOTAL_PENDING:
            return False  # sequenced, or refused: the general path answers it
        if not conn.server.admit(rid):
            return False  # a duplicate id, or too many in flight: the general path says so
        self.in_flight += 1  # accepted: exactly one _reply_to ends it
        msg.raw = None  # the frame is read: let it go now
        try:
            outcome: Any = self.h.lookup(tokens)
        except p.ProtocolError as exc:
            outcome = exc.with_traceback(None)  # (its frames would hold the batch)
        self.lookups.append((msg, rid, outcome))
        return True

    def _accept(self, msg: Message) -> Item | None:
        conn = msg.conn
        try:
            request = conn.server.receive(msg.frame)
        except p.ProtocolError as exc:
            self._send(msg, conn.server.reject(exc), None, "error")
            return None
        self.in_flight += 1  # accepted: exactly one _reply ends it
        entry = Entry(REQUEST, 0, conn.id, msg.frame, request.body)
        item = Item(msg, request, entry, 0, request.body.route())
        try:
            if conn.refused:
                self.door.refuse(conn)
                raise p.Overloaded(conn.refused)
            self._authorize(conn, request)
            if self.in_flight > MAX_TOTAL_PENDING:
                raise p.Overloaded("the server has too many requests in flight; retry later")
            if request.op == "hello":
                item.outcome = self.h.hello()
                self._reply(item)
                return None
            self.h.precheck(request.body)
            self._reserve_reply(item)
        except p.ProtocolError as exc:
            item.outcome = exc.with_traceback(None)  # (its frames would hold the batch)
            self._reply(item)
            return None
        return item

    def _reserve_reply(self, item: Item) -> None:
        """Count a large reply against its connection before the request runs (OVERLOADED past the
        bound): a client that never reads cannot make every rank build replies for it without end."""
        size = self.h.reply_bytes(item.request.body)
        if not size:
            return
        self.door.reserve(item.msg.conn, size)  # (and every connection's together: max_unread_reply_bytes)
        item.reply_bytes = size

    def _authorize(self, conn: Conn, request: p.Request) -> None:
        """A server with a secret serves a connection only after its own hello gave the secret."""
        if not self.secret:
            return
        if request.op == "hello":
            token = request.body.token or ""
            conn.authed = hmac.compare_digest(token.encode(), self.secret)
            if not conn.authed:
                raise p.Unauthorized("wrong or missing shared secret")
        elif not conn.authed:
            raise p.Unauthorized("send hello with the shared secret first (on this connection)")

    # ------------------------------------------------------------------ abandoned leases

    def _expire_abandoned(self) -> None:
        """Sequence the release of leases whose connection left or that sat idle past the TTL."""
        self.expiry.connections_gone(self.door.take_gone())
        for leases in self.expiry.scan(time.monotonic()):
            self.internal.append(Entry(EXPIRE, 0, 0, leases))

    # ------------------------------------------------------------------ one batch, one round

    def _run_batch(self, items: list[Item]) -> None:
        lookups, self.lookups = self.lookups, []
        announced, self.announced = self.announced, False
        if self.broken is not None:
            for msg, rid, _ in lookups:  # (none: lookups apply early only while the group is whole)
                self._reply_to(msg, rid, "match", self._broken_error())
            self._answer_broken(items)
            return
        entries: list[Entry] = self.internal
        self.internal = []
        assert not announced or not (entries or items), "an announced batch takes lookups only"
        first_seq = self.next_seq
        for item in items:
            if item.route != p.LOCAL:
                entry = item.entry
                entry.token = self.next_seq
                self.next_seq += 1
                entries.append(entry)
        count = self.next_seq - first_seq
        batch = {"b": self.batch_no, "s": first_seq, "n": count, "e": [e.wire() for e in entries], "x": False}
        # Send first, even a batch of leader-only lookups: followers apply their part in parallel
        # and are already waiting in the round (asleep, no CPU) when rank 0 gets there, instead of
        # rank 0 waiting for them to wake (a wake-up costs about as much as the round itself).
        if self.ch.outs and not announced:
            self.ch.broadcast(batch)
        # Here every request applies, local ones in their place: a client's match after its own
        # lock in the same batch sees the lock.
        internal = [e for e in entries if e.kind != REQUEST]
        self.h.service_counters.update(self.door.counters)
        self.h.service_counters["unread_reply_bytes"] = self.door.held
        self.in_round = True
        try:
            report = apply_batch(self.h, self.metrics, internal + [item.entry for item in items], len(lookups))
        finally:
            self.in_round = False
        if self.events is not None:
            self.events.after_round(self.h.tp.core)
            self.h.service_counters.update(self.events.counters())
        lookups += self.lookups  # read while the round waited (``_while_round``)
        self.lookups = []
        now = time.monotonic()
        for entry in internal:
            if entry.kind == EXPIRE:
                self.expiry.applied(entry.data)
        for item in items:  # leases named by this batch were used now
            if item.route == p.LOCAL:
                continue
            lease = getattr(item.request.body, "lease", None)
            if lease is None and isinstance(item.outcome, p.LockResult):
                lease = item.outcome.lease
            if lease is not None:
                self.expiry.touch(lease, now)
        self.batch_no += 1
        self.last_round = time.monotonic()
        self.last_progress = bool(report.completed)
        closed = self.h.tp.core.closed
        if self.h.tp.collective.closed:
            self._break(report)
        if lookups:
            self._answer_lookups(lookups, report, closed)
        for item in items:
            self._finish(item, report, closed)
        if self.watches:
            self._check_watches(report, closed)
        for entry in internal:
            waiter = self.activations.pop(entry.token, None) if entry.kind == ACTIVATE else None
            if waiter is not None:
                waiter.item.outcome = entry.outcome
                self._reply(waiter.item)
        if self.metrics.due():
            self.metrics.publish(self.h.stats_values(), self.h.tp.health())

    def _break(self, report: Any) -> None:
        """The collective failed: no round can run again. Everything waiting gets its answer now."""
        self.broken = f"{self.h.tp.core.closed_reason or 'the round collective failed'}"
        self.broken_since = time.monotonic()
        log.error("the group is broken and must be restarted: %s", self.broken)
        self.metrics.publish(self.h.stats_values(), self.h.tp.health(), force=True)  # /health: 503, why
        error = self._broken_error()
        waiting = [w.item for w in self.waiters.values()] + [w.item for w in self.activations.values()]
        waiting += [item for item, _, _ in self.watches]
        self.waiters, self.activations, self.watches, self.internal = {}, {}, [], []
        for item in waiting:
            item.outcome = error
            self._reply(item)

    def _broken_error(self) -> p.CacheClosed:
        return p.CacheClosed(
            f"{self.broken}; the ranks can no longer agree, so the group must be restarted (a flush cannot "
            "reopen it; under torchrun --max-restarts the ranks exit and are started again)"
        )

    def _answer_broken(self, items: list[Item]) -> None:
        """Without rounds: lookups answer from this rank (a closed cache: misses), the rest is refused."""
        for item in items:
            body = item.request.body
            if body.route() == p.LOCAL:
                try:
                    item.outcome = self.h.apply(body, Ctx(0, item.msg.conn.id))
                except p.ProtocolError as exc:
                    item.outcome = exc.with_traceback(None)  # (its frames would hold the batch)
            else:
                item.outcome = self._broken_error()
            self._reply(item)

    def _guard(self, outcome: Any, report: Any, closed: bool) -> Any:
        """Never a hit from a closed cache: the round that covers this reply did not agree."""
        hit = isinstance(outcome, (p.MatchResult, p.LockResult)) and (outcome.hit_tokens or outcome.storage_pages)
        hit = (
            hit or isinstance(outcome, p.LoadResult) or isinstance(outcome, p.PrefetchResult) and outcome.storage_pages
        )
        if closed and hit:
            return p.CacheClosed(f"the cache closed in round {report.round}: {self.h.tp.core.closed_reason}")
        return outcome

    def _answer_lookups(self, lookups: list[Lookup], report: Any, closed: bool) -> None:
        """Reply to the batch's lookups, in order (``_reply_to`` of each, guarded): a plain hit or
        miss is encoded straight from the cache's match here, and the frames go to the socket back
        to back (``FrontDoor.send_all``); anything else (an error, a hit from a closed cache) the
        general way."""
        page_size = self.h.tp.config.page_size
        encode = p.encode_match_ok
        replies: list[tuple[Conn, list[bytes], bytes]] = []
        ok = 0
        for msg, rid, outcome in lookups:
            conn = msg.conn
            if type(outcome) is not tuple or closed or not conn.server.finish(rid):
                self.door.send_all(replies)  # (the replies before it go first)
                ok += len(replies)
                replies = []
                if type(outcome) is tuple:  # (ops.Found)
                    outcome = match_body(outcome, page_size)
                self._reply_to(msg, rid, "match", self._guard(outcome, report, closed))
                continue
            device, host, pages = outcome
            try:
                frame = encode(rid, (device + host) * page_size, device, host, 0, pages)
            except p.ProtocolError as exc:  # the result itself is too large to send (as in _reply_to)
                self.in_flight -= 1
                self._send(msg, p.encode_response(p.error_response(rid, exc)), "match", "too_large")
                continue
            replies.append((conn, msg.envelope, frame))
        self.door.send_all(replies)
        ok += len(replies)
        self.in_flight -= ok
        if ok:
            key = ("match", "ok")
            self.request_counts[key] = self.request_counts.get(key, 0) + ok

    def _finish(self, item: Item, report: Any, closed: bool) -> None:
        outcome = item.outcome
        if self.broken is not None and item.route != p.LOCAL:
            # Its round failed: nothing it did is agreed, and no round will ever agree it.
            item.outcome = self._broken_error()
            self._reply(item)
            return
        if isinstance(outcome, Watch):
            self.watches.append((item, outcome, time.monotonic() + 2 * self.config.round_timeout_s + 5.0))
            return
        item.outcome = self._guard(outcome, report, closed)
        if item.route == p.GATHERED:
            waiter = Waiter(item, set(range(1, self.ch.world)), time.monotonic() + self.config.round_timeout_s + 5.0)
            if waiter.need:
                self.waiters[item.entry.token] = waiter
            else:
                self._complete(waiter)
            return
        self._reply(item)

    def _check_watches(self, report: Any, closed: bool) -> None:
        """Reply to every request whose storage prefetch now lets it go (after this round)."""
        now = time.monotonic()
        waiting = []
        for item, watch, deadline in self.watches:
            try:
                # Past the deadline (storage never answered): reply with what is agreed so far.
                outcome = self.h.watched(watch, now=now >= deadline)
            except Exception as exc:  # noqa: BLE001 - the lease went away: a typed error
                outcome = to_protocol_error(exc)
            if outcome is None:
                waiting.append((item, watch, deadline))
                continue
            if watch.transient:
                self.expiry.expire([watch.lease])
            item.outcome = self._guard(outcome, report, closed)
            self._reply(item)
        self.watches = waiting

    # ------------------------------------------------------------------ per-rank answers

    def _read_answers(self) -> None:
        while (msg := self.ch.receive_up()) is not None:
            if isinstance(msg, Stop):
                log.info("rank %s asked the group to stop", msg.rank)
                self.stop_requested = True
                continue
            assert isinstance(msg, Answers)
            for token, payload in msg.answers:
                waiter = self.waiters.get(token)
                if waiter is None or msg.rank not in waiter.need:
                    continue
                waiter.need.discard(msg.rank)
                waiter.answers[msg.rank] = payload
                if not waiter.need:
                    del self.waiters[token]
                    self._complete(waiter)

    def _complete(self, waiter: Waiter) -> None:
        item = waiter.item
        if item.request.op == "register_buffers":
            self._decide_registration(waiter)
            return
        item.outcome = merge_gathered(item.request.body, item.outcome, waiter.answers)
        self._reply(item)

    def _decide_registration(self, waiter: Waiter) -> None:
        """All ranks staged (or failed to): commit or discard in the next batch, on every rank."""
        item = waiter.item
        failures = [f"rank {r}: {a.get('message', '')}" for r, a in sorted(waiter.answers.items()) if "error" in a]
        ok = not isinstance(item.outcome, p.ProtocolError) and not failures
        self.internal.append(Entry(ACTIVATE, item.entry.token, 0, ok))
        if ok:
            self.activations[item.entry.token] = waiter
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
                self.internal.append(Entry(ACTIVATE, token, 0, False))
            waiter.item.outcome = p.RequestTimeout(f"rank(s) {missing} did not answer in time")
            self._reply(waiter.item)

    # ------------------------------------------------------------------ replies

    def _reply(self, item: Item) -> None:
        self.door.unreserve(item.msg.conn, item.reply_bytes)
        item.reply_bytes = 0
        self._reply_to(item.msg, item.request.id, item.request.op, item.outcome)

    def _reply_to(self, msg: Message, rid: int, op: str, outcome: Any) -> None:
        conn = msg.conn
        server = conn.server
        if server.is_pending(rid):
            self.in_flight -= 1
        try:
            if isinstance(outcome, p.ProtocolError):
                label = outcome.code.name.lower()
                frame = server.send(p.error_response(rid, outcome))
            else:
                label = "ok"
                frame = server.send_ok(rid, outcome)
        except p.ProtocolError as exc:  # the result itself is too large to send
            frame = p.encode_response(p.error_response(rid, exc))
            label = "too_large"
        if conn.gone and isinstance(outcome, p.LockResult):
            # The client left before its lease reached it: nobody can ever release it.
            self.expiry.expire([outcome.lease])
        self._send(msg, frame, op, label)

    def _send(self, msg: Message, frame: bytes, op: str | None, label: str) -> None:
        key = (op or "invalid", label)
        self.request_counts[key] = self.request_counts.get(key, 0) + 1  # to Prometheus once per loop
        self.door.send(msg.conn, msg.envelope, frame)  # dropped if the client is gone or not reading

    # ------------------------------------------------------------------ shutdown

    def stop(self) -> None:
        """Answer every request still in flight with "the service is stopping" (those waiting for
        followers or a storage prefetch, and frames still arriving), then fan out the stop batch;
        every follower exits after reading it."""
        stopping = p.CacheClosed(STOPPING)
        if self.carry is not None:
            carried, self.carry = self.carry, None
            item = self._accept(carried)
            if item is not None:
                item.outcome = stopping
                self._reply(item)
        waiting = [w.item for w in self.waiters.values()] + [w.item for w in self.activations.values()]
        waiting += [item for item, _, _ in self.watches]
        self.waiters, self.activations, self.watches = {}, {}, []
        for item in waiting:
            item.outcome = stopping
            self._reply(item)
        # Frames sent before the stop are answered too, until the socket has been quiet for
        # STOP_QUIET_MS; bounded in count and time.
        deadline = time.monotonic() + STOP_DRAIN_S
        answered = 0
        while answered < MAX_TOTAL_PENDING and time.monotonic() < deadline and self.door.router.poll(STOP_QUIET_MS):
            while answered < MAX_TOTAL_PENDING and (msg := self.door.receive()) is not None:
                answered += 1
                item = self._accept(msg)
                if item is not None:
                    item.outcome = stopping
                    self._reply(item)
            self.door.flush()
        self._flush_request_counts()
        if self.ch.outs:
            self.ch.broadcast({"b": self.batch_no, "s": self.next_seq, "n": 0, "e": [], "x": True})
        if self.events is not None:
            self.events.close()
            self.events = None
        self.door.close()
