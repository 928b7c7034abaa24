"""Rank 0's client endpoint: connections, what each may hold, and bounded replies.

A connection is one transport connection (one TCP or IPC stream), never a ZMQ routing id: a
routing id is chosen by the client and can be reused by another connection once the first one is
gone. libzmq names each connection for us: the endpoint sets a ZAP domain, and the ZAP handler
here (answered on the leader's own thread) gives every new connection a fresh number as its
User-Id, which libzmq then attaches to every message that connection sends. Authentication
(``hello`` with the secret), requests in flight and leases belong to that number.

A connection is gone when the socket monitor reports its file descriptor disconnected (the
descriptor is learnt from the connection's first message), or when a later connection speaks
with its routing id (libzmq refuses a second connection with a routing id in use, so the first
must have left). The monitor is drained before every ZAP answer, so a connection that takes over
a gone one's routing id is never attached before the old one is known gone, and no reply meant
for the old one can reach it.

Memory per connection is bounded: envelope frames (everything before the request frame) beyond
``MAX_ENVELOPE_FRAMES`` or ``MAX_ENVELOPE_BYTES`` are refused, not echoed; requests whose replies
would carry more than ``MAX_REPLY_BYTES_IN_FLIGHT`` at once (inline pages) are OVERLOADED; replies
to a client that does not read wait in the socket (at most ``REPLY_HWM`` of them, and of those
past ``SMALL_REPLY`` bytes at most ``MAX_SOCKET_REPLY_BYTES`` until the connection's kernel send
queue is seen drained) and then here (at most ``MAX_QUEUED_REPLY_BYTES``); past that they are
dropped and counted. A client that does not read its replies loses them, never the server's
memory.

Memory over all connections is bounded too: the reply bytes rank 0 holds for every connection
together (queued here, put in a socket and not yet seen read, or reserved for a large reply being
built) stay within ``max_unread_bytes``. A large reply that would pass it is refused OVERLOADED
before any rank builds it, and the connection holding the most unread bytes is dropped (its socket
shut down, which makes libzmq free what it queued for it); a small reply past it is dropped. Once a
dropped connection's buffers are freed, the allocator is asked to return them to the OS
(``malloc_trim``), so that repeated episodes do not ratchet the process's resident memory up.

Connections past ``max_connections`` are refused: each request on one is answered OVERLOADED naming
the setting, and its socket is shut down shortly after; past twice the cap a connection is refused
at its handshake (the ZAP answer), so that it holds no descriptor at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import gc
import logging
import os
import resource
import socket
import struct
import termios
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import zmq

import protocol as p

log = logging.getLogger("tpcache.service")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
MAX_ENVELOPE_FRAMES = 2  # after the routing id: a REQ's empty delimiter, or one DEALER frame
MAX_ENVELOPE_BYTES = 256
REPLY_HWM = 1024  # replies ZMQ holds for one connection before rank 0 queues them itself
SMALL_REPLY = 4096  # replies below this count only against REPLY_HWM in the socket
MAX_SOCKET_REPLY_BYTES = 8 << 20  # larger ones: at most this many bytes in one connection's socket
MAX_QUEUED_REPLY_BYTES = 8 << 20  # per connection, counting each reply's bookkeeping as well as its bytes
MAX_REPLY_BYTES_IN_FLIGHT = 16 << 20  # per connection: large replies (inline pages) not yet sent
_QUEUED_OVERHEAD = 128
MAX_CONNECTIONS = 65_536  # connections remembered at once; the oldest idle ones are forgotten
REFUSED_CLOSE_S = 0.5  # a refused connection's socket is shut down this long after its refusal ...
REFUSED_CLOSE_MAX_S = 2.0  # ... once its kernel queue is empty, or after this long at the latest
AUTO_UNREAD_FRACTION = 16  # max_unread_bytes 0: this fraction of the host's memory ...
AUTO_UNREAD_CAP = 256 << 20  # ... at most this much
TRIM_AFTER_S = 0.5  # the allocator is trimmed this long after a large holder left (libzmq frees late)
RECOUNT_S = 0.25  # how often replies put in the sockets are looked at again (read by now?)
WARN_EVERY_S = 10.0  # a repeated warning (refused or dropped connections) at most this often
MAX_DEPARTED = 4096  # gone connections remembered for the frames they sent before leaving
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_MONITOR_EVENTS = int(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
_SRCFD = getattr(zmq, "SRCFD", None)  # libzmq's message property: the descriptor it came from


@dataclass(eq=False)
class Conn:
    """One client connection."""

    id: int  # the number the ZAP handler gave it; unique for the life of the process
    identity: bytes  # its routing id, where replies go
    server: p.ServerConnection
    fd: int = -1  # its socket, from its first message (-1: unknown)
    authed: bool = False
    gone: bool = False
    queue: deque[tuple[list[bytes], bytes]] = field(default_factory=deque)  # replies waiting for the socket
    queued_bytes: int = 0
    socket_bytes: int = 0  # large replies put in the socket since its kernel queue was last seen drained
    reply_bytes: int = 0  # what the replies to its requests in flight will carry (large ones only)
    sent_bytes: int = 0  # reply bytes put in the socket since its kernel queue was last seen drained
    refused: str = ""  # why every request on it is refused (over max_connections)

    @property
    def unread(self) -> int:
        """Reply bytes rank 0 holds for it: queued here, or in its socket and not seen read."""
        return self.queued_bytes + self.sent_bytes


class Message:
    """A client frame from a live connection, with what it takes to answer it. ``raw`` is the
    transport's own frame (a buffer: the hot lookup reads its tokens straight out of it); ``frame``
    its bytes, copied on first use."""

    __slots__ = ("conn", "envelope", "raw", "_frame")

    def __init__(self, conn: Conn, envelope: list[bytes], raw: Any) -> None:
        self.conn = conn
        self.envelope = envelope  # the routing id, then the client's own envelope frames (echoed back)
        self.raw = raw
        self._frame: bytes | None = raw if type(raw) is bytes else None

    @property
    def frame(self) -> bytes:
        frame = self._frame
        if frame is None:
            frame = self._frame = self.raw.bytes
        return frame


class FrontDoor:
    """The ROUTER socket and everything known about the connections behind it."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        max_pending: int,
        max_unread_bytes: int = AUTO_UNREAD_CAP,
        max_connections: int = 1024,
    ) -> None:
        self.max_pending = max_pending
        self.max_unread_bytes = max_unread_bytes
        self.max_connections = max_connections
        _raise_descriptor_limit(max_connections)
        _map_large_buffers()
        # The ZAP handler must be bound before the first connection arrives.
        self.zap = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, p.DEFAULT_LIMITS.max_message_bytes + 1024)
        self.router.setsockopt(zmq.RCVHWM, 4096)
        self.router.setsockopt(zmq.SNDHWM, REPLY_HWM)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished peer is an error, not silence
        self.router.setsockopt(zmq.ZAP_DOMAIN, b"tpcache")
        self.monitor = self.router.get_monitor_socket(_MONITOR_EVENTS)
        # pyzmq's Socket.send is a Python wrapper (draft routing ids and groups) over its compiled
        # send, which sends bytes the same way: replies take the compiled one, at half the cost.
        self._send = super(zmq.Socket, self.router).send
        self.endpoint = self._bind(endpoint)
        self.conns: OrderedDict[int, Conn] = OrderedDict()  # by id, least recently heard first
        self.by_identity: dict[bytes, Conn] = {}
        self.by_fd: dict[int, Conn] = {}
        self.open_fds: set[int] = set()  # descriptors accepted and not yet reported disconnected
        self.backlogged: dict[int, Conn] = {}  # connections with replies queued here
        self.departed: OrderedDict[int, Conn] = OrderedDict()  # recently gone, for frames read after
        self.gone: list[Conn] = []  # connections found gone since the leader last looked
        self.next_conn = 1
        self.held = 0  # reply bytes held for every connection: sum of unread + reply_bytes
        self.holders: dict[int, Conn] = {}  # connections holding reply bytes, by id
        self.over_cap: dict[int, str] = {}  # connection numbers given past max_connections -> why
        self.closing: dict[int, tuple[Conn, float]] = {}  # refused or dropped: shut down at this time
        self.trim_at = 0.0  # when to return freed memory to the OS (0: not due)
        self.peak = 0  # the most ``held`` since memory was last returned
        self.recount_at = 0.0  # when to look which connections read what was sent to them
        self._warned: dict[str, float] = {}
        self.counters = {
            "requests_received": 0,
            "refused_envelopes": 0,
            "dropped_replies": 0,
            "connections": 0,
            "refused_connections": 0,
            "dropped_connections": 0,
            "refused_replies": 0,
        }

    def _bind(self, endpoint: str) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = self.router.bind_to_random_port(endpoint[: endpoint.rindex(":")])
            return f"{endpoint[: endpoint.rindex(':')]}:{port}"
        self.router.bind(endpoint)
        return str(self.router.getsockopt(zmq.LAST_ENDPOINT).decode())

    def sockets(self) -> list[zmq.Socket]:
        """What the leader polls for input."""
        return [self.router, self.zap, self.monitor]

    # ------------------------------------------------------------------ connection lifecycle

    def answer_zap(self) -> None:
        """Name every connection waiting for its handshake."""
        while True:
            try:
                request = self.zap.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            self.read_monitor()  # a connection gone before this one came is known gone first
            request_id = request[1] if len(request) > 1 else b""
            conn_id = self.next_conn
            self.next_conn += 1
            open_now = len(self.open_fds)
            if open_now > self.max_connections:
                why = (
                    f"the server already has {open_now - 1} client connections, its limit: max_connections = "
                    f"{self.max_connections}; close idle connections (or raise the limit), then reconnect"
                )
                self.counters["refused_connections"] += 1
                self._warn("refused", f"refusing client connections: {why}")
                if open_now > 2 * self.max_connections:  # refused at the handshake: no descriptor kept
                    self.zap.send_multipart([b"1.0", request_id, b"400", why[:250].encode(), b"", b""])
                    continue
                self.over_cap[conn_id] = why
                while len(self.over_cap) > MAX_DEPARTED:
                    del self.over_cap[next(iter(self.over_cap))]
            self.zap.send_multipart([b"1.0", request_id, b"200", b"OK", str(conn_id).encode(), b""])

    def read_monitor(self) -> None:
        while True:
            try:
                parts = self.monitor.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            if len(parts) < 2 or len(parts[0]) < 6:
                continue
            event, fd = struct.unpack("=Hi", parts[0][:6])
            if event == zmq.EVENT_ACCEPTED:
                self.open_fds.add(fd)
            else:
                self.open_fds.discard(fd)
            conn = self.by_fd.pop(fd, None)
            if conn is not None:  # disconnected, or a new connection on a descriptor it had held
                self._lose(conn)

    def _lose(self, conn: Conn) -> None:
        if conn.gone:
            return
        conn.gone = True
        self.gone.append(conn)
        self.conns.pop(conn.id, None)
        self.departed[conn.id] = conn
        while len(self.departed) > MAX_DEPARTED:
            self.departed.popitem(last=False)
        if self.by_identity.get(conn.identity) is conn:
            del self.by_identity[conn.identity]
        if self.by_fd.get(conn.fd) is conn:
            del self.by_fd[conn.fd]
        self.counters["dropped_replies"] += len(conn.queue)
        if conn.unread >= 1 << 20:  # libzmq frees what it held for the connection soon: trim then
            self.trim_at = time.monotonic() + TRIM_AFTER_S
        conn.queue.clear()
        self._set_unread(conn, 0, 0)
        self.backlogged.pop(conn.id, None)

    def take_gone(self) -> list[Conn]:
        """Connections found gone since the last call (their leases are the leader's to expire)."""
        gone, self.gone = self.gone, []
        return gone

    # ------------------------------------------------------------------ requests in

    def receive(self) -> Message | None:
        """The next client message, or None when none is waiting. Messages that cannot be
        answered (no request frame, a connection libzmq did not name) are dropped; an envelope
        past the limits gets an error reply without it."""
        recv = self.router.recv
        while True:
            try:
                # The routing id, which the ROUTER prepends to every message with the more flag set
                # (libzmq's router_t), so it is read as bytes: a Frame costs more than the copy.
                identity = recv(_NOBLOCK)
            except zmq.Again:
                return None
            try:
                part = recv(_NOBLOCK, copy=False)  # (never waits: a message arrives whole)
            except zmq.Again:
                continue  # a routing id alone: nothing to answer
            parts: list[zmq.Frame] = [part]
            while part.more:
                part = recv(copy=False)
                parts.append(part)
            try:
                # libzmq gives every frame of a message its connection's properties (the ROUTER
                # copies them onto the routing id): the request frame's are read.
                conn_id = int(part.get(b"User-Id"))
            except (ValueError, TypeError, zmq.ZMQError):
                continue  # not named by our ZAP handler: cannot be told apart from another connection
            conn = self.conns.get(conn_id)
            if conn is not None:  # a live connection: every request but a connection's first
                self.conns.move_to_end(conn_id)
            elif (conn := self._arriving(conn_id, identity, part)) is None:
                continue
            self.counters["requests_received"] += 1
            # A frame of a connection that is gone by now still counts (it was sent before the
            # connection closed, as TCP delivers it); only its reply has nowhere to go.
            if len(parts) == 1:  # a DEALER's request: the routing id is all the envelope
                return Message(conn, [identity], part)
            envelope = parts[:-1]
            if len(envelope) > MAX_ENVELOPE_FRAMES or sum(map(len, envelope)) > MAX_ENVELOPE_BYTES:
                self.counters["refused_envelopes"] += 1
                error = p.MessageTooLarge(
                    f"at most {MAX_ENVELOPE_FRAMES} envelope frames of {MAX_ENVELOPE_BYTES} bytes in all may "
                    "precede a request frame"
                )
                self.send(conn, [identity], conn.server.reject(error))
                continue
            return Message(conn, [identity, *(f.bytes for f in envelope)], part)

    def _arriving(self, conn_id: int, identity: bytes, frame: zmq.Frame) -> Conn | None:
        """The connection of a frame whose number is not a live connection's: a departed one, a new
        one (registered here), or None for a number this process never handed out."""
        conn = self.departed.get(conn_id)
        if conn is not None:
            return conn
        if conn_id >= self.next_conn:
            return None  # a number this process never handed out
        previous = self.by_identity.get(identity)
        if previous is not None:  # libzmq lets one connection hold a routing id at a time
            self._lose(previous)
        conn = Conn(conn_id, identity, p.ServerConnection(max_pending=self.max_pending))
        conn.refused = self.over_cap.pop(conn_id, "")
        if _SRCFD is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.read_monitor()  # events up to this connection's accept are in by now
                conn.fd = int(frame.get(_SRCFD))
                holder = self.by_fd.get(conn.fd)
                if holder is not None:  # a descriptor is one live connection's: the old one left
                    self._lose(holder)
                self.by_fd[conn.fd] = conn
        self.conns[conn_id] = conn
        self.by_identity[identity] = conn
        self.counters["connections"] += 1
        if conn.fd >= 0 and conn.fd not in self.open_fds:
            self._lose(conn)  # reported disconnected before its first frame was read
        while len(self.conns) > MAX_CONNECTIONS:
            oldest = next(iter(self.conns.values()))
            self._lose(oldest)
        return conn

    # ------------------------------------------------------------------ replies out

    def send(self, conn: Conn, envelope: list[bytes], frame: bytes) -> bool:
        """Send (or queue) a reply; False when it was dropped (gone, or over the bounds)."""
        if conn.gone:
            return False
        if conn.queue or not self._try_send(conn, envelope, frame):
            return self._hold(conn, envelope, frame)
        return True

    def send_all(self, replies: list[tuple[Conn, list[bytes], bytes]]) -> None:
        """``send`` of each reply, in order. Sent back to back, they reach the I/O thread together,
        and it writes them to each client in few system calls instead of waking for each."""
        try_send = self._try_send
        for conn, envelope, frame in replies:
            if not conn.gone and (conn.queue or not try_send(conn, envelope, frame)):
                self._hold(conn, envelope, frame)

    def _hold(self, conn: Conn, envelope: list[bytes], frame: bytes) -> bool:
        """Queue a reply the socket did not take; False when it was dropped (gone, over the bound)."""
        if conn.gone:
            return False
        cost = len(frame) + _QUEUED_OVERHEAD
        if conn.queued_bytes + cost > MAX_QUEUED_REPLY_BYTES or not self._room(cost, conn):
            self.counters["dropped_replies"] += 1
            return False
        conn.queue.append((envelope, frame))
        self._set_unread(conn, conn.queued_bytes + cost, conn.sent_bytes)
        self.backlogged[conn.id] = conn
        return True

    def _try_send(self, conn: Conn, envelope: list[bytes], frame: bytes) -> bool:
        """One reply into the socket; False when the connection's socket queue is full (in replies,
        or, for a large reply, in bytes the kernel has not yet handed to the client)."""
        size = len(frame)
        if size >= SMALL_REPLY:
            if conn.socket_bytes + size > MAX_SOCKET_REPLY_BYTES and not self._drained(conn):
                return False
            conn.socket_bytes += size
        send = self._send
        try:
            for part in envelope:
                send(part, _MORE_NOBLOCK)  # ROUTER_MANDATORY: a full peer refuses at the routing id
            send(frame, _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError:  # EHOSTUNREACH: the peer left
            self._lose(conn)
            return False
        conn.sent_bytes += size
        self.held += size
        if conn.sent_bytes == size:
            self.holders[conn.id] = conn
        return True

    def _drained(self, conn: Conn) -> bool:
        """Whether the connection's kernel send queue is nearly empty: the client reads, so what
        rank 0 put in the socket before has left it. Resets the count of large reply bytes."""
        try:
            unsent = struct.unpack("i", fcntl.ioctl(conn.fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError):  # no descriptor known (or not a socket): nothing to go by
            unsent = 0
        if unsent >= SMALL_REPLY * 16:
            return False
        conn.socket_bytes = 0
        if conn.sent_bytes:
            self._set_unread(conn, conn.queued_bytes, 0)
        return True

    def flush(self) -> None:
        """Move queued replies into the socket as far as each connection's queue there allows."""
        for conn in list(self.backlogged.values()):
            while conn.queue:
                envelope, frame = conn.queue[0]
                if not self._try_send(conn, envelope, frame):
                    break
                conn.queue.popleft()
                self._set_unread(conn, conn.queued_bytes - len(frame) - _QUEUED_OVERHEAD, conn.sent_bytes)
            if not conn.queue:
                self.backlogged.pop(conn.id, None)
        if self.closing or self.trim_at or (self.holders or self.peak) and time.monotonic() >= self.recount_at:
            self._housekeeping()

    # ------------------------------------------------------------------ memory over all connections

    def _set_unread(self, conn: Conn, queued: int, sent: int) -> None:
        """Change what ``conn`` holds (queued here, sent and not seen read), keeping ``held`` the sum."""
        self.held += queued + sent - conn.queued_bytes - conn.sent_bytes
        conn.queued_bytes, conn.sent_bytes = queued, sent
        if conn.unread or conn.reply_bytes:
            self.holders[conn.id] = conn
        else:
            self.holders.pop(conn.id, None)

    def reserve(self, conn: Conn, size: int) -> None:
        """Count a large reply (``size`` bytes) against its connection and against every
        connection's together before it is built; raises Overloaded past either bound."""
        if conn.reply_bytes + size > MAX_REPLY_BYTES_IN_FLIGHT:
            raise p.Overloaded(
                f"this connection's replies in flight would carry {conn.reply_bytes + size} bytes, more than "
                f"{MAX_REPLY_BYTES_IN_FLIGHT}; read them, then retry"
            )
        if not self._room(size, conn):
            self.counters["refused_replies"] += 1
            raise p.Overloaded(
                f"the server holds {self.held} bytes of replies that clients have not read, and this reply "
                f"({size} bytes) would pass max_unread_reply_bytes = {self.max_unread_bytes}; read replies, then retry"
            )
        conn.reply_bytes += size
        self.held += size
        self.holders[conn.id] = conn

    def unreserve(self, conn: Conn, size: int) -> None:
        """A reserved reply is built (about to be sent) or abandoned."""
        if size:
            conn.reply_bytes -= size
            self.held -= size
            if not conn.unread and not conn.reply_bytes:
                self.holders.pop(conn.id, None)

    def _room(self, size: int, conn: Conn) -> bool:
        """Whether ``size`` more bytes fit under ``max_unread_bytes``. Past it, what clients read
        since is counted first; then the connection holding the most unread bytes is dropped (once
        per call; False still: the memory it frees is freed when libzmq closes it)."""
        if self.held + size <= self.max_unread_bytes:
            return True
        for holder in list(self.holders.values()):
            if holder.sent_bytes:
                self._drained(holder)
        if self.held + size <= self.max_unread_bytes:
            return True
        worst = max(self.holders.values(), key=lambda c: (c.unread, -c.id), default=None)
        if worst is not None and worst.unread:
            self._drop(worst)
        return False

    def _drop(self, conn: Conn) -> None:
        """Close a connection that leaves its replies unread (every connection's memory is at stake)."""
        self.counters["dropped_connections"] += 1
        self._warn(
            "dropped",
            f"dropped client connection {conn.id}: it left {conn.unread} bytes of replies unread while all "
            f"connections together held {self.held}, more than max_unread_reply_bytes = {self.max_unread_bytes}",
        )
        self._shutdown(conn)
        self._lose(conn)

    def _shutdown(self, conn: Conn) -> None:
        """Shut the connection's socket down: libzmq sees it closed, frees its queue and closes it
        (the descriptor stays libzmq's, so it cannot be reused under it)."""
        if conn.fd < 0 or conn.fd not in self.open_fds:
            return
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(conn.fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()

    def refuse(self, conn: Conn) -> None:
        """``conn`` is past max_connections: it was answered why; shut it down soon."""
        if conn.id not in self.closing:
            self.closing[conn.id] = (conn, time.monotonic())

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now >= self.recount_at:  # what clients read since is no longer held for them
            self.recount_at = now + RECOUNT_S
            for holder in list(self.holders.values()):
                if holder.sent_bytes:
                    self._drained(holder)
        for conn_id, (conn, since) in list(self.closing.items()):
            late = now - since
            if late >= REFUSED_CLOSE_MAX_S or late >= REFUSED_CLOSE_S and not conn.queue and self._drained(conn):
                del self.closing[conn_id]
                self._shutdown(conn)
                self._lose(conn)
        if self.held > self.peak:
            self.peak = self.held
        elif self.peak >= 4 << 20 and self.held <= self.peak // 4 and not self.trim_at:
            self.trim_at = now + TRIM_AFTER_S  # an episode of unread replies is over
        if self.trim_at and now >= self.trim_at:
            self.trim_at = 0.0
            self.peak = self.held
            gc.collect()  # (garbage cycles holding replies go first)
            release_free_memory()

    def _warn(self, kind: str, text: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[kind] = now
            log.warning("%s", text)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.router.disable_monitor()
        for sock in (self.monitor, self.router, self.zap):
            sock.close()

    def __len__(self) -> int:
        return len(self.conns)

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "open_connections": len(self.conns), "unread_reply_bytes": self.held}


def default_unread_bytes() -> int:
    """``max_unread_reply_bytes`` 0: a share of this host's memory (or of the cgroup's limit)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError), open("/sys/fs/cgroup/memory.max") as fh:
        total = min(total, int(fh.read().strip()))
    return max(16 << 20, min(AUTO_UNREAD_CAP, total // AUTO_UNREAD_FRACTION))


def _raise_descriptor_limit(connections: int) -> None:
    """One descriptor per connection: raise the soft limit (never past the hard one) to hold them."""
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = connections * 2 + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_LIBC: Any = None
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
# Buffers from this size on (large replies) are mapped, so freeing one unmaps it. Each costs its
# page faults once more, where a heap buffer is reused warm; page-sized buffers stay on the heap.
MMAP_THRESHOLD = 256 << 10


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def _map_large_buffers() -> None:
    """Large buffers (replies, the followers' pages) each in their own mapping: freed, they leave
    the process at once, instead of a heap that the next ones fragment. (glibc raises this
    threshold by itself after the first large free; a fixed one keeps it.)"""
    libc = _libc()
    if libc:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_free_memory() -> None:
    """Hand memory the allocator keeps free back to the OS (glibc's ``malloc_trim``; elsewhere
    nothing): after a burst of large buffers, so that the next burst does not ratchet RSS up."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)
