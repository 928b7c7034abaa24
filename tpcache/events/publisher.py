"""Rank 0's event stream: after each commit, what the round changed on each tier, in order.

``publish`` runs on the round thread and costs what the round changed. A batch holds the rounds
since the last one (a round ``batch_s`` or more after the last batch seals one at once; rounds
closer together wait for ``tick``): sealing it moves the published mirror (a set of page hashes per
tier) and its digest, encodes it once, keeps it in the replay ring and sends it on the PUB socket,
which never blocks: a subscriber that falls more than
``hwm`` messages behind loses messages in ZMQ's queue (it sees the gap in the sequence numbers and
asks for a replay). The replay endpoint (a ROUTER) is served by a thread of its own: replays from
the ring, the group's identity, and snapshots of the mirror, copied under the lock at a batch
boundary (tagged with the sequence number they are consistent with) and sent in chunks after it.

Memory: the ring holds at most ``replay_batches`` batches and ``replay_bytes`` bytes (the oldest
go first); the mirror holds one entry per (page, tier) the cache holds; ZMQ's queues hold at most
``hwm`` messages per subscriber.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import zmq

from tpcache.core.treecore.feed import ChangeFeed, Changes
from tpcache.events import wire

log = logging.getLogger("tpcache.events")

SNAPSHOT_CHUNK = 65_536  # page hashes per snapshot message
_MORE = zmq.SNDMORE


class EventPublisher:
    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        replay_endpoint: str,
        identity: dict[str, Any],
        *,
        page_size: int,
        topic: str = "kv-events",
        replay_batches: int = 10_000,
        replay_bytes: int = 64 << 20,
        digest_every: int = 64,
        snapshot_max_pages: int = 4_000_000,
        hwm: int = 100_000,
        batch_s: float = 0.0,
    ) -> None:
        """``batch_s``: rounds that follow a batch by less than this go into the next batch, sent
        once it is that old (``tick``): one message for several rounds (0: a batch per round)."""
        self.identity = dict(identity)
        self.batch_s = batch_s
        self.pending: list[Changes] = []  # rounds not yet in a batch, oldest first
        self.last_batch = -1e9  # when the last batch was sealed (monotonic seconds)
        self.page_size = page_size
        self.encoder = wire.BatchEncoder(page_size)
        self.topic = topic.encode()
        self.digest_topic = wire.DIGEST_TOPIC.encode()
        self.replay_batches, self.replay_bytes = replay_batches, replay_bytes
        self.digest_every = digest_every
        self.snapshot_max_pages = snapshot_max_pages
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, replay_batches + SNAPSHOT_CHUNK)
        self.router.setsockopt(zmq.LINGER, 0)
        try:
            self.pub.bind(endpoint)
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.router.bind(replay_endpoint)
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self.pub.close(0)
            self.router.close(0)
            raise zmq.ZMQError(exc.errno, f"event stream {endpoint} / {replay_endpoint}: {exc.strerror}") from None
        self.lock = threading.Lock()  # the mirror, the digest, the ring and ``seq`` move together
        self.mirror: tuple[set[int], set[int], set[int]] = (set(), set(), set())
        self.digest = 0
        self.seq = -1  # the last batch published
        self.ring: deque[tuple[int, bytes]] = deque()
        self.ring_bytes = 0
        self.counters = {
            "event_batches": 0,
            "event_pages_stored": 0,
            "event_pages_removed": 0,
            "event_replays": 0,
            "event_snapshots": 0,
            "event_snapshots_refused": 0,
            "event_ring_dropped_batches": 0,
            "event_bytes": 0,
            "event_ring_batches": 0,
            "event_ring_bytes": 0,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tpcache-events-replay", daemon=True)
        self._thread.start()
        self.publish(Changes(cleared=True))  # batch 0: the cache starts empty

    def info(self) -> dict[str, Any]:
        """Where and what the stream is (the ready file and the start-up line show it)."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic.decode(),
            "digest_topic": wire.DIGEST_TOPIC,
            **self.identity,
        }

    # ------------------------------------------------------------------ the round thread

    def publish(self, changes: Changes) -> None:
        """Publish what one round changed (nothing when it changed nothing): at once, or with the
        next rounds' when the last batch is younger than ``batch_s``."""
        if changes:
            self.pending.append(changes)
        if self.pending and time.monotonic() - self.last_batch >= self.batch_s:
            self.flush()

    def tick(self, timeout_ms: int) -> int:
        """Send the pending rounds if their batch is due; returns ``timeout_ms`` or, with rounds
        pending, at most the milliseconds until their batch is due (the leader's poll timeout)."""
        if not self.pending:
            return timeout_ms
        left = self.batch_s - (time.monotonic() - self.last_batch)
        if left <= 0:
            self.flush()
            return timeout_ms
        return min(timeout_ms, int(left * 1000) + 1)

    def flush(self) -> None:
        """One batch of every pending round, in order: per round, cleared, removals, stores."""
        rounds, self.pending = self.pending, []
        self.last_batch = time.monotonic()
        events: list[bytes] = []
        enc = self.encoder
        stored_n = removed_n = 0
        # A drain lists a page as removed only from a tier it was on and as stored only on a tier it
        # was not on (``feed.py``): the mirror and the digest move in bulk, in C loops.
        pair_sum = wire.pair_sum
        with self.lock:
            mirror, digest = self.mirror, self.digest
            for changes in rounds:
                if changes.cleared:
                    for tier in mirror:
                        tier.clear()
                    digest = 0
                    events.append(enc.cleared)
                for tier, hashes in enumerate(changes.removed):
                    if hashes:
                        mirror[tier].difference_update(hashes)
                        digest -= pair_sum(hashes, tier)
                        events.append(enc.removed(hashes, tier))
                        removed_n += len(hashes)
                for tier, hashes in enumerate(changes.stored):
                    if hashes:
                        mirror[tier].update(hashes)
                        digest += pair_sum(hashes, tier)
                        events.append(enc.stored(hashes, tier))
                        stored_n += len(hashes)
            self.digest = digest & wire.MASK
            if not events:
                return
            self.seq += 1
            seq = self.seq
            payload = enc.batch(time.time(), events)
            self.ring.append((seq, payload))
            self.ring_bytes += len(payload)
            while len(self.ring) > self.replay_batches or (self.ring_bytes > self.replay_bytes and len(self.ring) > 1):
                self.ring_bytes -= len(self.ring.popleft()[1])
                self.counters["event_ring_dropped_batches"] += 1
            pages = sum(map(len, mirror))
            digest = self.digest
            ring_batches, ring_bytes = len(self.ring), self.ring_bytes
        c = self.counters
        c["event_batches"] += 1
        c["event_bytes"] += len(payload)
        c["event_ring_batches"], c["event_ring_bytes"] = ring_batches, ring_bytes
        c["event_pages_stored"] += stored_n
        c["event_pages_removed"] += removed_n
        seq8 = wire.seq_bytes(seq)
        send = self.pub.send  # copied frames (zero-copy wakes a GC thread per message)
        send(self.topic, _MORE)
        send(seq8, _MORE)
        send(payload)
        if seq % self.digest_every == 0:
            body = {"seq": seq, "digest": digest, "pages": pages, "group": self.identity}
            send(self.digest_topic, _MORE)
            send(seq8, _MORE)
            send(wire.pack(body))

    def close(self) -> None:
        if self.pending:
            self.flush()
        self._stop.set()
        # The replay thread owns its socket (a ZMQ socket is not thread-safe) and closes it on its
        # way out; it sees the stop within one poll, as a ROUTER's send never blocks.
        self._thread.join()
        self.pub.close(0)

    # ------------------------------------------------------------------ the replay thread

    def _serve(self) -> None:
        router = self.router
        try:
            while not self._stop.is_set():
                try:
                    if not router.poll(200):
                        continue
                    frames = router.recv_multipart(zmq.NOBLOCK)
                except zmq.ZMQError:
                    continue
                try:
                    self._answer(frames)
                except zmq.ZMQError as exc:  # a peer gone mid-answer: nothing to do for it
                    log.debug("event replay: %s", exc)
                except Exception:  # one bad request: answer the next ones
                    log.exception("event replay: a request could not be answered")
        finally:
            router.close(0)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"":
            return  # not a request of ours (a DEALER sends an empty delimiter, then one frame)
        client, request = frames[0], frames[2]
        send = self.router.send_multipart
        if request == wire.HELLO:
            with self.lock:
                seq, oldest = self.seq, self.ring[0][0] if self.ring else self.seq + 1
            send((client, b"", wire.HELLO, wire.seq_bytes(seq), wire.pack({**self.info(), "oldest": oldest})))
        elif request == wire.SNAPSHOT:
            self._snapshot(client)
        elif len(request) == 8:  # vLLM's replay request: the first sequence number wanted
            start = int.from_bytes(request, "big")
            with self.lock:
                batches = [(s, p) for s, p in self.ring if s >= start]
            self.counters["event_replays"] += 1
            for s, payload in batches:
                send((client, b"", self.topic, wire.seq_bytes(s), payload))
            send((client, b"", b"", wire.END_SEQ, b""))

    def _snapshot(self, client: bytes) -> None:
        send = self.router.send_multipart
        with self.lock:  # a batch boundary: the copy is the state after batch ``seq``
            seq, digest = self.seq, self.digest
            pages = sum(map(len, self.mirror))
            tiers = [list(t) for t in self.mirror] if pages <= self.snapshot_max_pages else None
        if tiers is None:
            self.counters["event_snapshots_refused"] += 1
            why = f"{pages} pages is more than events_snapshot_max_pages ({self.snapshot_max_pages})"
            send((client, b"", wire.REFUSED, wire.seq_bytes(seq), wire.pack({"reason": why})))
            return
        self.counters["event_snapshots"] += 1
        s8 = wire.seq_bytes(seq)
        for tier, hashes in enumerate(tiers):
            for start in range(0, len(hashes), SNAPSHOT_CHUNK):
                send((client, b"", wire.SNAPSHOT, s8, wire.pack([tier, hashes[start : start + SNAPSHOT_CHUNK]])))
        end = {"seq": seq, "digest": digest, "pages": pages, "group": self.identity}
        send((client, b"", wire.SNAPSHOT_END, s8, wire.pack(end)))


class RoundStream:
    """A core's change feed, published after every round: what rank 0 runs (the service's leader,
    or an embedding engine's rank 0 through ``TPCache.publish_events``)."""

    def __init__(self, publisher: EventPublisher, core: Any) -> None:
        self.publisher = publisher
        self.feed = ChangeFeed()
        self.closed = False  # the last batch told subscribers the cache is closed (all cleared)
        core.feed = self.feed

    def after_round(self, core: Any) -> None:
        """Publish what changed since the last round. A closed cache serves no hit: it is published
        as all cleared, and once it reopens (an agreed flush) as cleared plus what it then holds."""
        feed = self.feed
        if core.feed is not feed:  # the core was rebuilt: start its stream over from what it holds
            core.feed = feed
            feed.drain()
            self.publisher.publish(_everything(core))
            return
        changes = feed.drain()
        if core.closed:
            if not self.closed:
                self.closed = True
                self.publisher.publish(Changes(cleared=True))
            return
        if self.closed:
            self.closed = False
            if not changes.cleared:
                changes = _everything(core)
        self.publisher.publish(changes)

    def close(self) -> None:
        self.publisher.close()


def _everything(core: Any) -> Changes:
    tiers = core.tier_hashes()
    out = Changes(cleared=True)
    for tier, hashes in enumerate(tiers):
        out.stored[tier].extend(sorted(hashes))
    return out
