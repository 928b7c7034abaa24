"""The reference subscriber: a router's mirror of what one or more tpcache groups hold, per tier.

    sub = Subscriber()
    group = sub.follow("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    sub.poll(0.1)                            # read what arrived; fill gaps; check digests
    group.leading_pages(token_ids)           # {"device": 3, "host": 5, "storage": 5, "any": 5}

Each followed group keeps its own mirror (a set of page hashes per tier) and the sequence number
of the last batch applied. A batch applies only right after the one before: a gap is filled from
the group's replay endpoint; a gap older than its replay window (or a digest that disagrees, or a
new incarnation of the group) is closed by a snapshot, which replaces the mirror with the state
after the snapshot's batch. Every digest the group publishes is checked against the mirror once
the mirror reaches the digest's batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from tpcache.core.hashing import TokenIds, as_token_bytes, hash_chain
from tpcache.events import wire

log = logging.getLogger("tpcache.events")

REQUEST_TIMEOUT_MS = 5_000
IDLE_CHECK_S = 1.0  # a group silent this long is asked where its stream is (a lost last batch shows no gap)


class ReplayError(RuntimeError):
    """The group's replay endpoint did not answer, or refused."""


@dataclass
class Group:
    """One group's mirror, as its stream left it after batch ``seq``."""

    events_endpoint: str
    replay_endpoint: str
    identity: dict[str, Any] = field(default_factory=dict)
    tiers: tuple[set[int], set[int], set[int]] = field(default_factory=lambda: (set(), set(), set()))
    seq: int = -1  # the last batch applied; -1: none
    digest: int = 0  # of ``tiers`` (``wire``)
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("batches", "gaps", "replayed", "resyncs", "digests_checked", "digest_mismatches", "incarnations"), 0
        )
    )
    pending_digests: dict[int, int] = field(default_factory=dict)  # seq -> digest, for batches not yet applied
    sub: Any = None
    dealer: Any = None
    heard: float = 0.0  # when the stream last said something (monotonic seconds)

    @property
    def incarnation(self) -> int | None:
        return self.identity.get("incarnation")

    def leading_pages(self, token_ids: TokenIds) -> dict[str, int]:
        """Per tier, how many leading full pages of ``token_ids`` the group holds there, and
        ``any``: how many leading pages it holds on some tier (what a lock would find)."""
        page_size, namespace = int(self.identity["page_size"]), str(self.identity["namespace"])
        hashes = hash_chain(as_token_bytes(token_ids), page_size, namespace)
        out: dict[str, int] = {}
        for name, tier in zip(wire.TIERS, self.tiers, strict=True):
            n = 0
            while n < len(hashes) and hashes[n] in tier:
                n += 1
            out[name] = n
        dev, host, store = self.tiers
        n = 0
        while n < len(hashes) and (hashes[n] in dev or hashes[n] in host or hashes[n] in store):
            n += 1
        out["any"] = n
        return out

    def pages(self) -> set[tuple[int, int]]:
        """The mirror as a set of (page hash, tier)."""
        return {(h, t) for t, hashes in enumerate(self.tiers) for h in hashes}

    # ------------------------------------------------------------------ applying

    def _reset(self) -> None:
        for tier in self.tiers:
            tier.clear()
        self.digest = 0

    def _apply(self, events: list[dict[str, Any]]) -> None:
        pair_sum, tiers = wire.pair_sum, self.tiers
        digest = self.digest
        for ev in events:
            kind = ev.get("type")
            if kind == "AllBlocksCleared":
                self._reset()
                digest = 0
                continue
            tier = wire.TIER_OF_MEDIUM.get(ev.get("medium"), 0)
            have = tiers[tier]
            if kind == "BlockStored":
                new = [h for h in dict.fromkeys(ev["block_hashes"]) if h not in have]
                have.update(new)
                digest += pair_sum(new, tier)
            elif kind == "BlockRemoved":
                gone = [h for h in dict.fromkeys(ev["block_hashes"]) if h in have]
                have.difference_update(gone)
                digest -= pair_sum(gone, tier)
        self.digest = digest & wire.MASK


class Subscriber:
    """Follows groups (``follow``) and keeps each one's mirror (``Group``)."""

    def __init__(self, ctx: zmq.Context | None = None, topic: str = "kv-events", rcvhwm: int = 100_000) -> None:
        """``rcvhwm``: messages ZMQ holds for this subscriber before it drops (a gap, filled by replay)."""
        self.ctx = ctx or zmq.Context.instance()
        self.rcvhwm = rcvhwm
        self.topic = topic.encode()
        self.groups: list[Group] = []
        self.poller = zmq.Poller()

    def follow(self, events_endpoint: str, replay_endpoint: str, resume: Group | None = None) -> Group:
        """Subscribe to a group's stream and bring its mirror up to date: from ``resume`` (a mirror
        kept from before, say by a router that restarted) when the group is still that incarnation,
        else from nothing; by replay while the group's ring holds the batches it lacks, else by a
        snapshot."""
        g = Group(events_endpoint, replay_endpoint)
        g.sub = self.ctx.socket(zmq.SUB)
        g.sub.setsockopt(zmq.LINGER, 0)
        g.sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        g.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        g.sub.setsockopt(zmq.SUBSCRIBE, wire.DIGEST_TOPIC.encode())
        g.sub.connect(events_endpoint)
        self._connect_dealer(g)
        self._hello(g)
        if resume is not None and resume.incarnation == g.incarnation:
            g.tiers = tuple(set(t) for t in resume.tiers)  # type: ignore[assignment]
            g.seq, g.digest = resume.seq, resume.digest
        self.groups.append(g)
        self.poller.register(g.sub, zmq.POLLIN)
        self._catch_up(g, g.seq + 1)
        return g

    def close(self) -> None:
        for g in self.groups:
            self.poller.unregister(g.sub)
            g.sub.close(0)
            g.dealer.close(0)
        self.groups = []

    def poll(self, timeout_s: float = 0.0) -> int:
        """Read everything that arrived (waiting up to ``timeout_s`` for the first message);
        returns the messages read."""
        n = 0
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        now = time.monotonic()
        for g in self.groups:
            if g.sub not in ready:
                if now - g.heard >= IDLE_CHECK_S:
                    g.heard = now
                    self._check_idle(g)
                continue
            g.heard = now
            while True:
                try:
                    topic, seq8, payload = g.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                n += 1
                self._on_message(g, topic, wire.seq_of(seq8), payload)
        return n

    # ------------------------------------------------------------------ the stream

    def _on_message(self, g: Group, topic: bytes, seq: int, payload: bytes) -> None:
        if topic == wire.DIGEST_TOPIC.encode():
            body = wire.unpack(payload)
            if body["group"].get("incarnation") != g.incarnation:
                self._new_incarnation(g)
                return
            self._on_digest(g, int(body["seq"]), int(body["digest"]))
            return
        if topic != self.topic:
            return
        if seq <= g.seq:  # an incarnation counts from 0 without repeating itself: the group restarted
            if seq == 0 or not self._same_incarnation(g):
                self._new_incarnation(g)
            return
        if seq > g.seq + 1:
            g.counters["gaps"] += 1
            self._catch_up(g, g.seq + 1)
            if seq <= g.seq:
                return
            if seq != g.seq + 1:
                self._resync(g)
                return
        g._apply(wire.decode_batch(payload))
        g.seq = seq
        g.counters["batches"] += 1
        self._check_pending(g)

    def _check_idle(self, g: Group) -> None:
        before = g.incarnation
        self._request(g, wire.HELLO)
        _, seq8, body = self._recv(g)
        if wire.unpack(body)["incarnation"] != before:
            self._new_incarnation(g)
        elif wire.seq_of(seq8) > g.seq:
            g.counters["gaps"] += 1
            self._catch_up(g, g.seq + 1)

    def _on_digest(self, g: Group, seq: int, digest: int) -> None:
        if seq > g.seq:
            g.pending_digests[seq] = digest
            return
        if seq == g.seq:
            self._check(g, digest)

    def _check_pending(self, g: Group) -> None:
        if g.pending_digests:
            digest = g.pending_digests.pop(g.seq, None)
            for old in [s for s in g.pending_digests if s < g.seq]:
                del g.pending_digests[old]
            if digest is not None:
                self._check(g, digest)

    def _check(self, g: Group, digest: int) -> None:
        g.counters["digests_checked"] += 1
        if digest != g.digest:
            g.counters["digest_mismatches"] += 1
            log.warning("group %s: the mirror's digest differs at batch %d: resynchronising", g.events_endpoint, g.seq)
            self._resync(g)

    # ------------------------------------------------------------------ the replay endpoint

    def _connect_dealer(self, g: Group) -> None:
        if g.dealer is not None:
            g.dealer.close(0)
        g.dealer = self.ctx.socket(zmq.DEALER)
        g.dealer.setsockopt(zmq.LINGER, 0)
        g.dealer.setsockopt(zmq.RCVHWM, 0)
        g.dealer.connect(g.replay_endpoint)

    def _request(self, g: Group, request: bytes) -> None:
        g.dealer.send_multipart((b"", request))

    def _recv(self, g: Group) -> list[bytes]:
        if not g.dealer.poll(REQUEST_TIMEOUT_MS):
            self._connect_dealer(g)  # a half-answered request must not feed the next one
            raise ReplayError(f"the replay endpoint {g.replay_endpoint} did not answer")
        return g.dealer.recv_multipart()[1:]

    def _hello(self, g: Group) -> int:
        self._request(g, wire.HELLO)
        _, seq8, body = self._recv(g)
        info = wire.unpack(body)
        g.identity = {k: info[k] for k in ("model", "namespace", "incarnation", "tp_size", "pp_size", "page_size")}
        return int(info["oldest"])

    def _same_incarnation(self, g: Group) -> bool:
        before = g.incarnation
        self._hello(g)
        return g.incarnation == before

    def _new_incarnation(self, g: Group) -> None:
        g.counters["incarnations"] += 1
        self._hello(g)
        g._reset()
        g.seq = -1
        g.pending_digests.clear()
        self._catch_up(g, 0)

    def _catch_up(self, g: Group, start: int) -> None:
        """Apply batches ``start``... from the replay ring; a snapshot where the ring lost some."""
        self._request(g, wire.seq_bytes(start))
        replayed: list[tuple[int, bytes]] = []
        while True:
            frames = self._recv(g)
            seq = wire.seq_of(frames[1])
            if seq < 0:  # vLLM's end marker
                break
            replayed.append((seq, frames[2]))
        if replayed and replayed[0][0] > g.seq + 1:
            self._resync(g)
            replayed = [(s, p) for s, p in replayed if s > g.seq]
        for seq, payload in replayed:
            if seq != g.seq + 1:
                continue
            g._apply(wire.decode_batch(payload))
            g.seq = seq
            g.counters["replayed"] += 1
            self._check_pending(g)

    def _resync(self, g: Group) -> None:
        """Replace the mirror with a snapshot (the state after the snapshot's batch)."""
        g.counters["resyncs"] += 1
        self._request(g, wire.SNAPSHOT)
        tiers: tuple[set[int], set[int], set[int]] = (set(), set(), set())
        while True:
            kind, seq8, body = self._recv(g)
            if kind == wire.REFUSED:
                raise ReplayError(f"group {g.events_endpoint}: snapshot refused: {wire.unpack(body)['reason']}")
            if kind == wire.SNAPSHOT_END:
                end = wire.unpack(body)
                break
            tier, hashes = wire.unpack(body)
            tiers[tier].update(hashes)
        if end["group"].get("incarnation") != g.incarnation:
            g.identity = dict(end["group"])
        g.tiers = tiers
        g.digest = wire.digest_of(tiers)
        g.seq = int(end["seq"])
        g.pending_digests = {s: d for s, d in g.pending_digests.items() if s > g.seq}
        if g.digest != int(end["digest"]):
            raise ReplayError(f"group {g.events_endpoint}: a snapshot that does not match its own digest")
