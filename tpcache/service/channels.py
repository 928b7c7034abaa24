"""The internal channel between ranks: ordered batches out from the leader, small answers back.

Topology: every follower binds a PULL socket and the leader connects one PUSH to each (batches
never drop: PUSH blocks rather than discards, and the leader cannot run ahead because every batch
ends in a round that needs every rank). The leader binds a PULL for answers (per-rank results of
gathered requests and stop requests) and every follower connects a PUSH to it. Endpoints, and the
group's channel key, are exchanged once over the torch.distributed group at startup.

Trust: every frame is ``tag || msgpack``, the tag an HMAC-SHA256 (cut to 16 bytes) of the payload
under a key derived, per direction, from one rank 0 draws at startup and hands to the other ranks
over the torch.distributed group (never a file, the environment or the rendezvous store, which a
local process could read); a batch can never pass as an answer or the other way round. A frame
whose tag does not verify, or whose content is not a message of the shape below within
``INTERNAL_LIMITS``, is dropped and counted (``rejected``): a foreign process that finds a port
can neither crash, stop nor steer a rank. One tag per frame: a batch of any number of requests
costs one MAC over its bytes.

Batch (leader -> followers):
    {"b": batch number (= the round it ends in, counted by the service),
     "s": sequence number of its first request, "n": number of requests,
     "e": [[kind, token, conn, data], ...] in apply order (``batch.Entry``), "x": true to stop}
Answer (follower -> leader): {"b": batch, "r": rank, "a": [[token, payload], ...]} or {"stop": rank}.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from protocol.codec import scan
from protocol.errors import ProtocolError
from protocol.limits import Limits
from tpcache.service.batch import ACTIVATE, EXPIRE, KINDS, REQUEST, Entry

log = logging.getLogger("tpcache.service")

TAG_BYTES = 16
KEY_BYTES = 32
MAX_BATCH_BYTES = 256 << 20  # the leader closes a batch before its client frames pass this
MAX_ANSWER_BYTES = 64 << 20  # a follower splits its answers to a batch into frames of at most this
MAX_INTERNAL_BYTES = MAX_BATCH_BYTES + (32 << 20)  # a frame any rank sends (batch entries plus framing)
INTERNAL_LIMITS = Limits(
    max_message_bytes=MAX_INTERNAL_BYTES,
    max_depth=6,
    max_objects=1 << 22,
    max_array_len=1 << 20,
    max_map_len=8192,
    max_str_len=4096,
    max_bin_len=MAX_INTERNAL_BYTES,
)
_BATCH, _UP = b"batch", b"answer"  # what each direction's key is derived for
_MAX_DROPS_PER_READ = 64  # foreign frames dropped in one read before the loop gets to do other work
_BATCH_KEYS = frozenset(("b", "s", "n", "e", "x"))
_ANSWER_KEYS = frozenset(("b", "r", "a"))
_PAYLOAD_KEYS = frozenset(("error", "message", "values", "data"))


class ForeignFrame(Exception):
    """A frame on the internal channel that no rank of this group sent (or a malformed one)."""


@dataclass(frozen=True, slots=True)
class Batch:
    number: int
    first_seq: int
    count: int
    entries: list[Entry]
    stop: bool


@dataclass(frozen=True, slots=True)
class Answers:
    batch: int
    rank: int
    answers: list[tuple[int, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Stop:
    rank: int


def _is_int(value: Any, lo: int = 0, hi: int = 2**63 - 1) -> bool:
    return type(value) is int and lo <= value <= hi


class Sealer:
    """Seals and opens internal frames under the group's key."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"the channel key must be {KEY_BYTES} bytes")
        self.keys = {d: hmac.digest(key, d, "sha256") for d in (_BATCH, _UP)}
        self.rejected = 0  # frames dropped: a bad tag or a malformed message

    def seal(self, direction: bytes, obj: Any) -> bytes:
        payload = msgpack.packb(obj, use_bin_type=True)
        return hmac.digest(self.keys[direction], payload, "sha256")[:TAG_BYTES] + payload

    def open(self, direction: bytes, frame: bytes) -> Any:
        """The message in ``frame``; raises ForeignFrame unless it was sealed with this key."""
        if len(frame) <= TAG_BYTES:
            raise ForeignFrame("a frame too short to carry a tag")
        view = memoryview(frame)
        expected = hmac.digest(self.keys[direction], view[TAG_BYTES:], "sha256")[:TAG_BYTES]
        if not hmac.compare_digest(expected, view[:TAG_BYTES]):
            raise ForeignFrame("a frame whose tag does not verify under the group's key")
        try:
            scan(view[TAG_BYTES:], INTERNAL_LIMITS)  # no rank sends one past these, so none is decoded
            return msgpack.unpackb(view[TAG_BYTES:], raw=False, strict_map_key=True)
        except (ProtocolError, ValueError) as exc:
            raise ForeignFrame(f"an unreadable message ({exc})") from None

    def open_batch(self, frame: bytes) -> Batch:
        return parse_batch(self.open(_BATCH, frame))

    def open_up(self, frame: bytes) -> Answers | Stop:
        return parse_up(self.open(_UP, frame))


def parse_batch(obj: Any) -> Batch:
    """A batch from its decoded map, every field checked; raises ForeignFrame."""
    if type(obj) is not dict or obj.keys() != _BATCH_KEYS:
        raise ForeignFrame("a batch must be a map of b, s, n, e, x")
    b, s, n, e, x = obj["b"], obj["s"], obj["n"], obj["e"], obj["x"]
    if not (_is_int(b) and _is_int(s, 1) and _is_int(n) and type(e) is list and type(x) is bool):
        raise ForeignFrame("a batch field has the wrong type")
    entries = []
    for raw in e:
        if type(raw) is not list or len(raw) != 4 or raw[0] not in KINDS or type(raw[0]) is not int:
            raise ForeignFrame("a batch entry must be [kind, token, conn, data]")
        kind, token, conn, data = raw
        if not (_is_int(token) and _is_int(conn)):
            raise ForeignFrame("a batch entry's token and conn must be ints")
        if kind == REQUEST and type(data) is not bytes:
            raise ForeignFrame("a request entry carries the client's frame as bin")
        if kind == ACTIVATE and type(data) is not bool:
            raise ForeignFrame("an activation entry carries a bool")
        if kind == EXPIRE and (type(data) is not list or not all(_is_int(v, 0, 2**64 - 1) for v in data)):
            raise ForeignFrame("an expiry entry carries a list of lease ids")
        entries.append(Entry(kind, token, conn, data))
    if sum(1 for entry in entries if entry.kind == REQUEST) != n:
        raise ForeignFrame("a batch's request count does not match its entries")
    return Batch(b, s, n, entries, x)


def parse_up(obj: Any) -> Answers | Stop:
    """An answer or a stop request from its decoded map; raises ForeignFrame."""
    if type(obj) is dict and obj.keys() == {"stop"} and _is_int(obj["stop"], 1):
        return Stop(obj["stop"])
    if type(obj) is not dict or obj.keys() != _ANSWER_KEYS:
        raise ForeignFrame("an answer must be a map of b, r, a (or a stop request)")
    b, r, a = obj["b"], obj["r"], obj["a"]
    if not (_is_int(b) and _is_int(r, 1) and type(a) is list):
        raise ForeignFrame("an answer field has the wrong type")
    answers = []
    for raw in a:
        if type(raw) is not list or len(raw) != 2 or not _is_int(raw[0]) or type(raw[1]) is not dict:
            raise ForeignFrame("an answer item must be [token, payload]")
        if not raw[1].keys() <= _PAYLOAD_KEYS:
            raise ForeignFrame("an answer payload has an unknown key")
        answers.append((raw[0], raw[1]))
    return Answers(b, r, answers)


class Channels:
    """One rank's internal sockets. Build with ``Channels.open`` (a collective call)."""

    def __init__(self, ctx: zmq.Context, rank: int, world: int, key: bytes) -> None:
        self.ctx = ctx
        self.rank = rank
        self.world = world
        self.sealer = Sealer(key)
        self.inbox: zmq.Socket | None = None  # follower: batches; leader: answers
        self.outs: list[zmq.Socket] = []  # leader: one PUSH per follower; follower: one to the leader
        self.pids: list[int] = []
        self.leader_local = False  # rank 0's pid names a process of this host (and pid namespace)

    @property
    def rejected(self) -> int:
        return self.sealer.rejected

    @classmethod
    def open(cls, ctx: zmq.Context, rank: int, world: int, host: str, group: Any = None) -> Channels:
        from tpcache.comm.exchange import all_gather_json

        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.setsockopt(zmq.RCVHWM, 1000)
        inbox.setsockopt(zmq.MAXMSGSIZE, MAX_INTERNAL_BYTES)
        port = inbox.bind_to_random_port(f"tcp://{host}")
        # The key travels over the group's own connections (the collective), not its store.
        mine = {"endpoint": f"tcp://{host}:{port}", "pid": os.getpid(), "key": secrets.token_hex(KEY_BYTES)}
        mine["where"] = _where()
        if rank:
            mine["key"] = ""
        peers = all_gather_json(mine, group)
        ch = cls(ctx, rank, world, bytes.fromhex(peers[0]["key"]))
        ch.inbox = inbox
        ch.pids = [int(p["pid"]) for p in peers]
        ch.leader_local = bool(mine["where"]) and peers[0].get("where") == mine["where"]
        targets = [p["endpoint"] for p in peers[1:]] if rank == 0 else [peers[0]["endpoint"]]
        for target in targets:
            out = ctx.socket(zmq.PUSH)
            out.setsockopt(zmq.LINGER, 500)  # let a stop batch leave; a dead peer must not hold the exit
            out.setsockopt(zmq.SNDHWM, 0)
            out.connect(target)
            ch.outs.append(out)
        return ch

    def broadcast(self, batch: dict[str, Any]) -> None:
        """Leader: the same batch to every follower, in order."""
        frame = self.sealer.seal(_BATCH, batch)
        for out in self.outs:
            out.send(frame, copy=len(frame) < 65536)

    def send_up(self, obj: dict[str, Any]) -> None:
        """Follower: an answer or a stop request to the leader (never blocks the round loop)."""
        try:
            self.outs[0].send(self.sealer.seal(_UP, obj), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("rank %d: the leader is not reading answers; one was dropped", self.rank)

    def receive_batch(self) -> Batch | None:
        """Follower: the next batch waiting, or None (nothing waiting, or a foreign frame dropped)."""
        return self._receive(self.sealer.open_batch)

    def receive_up(self) -> Answers | Stop | None:
        """Leader: the next answer or stop request waiting, or None (see ``receive_batch``)."""
        return self._receive(self.sealer.open_up)

    def _receive(self, open_frame: Any) -> Any:
        assert self.inbox is not None
        for _ in range(_MAX_DROPS_PER_READ):
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                return open_frame(frame)
            except ForeignFrame as exc:
                self.sealer.rejected += 1
                n = self.sealer.rejected
                if n <= 10 or n % 1000 == 0:
                    log.warning("rank %d: dropped a frame on the internal channel: %s (%d so far)", self.rank, exc, n)
        return None

    def close(self) -> None:
        for sock in [*self.outs, self.inbox]:
            if sock is not None:
                sock.close()
        self.outs = []
        self.inbox = None


def _where() -> str:
    """This host's boot and this process's pid namespace: two ranks with the same one can watch
    each other's pids ('' when unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""
