"""Mooncake Store backend: pages in a Mooncake distributed store (master + memory segments).

Small reads and writes go through a staging buffer registered with the store
(``register_buffer``): ``batch_get_into`` reads values into it, ``batch_upsert_from`` writes the
records packed in it. A staged read is verified after its payload is copied out to the caller's
buffer, never in the staging buffer, where a transfer the store gave up on may still land. The
shard layout's records are gathered straight into the staging buffer on the caller's thread
(``_records``) and written with ``batch_put_from`` where the store has no value for the key yet
(``batch_is_exist``; a value written by put reads faster than one written by upsert) and
``batch_upsert_from`` where it has one.

Large pages (``direct_get_bytes``/``direct_put_bytes`` and up, TCP) skip the copy:

- A read lands where the caller keeps the page (``batch_get_into_multi_buffers``: header and key
  echo into the staging buffer, payload into the caller's page) and is verified there. A late
  write into that page is made impossible rather than harmless: Mooncake's client stops waiting
  for a transfer after 60 s while its TCP transport drops a connection only after 30 s without
  progress, so a read it reports failed can still be delivering bytes. So when a read of a key
  fails after its transfer may have started, the backend closes its client and starts a new one
  before it reports anything (``_renew``). Closing runs ``TcpTransport::shutdownConnectionLanes``
  (mooncake-transfer-engine, tcp_transport_lane_impl.h): it cancels every session, closes every
  socket, stops the transport's io_context and joins its one worker thread, the only thread that
  writes what a TCP read receives into local memory. By the time the round agrees the miss and the
  core frees or reuses the page, nothing of the old client can still write into it. A caller's
  buffer must stay valid for the call (host pool pages live as long as the process).
- A write's header goes in the staging buffer and the store reads the page where the caller keeps
  it (``batch_put_from_multi_buffers``, one value from two buffers). A late read there is
  harmless: the header's checksum was taken from the page before the transfer, so a page that
  changed before the store read it is a value that fails verification, never a hit. That call
  keeps an existing value (first writer wins), so keys the store already has (``batch_is_exist``)
  are written through the staging buffer with ``upsert``, which replaces them; a key another
  writer creates between the two calls keeps that writer's value, which a read verifies like any
  other.

Store semantics this relies on (``mooncake-transfer-engine`` 0.3.13, probed): ``put`` keeps the
first writer's bytes, ``upsert`` replaces them; the TCP transport reads and writes local memory
whether it is registered or not (RDMA only registered memory, so direct reads and writes are TCP
only; a remote peer's writes into this process are refused outside registered buffers); a missing
key reads -704; a key whose segment holder died still "exists" for the master's client TTL while
every read fails (-800); the store evicts per key, so one rank's shard of a page can vanish while
another's stays. All of those are misses here. A master or segment holder that does not answer
(stopped) costs one deadline, then calls fail fast (see ``remote``). With a deadline, reads go
through the staging buffer only: a read abandoned at its deadline can still be writing, and the
staging buffer is not reused until it returns, where the caller's pages would be reused once the
round agreed the miss. Reads into the caller's pages (below) are for ``deadline=0``.

This rank contributes ``segment_bytes`` of its own memory to the store (0 by default): pages
kept in a rank's own segment vanish when the rank exits, so durable data belongs on segment
holders that outlive the cache (Mooncake's ``mooncake_client`` or another engine's memory).
"""

from __future__ import annotations

import ctypes
import ipaddress
import mmap
import os
import socket
from array import array
from typing import Any

from tpcache.core.backend import RECORD as _native  # None: the shard layout takes the Python path
from tpcache.io.storage.base import (
    MISS_FOREIGN,
    MISS_IO_ERROR,
    MISS_MISSING,
    PUT_IO_ERROR,
    PUT_NO_SPACE,
    PUT_TOO_LARGE,
    StorageError,
)
from tpcache.io.storage.buffers import address_of
from tpcache.io.storage.remote import (
    DEFAULT_DEADLINE_S,
    DEFAULT_PREFIX,
    DEFAULT_RETRY_S,
    RemoteBackend,
    Sink,
    StoreUnavailable,
)

# Mooncake's ErrorCode values (mooncake-store types.h); Python sees plain ints.
NO_AVAILABLE_HANDLE = -200  # no segment has room
INVALID_PARAMS = -600  # e.g. the value is larger than the buffer given for it
INVALID_REPLICA = -702
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
LEASE_EXPIRED = -707  # the read completed after the object's lease ran out
RPC_FAIL = -900
RPC_TIMEOUT = -901
TENANT_QUOTA_EXCEEDED = -1700
_NO_SPACE = (NO_AVAILABLE_HANDLE, TENANT_QUOTA_EXCEEDED)
_UNREACHABLE = (RPC_FAIL, RPC_TIMEOUT)
# Read outcomes that leave no transfer in flight: decided before one is submitted (the master's
# answer, the buffer size check: RealClient::batch_get_into_multi_buffers_internal), or after it
# completed (Client::BatchGet sets LEASE_EXPIRED only on keys whose transfer succeeded).
_NOTHING_IN_FLIGHT = (
    INVALID_PARAMS,
    INVALID_REPLICA,
    REPLICA_IS_NOT_READY,
    OBJECT_NOT_FOUND,
    LEASE_EXPIRED,
    *_UNREACHABLE,
)
_ALIGN = 64
Reasons = list[str | None]  # per key: None once written, else why not

DEFAULT_STAGING_BYTES = 64 << 20
DEFAULT_LOCAL_BUFFER_BYTES = 16 << 20
# Pages at least this large are put from, and read into, the caller's memory. Each such value is
# two transfers (header, page) instead of one, a fixed cost per page that a copy of a small page
# undercuts.
DEFAULT_DIRECT_PUT_BYTES = 256 << 10
DEFAULT_DIRECT_GET_BYTES = 256 << 10


def _load_client() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ModuleNotFoundError:
        raise StorageError(
            "the Mooncake backend needs the Mooncake client: pip install 'tpcache[mooncake]' "
            "(mooncake-transfer-engine-non-cuda, or the CUDA build on GPU hosts)"
        ) from None
    except ImportError as exc:
        raise StorageError(
            f"the Mooncake client cannot load ({exc}); its libraries need libibverbs even for TCP: "
            "install libibverbs1 (Debian/Ubuntu: apt-get install libibverbs1)"
        ) from None
    return MooncakeDistributedStore


def local_address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (loopback for a loopback master). A UDP
    ``connect`` only picks the route; it sends nothing."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        if host == "localhost":
            return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


class MooncakeBackend(RemoteBackend):
    """Pages in Mooncake Store; see the module docstring.

    Args:
        master: the master's RPC address, ``host:port``.
        metadata: the transfer engine's metadata service (``http://host:port/metadata``, or
            Mooncake's etcd/redis forms).
        shard: ``(tp_rank, tp_size)`` this instance serves; keys of other shards are rejected.
        local_hostname: the address other Mooncake clients reach this one at (default: this
            host's address towards the master).
        protocol, device: the transfer engine's protocol (``tcp``, ``rdma``) and RDMA devices.
        segment_bytes: memory this rank contributes to the store (see the module docstring).
        local_buffer_bytes: the client's own transfer buffer (Mooncake's ``local_buffer_size``).
        staging_bytes: the registered buffer gets and small puts transfer through; a call larger
            than it runs in several transfers, a page larger than it is refused (``too_large``).
        direct_put_bytes: pages at least this large are put straight from the caller's memory
            (TCP only; see the module docstring).
        direct_get_bytes: pages at least this large are read straight into the caller's memory
            (TCP only, and only without a deadline; a failed read renews the client, see the
            module docstring).
        deadline_s: every call answers within this or is abandoned (``remote``); 0: none.
    """

    scheme = "mooncake"

    def __init__(
        self,
        master: str,
        metadata: str,
        *,
        shard: tuple[int, int] | None = None,
        local_hostname: str | None = None,
        protocol: str = "tcp",
        device: str = "",
        segment_bytes: int = 0,
        local_buffer_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        direct_put_bytes: int = DEFAULT_DIRECT_PUT_BYTES,
        direct_get_bytes: int = DEFAULT_DIRECT_GET_BYTES,
        prefix: str = DEFAULT_PREFIX,
        retry_s: float = DEFAULT_RETRY_S,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        where = f"{master} (metadata {metadata})"
        super().__init__(shard=shard, prefix=prefix, retry_s=retry_s, where=where, deadline_s=deadline_s)
        direct = min(direct_put_bytes, direct_get_bytes)
        if staging_bytes < 4096 or segment_bytes < 0 or local_buffer_bytes <= 0 or direct < 0:
            raise ValueError(
                "staging_bytes must be >= 4096, segment_bytes >= 0, local_buffer_bytes > 0, "
                "direct_put_bytes and direct_get_bytes >= 0"
            )
        self._direct_min = direct_put_bytes if protocol == "tcp" else None
        # A read that can be abandoned at its deadline lands in the staging buffer (not reused
        # until it returns), never in the caller's pages: reads into them need no deadline.
        self._placed_min = direct_get_bytes if protocol == "tcp" and not deadline_s else None
        for name in ("puts_direct", "gets_direct", "client_renewals"):
            self._counters.set(name, 0)
        host = master.rpartition(":")[0] or master
        hostname = local_hostname or local_address_towards(host)
        # The transfer engine reads these when it starts; the user's own settings win.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        self._client_class = _load_client()
        self._setup = (hostname, metadata, segment_bytes, local_buffer_bytes, protocol, device, master)
        self._staging = mmap.mmap(-1, staging_bytes)
        self._anchor = ctypes.c_char.from_buffer(self._staging)
        self._base = ctypes.addressof(self._anchor)
        self._view = memoryview(self._staging)
        self._store: Any = None
        try:
            self._connect()
        except BaseException:
            self._release()
            raise

    def _connect(self) -> None:
        """A new store client, joined to the store, with the staging buffer registered."""
        store = self._client_class()
        rc = store.setup(*self._setup)
        if rc != 0:
            store.close()
            raise StorageError(f"cannot join Mooncake Store at {self.where}: setup returned {rc}")
        rc = store.register_buffer(self._base, len(self._view))
        if rc != 0:
            store.close()
            raise StorageError(f"Mooncake Store at {self.where} refused to register a transfer buffer: {rc}")
        self._store = store

    def _connected(self) -> Any:
        """The store client; a new one if a renewal could not start one (else StoreUnavailable)."""
        if self._store is None:
            try:
                self._connect()
            except StorageError as exc:
                raise StoreUnavailable(str(exc)) from None
        return self._store

    def _renew(self) -> None:
        """Close the client, then start a new one. Once ``close`` returns, the old client's TCP
        transport has joined its worker thread: no transfer it started can write anywhere (see
        the module docstring). If no new client starts, calls fail fast for ``retry_s``, then
        try again."""
        self._counters.add("client_renewals")
        old, self._store = self._store, None
        old.unregister_buffer(self._base)
        old.close()
        try:
            self._connect()
        except StorageError:
            self._unreachable()

    def _plan(self, sizes: list[int]) -> list[list[tuple[int, int]]]:
        """Chunks of (key index, staging offset) whose records fit the staging buffer together;
        a record larger than the buffer gets offset -1."""
        chunks: list[list[tuple[int, int]]] = [[]]
        off = 0
        for i, size in enumerate(sizes):
            if size > len(self._view):
                chunks[-1].append((i, -1))
                continue
            if off + size > len(self._view):
                chunks.append([])
                off = 0
            chunks[-1].append((i, off))
            off += -(-size // _ALIGN) * _ALIGN
        return chunks

    @staticmethod
    def _check_reachable(codes: list[int]) -> None:
        if codes and all(c in _UNREACHABLE for c in codes):
            raise StoreUnavailable(f"the master did not answer ({codes[0]})")

    def _exists(self, names: list[str]) -> list[bool]:
        codes = list(self._connected().batch_is_exist(names))
        self._check_reachable(codes)
        return [c == 1 for c in codes]

    def _put(self, names: list[str], heads: list[bytes], payloads: list[memoryview]) -> list[str | None]:
        reasons: list[str | None] = [PUT_IO_ERROR] * len(names)
        direct = self._direct(names, payloads)
        staged = [i for i in range(len(names)) if i not in direct]
        self._put_staged(staged, names, heads, payloads, reasons)
        self._put_direct(direct, names, heads, payloads, reasons)
        return reasons

    def _direct(self, names: list[str], payloads: list[memoryview]) -> dict[int, int]:
        """Key index -> payload address for the pages put straight from the caller's memory: large
        enough, writable (ctypes gives no address of read-only memory), on TCP, and not in the
        store already (a put keeps an existing value; those go through ``batch_upsert_from``)."""
        found = _addresses(payloads, self._direct_min)
        if not found:
            return {}
        codes = list(self._connected().batch_is_exist([names[i] for i in found]))
        self._check_reachable(codes)
        return {i: addr for (i, addr), code in zip(found.items(), codes, strict=True) if code == 0}

    def _put_staged(
        self, idx: list[int], names: list[str], heads: list[bytes], payloads: list[memoryview], reasons: Reasons
    ) -> None:
        """Records copied whole into the staging buffer, then one ``batch_upsert_from`` per chunk."""
        sizes = [len(heads[i]) + len(payloads[i]) for i in idx]
        for chunk in self._plan(sizes):
            todo = []
            for j, off in chunk:
                i = idx[j]
                if off < 0:
                    reasons[i] = PUT_TOO_LARGE
                    continue
                self._view[off : off + len(heads[i])] = heads[i]
                self._view[off + len(heads[i]) : off + sizes[j]] = payloads[i]
                todo.append((i, off, sizes[j]))
            if todo:
                codes = self._connected().batch_upsert_from(
                    [names[i] for i, _, _ in todo], [self._base + off for _, off, _ in todo], [n for _, _, n in todo]
                )
                self._outcomes([i for i, _, _ in todo], codes, reasons)

    def _put_direct(
        self, direct: dict[int, int], names: list[str], heads: list[bytes], payloads: list[memoryview], reasons: Reasons
    ) -> None:
        """Headers in the staging buffer, payloads read where the caller keeps them: each value is
        put from two buffers (``batch_put_from_multi_buffers``), with no copy of the page."""
        idx = list(direct)
        for chunk in self._plan([len(heads[i]) for i in idx]):
            todo = [(idx[j], off) for j, off in chunk]
            for i, off in todo:
                self._view[off : off + len(heads[i])] = heads[i]
            codes = self._connected().batch_put_from_multi_buffers(
                [names[i] for i, _ in todo],
                [[self._base + off, direct[i]] for i, off in todo],
                [[len(heads[i]), len(payloads[i])] for i, _ in todo],
            )
            self._outcomes([i for i, _ in todo], codes, reasons)
            self._counters.add("puts_direct", sum(1 for c in codes if c == 0))

    def _outcomes(self, idx: list[int], codes: Any, reasons: Reasons) -> None:
        codes = list(codes)
        self._check_reachable(codes)
        for i, code in zip(idx, codes, strict=True):
            reasons[i] = None if code == 0 else PUT_NO_SPACE if code in _NO_SPACE else PUT_IO_ERROR

    def _get(self, names: list[str], sizes: list[int], sink: Sink, out: list[memoryview]) -> None:
        placed = _addresses(out, self._placed_min)  # pages read straight into the caller's memory
        self._get_staged([i for i in range(len(names)) if i not in placed], names, sizes, sink)
        self._get_placed(placed, names, sizes, sink, out)

    def _read_into_staging(self, todo: list[tuple[int, int]], names: list[str], sizes: list[int]) -> list[int]:
        """One ``batch_get_into`` of the keys ``todo`` names ((key index, staging offset)) into the
        staging buffer: per key the bytes read, or Mooncake's error code."""
        codes = list(
            self._connected().batch_get_into(
                [names[i] for i, _ in todo], [self._base + off for _, off in todo], [sizes[i] for i, _ in todo]
            )
        )
        self._check_reachable(codes)
        return codes

    def _get_staged(self, idx: list[int], names: list[str], sizes: list[int], sink: Sink) -> None:
        """Whole values into the staging buffer, one ``batch_get_into`` per chunk; ``sink`` copies
        each payload out and checks it there."""
        for chunk in self._plan([sizes[i] for i in idx]):
            todo = []
            for j, off in chunk:
                if off < 0:
                    sink(idx[j], None, MISS_FOREIGN)  # no page of this size is ever stored this large
                else:
                    todo.append((idx[j], off))
            if not todo:
                continue
            codes = self._read_into_staging(todo, names, sizes)
            for (i, off), code in zip(todo, codes, strict=True):
                if code >= 0:
                    sink(i, self._view[off : off + code], None)
                else:
                    sink(i, None, _miss_reason(code))

    def _get_placed(
        self, placed: dict[int, int], names: list[str], sizes: list[int], sink: Sink, out: list[memoryview]
    ) -> None:
        """Headers into the staging buffer, payloads into the caller's pages, checked in place. A
        key that failed with its transfer possibly still running renews the client before any key
        of its chunk is reported; a failed key's page is zero-filled after that (nothing writes
        there then)."""
        idx = list(placed)
        heads = [sizes[i] - len(out[i]) for i in idx]
        for chunk in self._plan(heads):
            todo = [(idx[j], off, heads[j]) for j, off in chunk]
            codes = list(
                self._connected().batch_get_into_multi_buffers(
                    [names[i] for i, _, _ in todo],
                    [[self._base + off, placed[i]] for i, off, _ in todo],
                    [[n, len(out[i])] for i, _, n in todo],
                )
            )
            self._check_reachable(codes)
            if any(code < 0 and code not in _NOTHING_IN_FLIGHT for code in codes):
                self._renew()
            for (i, _, _), code in zip(todo, codes, strict=True):
                if code < 0:  # never leave what a failed read wrote in the caller's page
                    ctypes.memset(placed[i], 0, len(out[i]))
            self._counters.add("gets_direct", sum(1 for c in codes if c >= 0))
            for (i, off, n), code in zip(todo, codes, strict=True):
                if code >= 0:
                    sink(i, self._view[off : off + min(code, n)], None, placed=code)
                else:
                    sink(i, None, _miss_reason(code))

    def _records(self, echoes: list[bytes], pages: list[Any], places: bytes, geometry: tuple, sizes: list[int]) -> Any:
        """Straight into the staging buffer when the batch fits it and no abandoned call still uses
        it (the offsets, as ``_Staged``), else one bytes object each."""
        chunks = self._plan(sizes)
        if len(chunks) > 1 or any(off < 0 for _, off in chunks[0]) or not self._idle():
            return super()._records(echoes, pages, places, geometry, sizes)
        offsets = [off for _, off in chunks[0]]
        _native.encode_records(echoes, pages, places, geometry, self._view, array("q", offsets))
        return _Staged(offsets, sizes)

    def _put_records(self, names: list[str], records: Any) -> list[str | None]:
        """One ``batch_upsert_from`` of records already in the staging buffer, or the records
        copied into it, one ``batch_upsert_from`` per chunk."""
        reasons: list[str | None] = [PUT_IO_ERROR] * len(names)
        if isinstance(records, _Staged):
            # Keys the store does not have are put (a value written by put reads faster than one
            # written by upsert), the others upserted (put keeps an existing value); a key another
            # writer creates between the two calls keeps that writer's value, verified like any other.
            exist = list(self._connected().batch_is_exist(names))
            self._check_reachable(exist)
            for put, idx in (
                (True, [i for i, c in enumerate(exist) if c == 0]),
                (False, [i for i, c in enumerate(exist) if c != 0]),
            ):
                if idx:
                    call = self._connected().batch_put_from if put else self._connected().batch_upsert_from
                    codes = call(
                        [names[i] for i in idx],
                        [self._base + records.offsets[i] for i in idx],
                        [records.sizes[i] for i in idx],
                    )
                    self._outcomes(idx, codes, reasons)
            return reasons
        for chunk in self._plan([len(r) for r in records]):
            todo = []
            for i, off in chunk:
                if off < 0:
                    reasons[i] = PUT_TOO_LARGE
                    continue
                self._view[off : off + len(records[i])] = records[i]
                todo.append((i, off))
            if todo:
                codes = self._connected().batch_upsert_from(
                    [names[i] for i, _ in todo],
                    [self._base + off for _, off in todo],
                    [len(records[i]) for i, _ in todo],
                )
                self._outcomes([i for i, _ in todo], codes, reasons)
        return reasons

    def _get_records(self, names: list[str], sizes: list[int], take: Any) -> None:
        """Whole values into the staging buffer, one ``batch_get_into`` per chunk, each run handed to
        ``take`` (which copies the payloads out and checks them there)."""
        for chunk in self._plan(sizes):
            for i, off in chunk:
                if off < 0:
                    take(i, [None], [MISS_FOREIGN])  # no record of this key is ever stored this large
            todo = [(i, off) for i, off in chunk if off >= 0]
            if not todo:
                continue
            codes = self._read_into_staging(todo, names, sizes)
            view = self._view
            if len(todo) == len(chunk) and min(codes) >= 0:  # the common case: one run, every value read
                take(todo[0][0], [view[off : off + c] for (_, off), c in zip(todo, codes, strict=True)], None)
                continue
            at = dict(zip((i for i, _ in todo), codes, strict=True))
            for start, run in _runs(todo):
                got = [at[i] for i in range(start, start + len(run))]
                values = [self._view[off : off + c] if c >= 0 else None for off, c in zip(run, got, strict=True)]
                take(start, values, [None if c >= 0 else _miss_reason(c) for c in got])

    def _delete(self, names: list[str]) -> list[bool]:
        codes = list(self._connected().batch_remove(names, True))
        self._check_reachable(codes)
        return [c == 0 for c in codes]

    def _close(self) -> None:
        if self._store is not None:
            self._store.unregister_buffer(self._base)
            self._store.close()
            self._store = None
        self._release()

    def _release(self) -> None:
        self._view.release()
        del self._anchor
        self._staging.close()


def _addresses(views: list[memoryview], least: int | None) -> dict[int, int]:
    """Index -> address of the views of ``least`` bytes or more that have one (writable ones:
    ctypes gives no address of read-only memory); none when ``least`` is None."""
    if least is None:
        return {}
    found = {}
    for i, view in enumerate(views):
        if len(view) >= least and (addr := address_of(view)) is not None:
            found[i] = addr
    return found


class _Staged:
    """Records a put gathered straight into the staging buffer: their offsets and lengths there."""

    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets: list[int], sizes: list[int]) -> None:
        self.offsets, self.sizes = offsets, sizes


def _runs(todo: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """``(index, offset)`` pairs as runs of consecutive indexes: ``(first index, offsets)``."""
    runs: list[tuple[int, list[int]]] = []
    for i, off in todo:
        if runs and runs[-1][0] + len(runs[-1][1]) == i:
            runs[-1][1].append(off)
        else:
            runs.append((i, [off]))
    return runs


def _miss_reason(code: int) -> str:
    if code == OBJECT_NOT_FOUND:
        return MISS_MISSING
    if code == INVALID_PARAMS:
        return MISS_FOREIGN  # larger than this key's record can be
    return MISS_IO_ERROR
