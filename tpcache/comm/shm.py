"""Same-host round transport: the MIN all-reduce through one shared-memory segment.

Protocol (per round ``r = 1, 2, ...``; every rank keeps the same round counter):

1. A rank writes its record ``[checksum, n, values]`` into its own slot, buffer ``r % 2``, then the
   buffer's generation word ``= r``. The checksum is xxh3 over ``[n, values]`` seeded by the segment
   token and ``r``, so a reader that sees the generation before the data (weakly ordered CPUs such as
   aarch64 hosts; CPython issues no memory fences) rejects the torn record and reads again.
2. It waits until every other rank's buffer ``r % 2`` holds a valid record of round ``r``, then
   computes the MIN locally. Every rank computes it from the same records, so all get the same result.

Double buffering makes reuse safe: a rank writes round ``r + 2`` into the buffer of round ``r`` only
after it completed round ``r + 1``, which needs every rank's round ``r + 1`` record, which a rank writes
only after it finished reading round ``r``.

Waiting polls with ``sched_yield`` for up to ``yield_s`` (optionally after spinning ``spin_s``): quick
rounds complete here, also when ranks outnumber the cores, since a waiter hands its core over. Then
it sleeps on a futex on the segment's "done round" word: the first rank to see all records of a round
sets the word and wakes the sleepers, so a long wait costs no CPU and still ends within microseconds
of the last arrival. Without futexes (not Linux) the last phase sleeps with backoff instead. A wait
that follows one that slept yields only ``_YIELD_AFTER_SLEEP_S`` before sleeping: a rank that is
early round after round (a follower while the leader serves lookups) would otherwise spend
``yield_s`` of CPU per round in ``sched_yield``, on cores the other ranks need.

Each rank also keeps a control word (active / closed / aborted) and its pid in the segment: a waiter
fails fast when a rank it waits for closed, gave up, or its process is gone.

Lifetime: torch.distributed forms the group and is the source of truth for setup. Group rank 0 removes
leftovers of dead creators, creates ``tpcache-round-<pid>-<port>-<token>`` in ``/dev/shm``, broadcasts
its name, every rank maps it and reports back, and rank 0 unlinks the file at once: the mapping lives
on while any rank holds it, and nothing is left behind after a clean exit or a crash. Plain files with
``mmap`` are used instead of ``multiprocessing.shared_memory``, whose resource tracker (Python < 3.13)
unlinks or warns about segments that other processes still use.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import secrets
import socket
import time
from array import array
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from tpcache.comm import futex
from tpcache.comm.collective import (
    DEFAULT_CAPACITY,
    Collective,
    CollectiveError,
    CollectiveTimeout,
    elementwise_min,
)
from tpcache.comm.exchange import all_gather_json, group_backend, group_device, require_group

SHM_DIR = "/dev/shm"
PREFIX = "tpcache-round-"

_MAGIC = 0x7470636163686531  # "tpcache1"
_VERSION = 1
_HEADER_WORDS = 8  # magic, version, world_size, capacity, token, done round
_DONE_WORD = 5  # the last round some rank saw complete; futex word the others sleep on
_YIELD_AFTER_SLEEP_S = 20e-6  # the yield phase of a wait that follows one that slept
_CTRL_WORDS = 8  # per rank: state, pid, pid namespace, aborted round (one 64-byte line)
_LINE_WORDS = 8  # 64-byte cache line: slots start on their own lines (no false sharing)

_EMPTY, _ACTIVE, _CLOSED, _ABORTED = 0, 1, 2, 3
_STATE_NAMES = {_EMPTY: "never attached", _ACTIVE: "active", _CLOSED: "closed", _ABORTED: "aborted"}
_MASK64 = (1 << 64) - 1


class ShmUnavailable(CollectiveError):
    """The shared-memory transport cannot be set up for this group (every rank gets the same answer)."""


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _host_identity(shm_dir: str) -> tuple[str, str, int]:
    """What must be equal for ranks to share ``shm_dir``: host name, boot id, the directory's device."""
    boot_id = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    try:
        st_dev = os.stat(shm_dir).st_dev
    except OSError:
        st_dev = -1
    return socket.gethostname(), boot_id, st_dev


def _pid_gone(pid: int) -> bool:
    """True only when ``pid`` (in our pid namespace) has certainly exited, zombies included."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return not _pid_gone(pid)


def segment_name(port: int | str | None = None) -> str:
    """A fresh segment name: ``tpcache-round-<creator pid>-<port>-<random token>``."""
    port = port if port is not None else os.environ.get("MASTER_PORT", "0")
    return f"{PREFIX}{os.getpid()}-{port}-{secrets.token_hex(6)}"


def cleanup_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove segments left by crashed runs (creator pid no longer alive); return the names removed."""
    removed = []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
    return removed


class _Segment:
    """The mapped segment and its layout (word offsets into an int64 view)."""

    def __init__(self, fd: int, world_size: int, capacity: int, *, create: bool) -> None:
        self.world_size = world_size
        self.capacity = capacity
        self.ctrl = _HEADER_WORDS
        self.buf_words = _round_up(3 + capacity, _LINE_WORDS)  # generation, checksum, n, values
        self.slots = _round_up(self.ctrl + _CTRL_WORDS * world_size, _LINE_WORDS)
        self.words = self.slots + 2 * world_size * self.buf_words
        self.size = 8 * self.words
        if create:
            os.ftruncate(fd, self.size)
        elif os.fstat(fd).st_size != self.size:
            raise ShmUnavailable(f"segment has {os.fstat(fd).st_size} bytes, this rank expects {self.size}")
        self.mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.raw = memoryview(self.mm)
        self.w = self.raw.cast("q")
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self.mm)
        self.address = ctypes.addressof(self._anchor)  # of word 0, for futex wait/wake

    def buf(self, rank: int, rnd: int) -> int:
        """Word offset of ``rank``'s buffer for round ``rnd`` (parity-indexed double buffer)."""
        return self.slots + (2 * rank + (rnd & 1)) * self.buf_words

    def ctrl_of(self, rank: int) -> int:
        return self.ctrl + _CTRL_WORDS * rank

    def close(self) -> None:
        # Views and the ctypes anchor must be released before the map can be closed.
        self._anchor = None
        self.w.release()
        self.raw.release()
        self.mm.close()


class ShmCollective(Collective):
    """``Collective`` over shared memory for ranks on one host; set up through a torch.distributed group.

    Construction is a collective call on ``group`` (every rank must construct it). Raises
    ``ShmUnavailable`` on every rank alike when the ranks are not on one host or the segment cannot be
    created or mapped; ``make_collective`` then falls back to ``TorchCollective``.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        device: Any = None,
        capacity: int = DEFAULT_CAPACITY,
        shm_dir: str = SHM_DIR,
        spin_s: float = 0.0,
        yield_s: float = 500e-6,
        max_sleep_s: float = 1e-3,
        allow_any_thread: bool = False,
    ) -> None:
        require_group(capacity)
        self._init(dist.get_rank(group), dist.get_world_size(group), capacity, spin_s, yield_s, max_sleep_s)
        self._allow_any_thread = allow_any_thread
        # Setup messages travel on the group: CPU tensors unless the group only speaks NCCL.
        on_nccl = group_backend(group, None) == "nccl"
        self._device = group_device(group, device) if on_nccl else torch.device("cpu")
        self.segment_name, self._token = self._setup(group, shm_dir)

    def _init(self, rank: int, world: int, capacity: int, spin_s: float, yield_s: float, max_sleep_s: float) -> None:
        super().__init__(rank, world, "shm", capacity=capacity)
        # Polling with sched_yield from the start beats spinning even with a core per rank: a rank that
        # shares its core (with a peer or another process) hands it over at once.
        self.spin_s = spin_s
        self._polls_before_clock = 32 if spin_s > 0 else 1  # a few cheap polls first when spinning
        self.yield_s = yield_s
        self.max_sleep_s = max_sleep_s
        self._round = 0
        self._slept = False  # whether the last wait outlasted ``yield_s`` (it ended asleep)
        # Work the owner does while this rank waits for the others (rank 0 of the service reads
        # lookups): called between polls, it returns whether it did anything, and must not raise.
        self.while_waiting: Callable[[], bool] | None = None
        self._peers = [r for r in range(self.world_size) if r != self.rank]
        self._seg: _Segment | None = None
        self._pidns = _pid_namespace()
        self._futex = futex.available()

    @classmethod
    def local_group(
        cls, world: int, *, capacity: int = DEFAULT_CAPACITY, shm_dir: str = SHM_DIR
    ) -> list[ShmCollective]:
        """``world`` ranks of one process on one segment, set up without torch.distributed: for the
        simulator, which drives them split-phase (``publish`` on every rank, then ``collect``)."""
        ranks = []
        for rank in range(world):
            c = cls.__new__(cls)
            c._init(rank, world, capacity, 0.0, 0.0, 1e-3)
            c._allow_any_thread = True
            ranks.append(c)
        name, token = ranks[0]._create(shm_dir)
        path = os.path.join(shm_dir, name)
        try:
            for c in ranks[1:]:
                c._attach(path, token)
        finally:
            os.unlink(path)
        for c in ranks:
            c.segment_name, c._token = name, token
        return ranks

    # -- setup ---------------------------------------------------------------------------------------

    def _setup(self, group: Any, shm_dir: str) -> tuple[str, int]:
        idents = all_gather_json(_host_identity(shm_dir), group, self._device)
        if any(ident != idents[0] for ident in idents):
            if any(ident[:2] != idents[0][:2] for ident in idents):
                where = ", ".join(f"rank {r}: {ident[0]}" for r, ident in enumerate(idents))
                raise ShmUnavailable(f"ranks are not on one host ({where})")
            unusable = [r for r, ident in enumerate(idents) if ident[2] == -1]
            raise ShmUnavailable(f"ranks do not share one {shm_dir} (missing on ranks {unusable}, or different mounts)")
        offer: Any = None
        path = None
        if self.rank == 0:
            cleanup_stale_segments(shm_dir)
            try:
                offer = self._create(shm_dir)
                path = os.path.join(shm_dir, offer[0])
            except OSError as exc:
                offer = f"rank 0 could not create a segment in {shm_dir}: {exc}"
        offer = all_gather_json(offer, group, self._device)[0]
        if isinstance(offer, str):
            raise ShmUnavailable(offer)
        name, token = offer

        error = None
        if self.rank != 0:
            try:
                self._attach(os.path.join(shm_dir, name), token)
            except (OSError, ValueError, ShmUnavailable) as exc:
                error = f"rank {self.rank} could not map {name}: {exc}"
        try:
            errors = all_gather_json(error, group, self._device)
        finally:
            # Everyone has mapped the segment (or failed): the name is no longer needed.
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        failed = [e for e in errors if e]
        if failed:
            self._close()
            raise ShmUnavailable("; ".join(failed))
        return name, token

    def _create(self, shm_dir: str) -> tuple[str, int]:
        name = segment_name()
        token = secrets.randbits(63)
        path = os.path.join(shm_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            seg = _Segment(fd, self.world_size, self.capacity or 0, create=True)
            w = seg.w
            w[1], w[2], w[3], w[4] = _VERSION, self.world_size, seg.capacity, token
            w[0] = _MAGIC  # last: a mapped segment with the magic is fully initialised
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._seg = seg
        self._register()
        return name, token

    def _attach(self, path: str, token: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            seg = _Segment(fd, self.world_size, self.capacity or 0, create=False)
        finally:
            os.close(fd)
        w = seg.w
        found = (w[0], w[1], w[2], w[3], w[4])
        if found != (_MAGIC, _VERSION, self.world_size, seg.capacity, token):
            seg.close()
            raise ShmUnavailable(
                f"segment header {found[1:4]} (version, world size, capacity) does not match this rank's "
                f"({_VERSION}, {self.world_size}, {seg.capacity}) or the token differs"
            )
        self._seg = seg
        self._register()

    def _register(self) -> None:
        assert self._seg is not None
        w, c = self._seg.w, self._seg.ctrl_of(self.rank)
        w[c + 1], w[c + 2], w[c + 3] = os.getpid(), self._pidns, 0
        w[c] = _ACTIVE

    # -- the round -----------------------------------------------------------------------------------

    def _allreduce_min(self, values: array, timeout_s: float) -> array:
        self.publish(values)
        return self.collect(values, timeout_s)

    def publish(self, values: array) -> None:
        """Step 1 of a round: write this rank's record for the next round number."""
        seg = self._seg
        assert seg is not None
        self._round += 1
        rnd = self._round
        n = len(values)
        seed = (self._token + rnd) & _MASK64
        record = array("q", (n,))
        record.extend(values)
        checksum = _signed(xxhash.xxh3_64_intdigest(record, seed=seed))
        w, b = seg.w, seg.buf(self.rank, rnd)
        w[b + 2 : b + 3 + n] = record
        w[b + 1] = checksum
        w[b] = rnd  # publish last (readers verify the checksum in any case)

    def collect(self, values: array, timeout_s: float) -> array:
        """Step 2: wait for every peer's record of this round and reduce (``values`` are this rank's)."""
        rnd = self._round
        n = len(values)
        seed = (self._token + rnd) & _MASK64
        if not self._peers:
            return array("q", values)
        try:
            peers = self._gather(rnd, seed, timeout_s)
            for r, peer in peers.items():
                if len(peer) != n:
                    raise CollectiveError(
                        f"round vector length differs across ranks (rank {self.rank}: {n}, "
                        f"rank {r}: {len(peer)}); the ranks run different configurations"
                    )
            self._check_nobody_gave_up(rnd)
        except CollectiveError:
            self._mark(_ABORTED, rnd)
            raise
        return elementwise_min([values, *peers.values()])

    def _read(self, rank: int, rnd: int, seed: int) -> array | None:
        """``rank``'s values for round ``rnd`` if its record is there and intact, else None."""
        seg = self._seg
        assert seg is not None
        w, b = seg.w, seg.buf(rank, rnd)
        if w[b] != rnd:
            return None
        n = w[b + 2]
        if not 0 <= n <= seg.capacity:
            return None  # torn read
        snapshot = bytes(seg.raw[8 * (b + 2) : 8 * (b + 3 + n)])
        if _signed(xxhash.xxh3_64_intdigest(snapshot, seed=seed)) != w[b + 1] or w[b] != rnd:
            return None  # not fully visible yet
        return array("q", memoryview(snapshot)[8:].cast("q"))

    def _gather(self, rnd: int, seed: int, timeout_s: float) -> dict[int, array]:
        seg = self._seg
        assert seg is not None
        w = seg.w
        got: dict[int, array] = {}
        pending = self._peers
        start = time.perf_counter()
        deadline = start + timeout_s
        next_check = start + 0.01
        pause = 20e-6
        spins = 0
        done_at = _DONE_WORD
        # A rank whose last wait outlasted the yield phase is most likely early again (a follower
        # waiting while the leader serves a batch of lookups): yielding would burn a core the others
        # need, so it goes to sleep after one short yield slice. A quick round puts it back.
        yield_s = min(self.yield_s, _YIELD_AFTER_SLEEP_S) if self._slept else self.yield_s
        slept = False
        while True:
            done = w[done_at]  # read before polling, so a wake after the poll is never lost
            still = []
            for r in pending:
                values = self._read(r, rnd, seed)
                if values is None:
                    still.append(r)
                else:
                    got[r] = values
            pending = still
            if not pending:
                if self._futex and done != rnd and w[done_at] != rnd:
                    w[done_at] = rnd  # the round is complete: wake the ranks sleeping on it
                    futex.wake(seg.address + 8 * done_at)
                if spins:  # (a round found complete at once says nothing about the next wait)
                    self._slept = slept
                return got
            spins += 1
            if spins < self._polls_before_clock:
                continue  # a few cheap polls before consulting the clock
            now = time.perf_counter()
            if now >= deadline:
                raise CollectiveTimeout(
                    f"shm round {rnd} on rank {self.rank}: rank(s) {pending} did not arrive within {timeout_s:g} s",
                    pending,
                )
            if now >= next_check:
                self._check_peers_alive(rnd, pending)
                next_check = now + 0.01
            waited = now - start
            if waited < self.spin_s:
                continue
            work = self.while_waiting
            if work is not None and work():
                continue  # it did something: look at the records again first
            if waited < yield_s:
                os.sched_yield()  # let a rank sharing this core run; stay ready for a quick round
            elif self._futex:
                slept = True
                # Sleep until a rank sees the round complete and wakes us, or 10 ms pass (liveness check).
                futex.wait(seg.address + 8 * done_at, done, min(deadline - now, 0.01))
            else:
                slept = True
                time.sleep(pause)
                pause = min(pause * 2, self.max_sleep_s)

    def _check_peers_alive(self, rnd: int, pending: list[int]) -> None:
        """Fail fast when a rank we wait for closed, gave up, or its process exited."""
        seg = self._seg
        assert seg is not None
        w = seg.w
        gone = []
        why = []
        for r in pending:
            c = seg.ctrl_of(r)
            state, pid, pidns = w[c], w[c + 1], w[c + 2]
            if state != _ACTIVE:
                gone.append(r)
                why.append(f"rank {r} {_STATE_NAMES.get(state, 'unknown')}")
            elif pidns == self._pidns and _pid_gone(pid):
                gone.append(r)
                why.append(f"rank {r} (pid {pid}) exited")
        if gone:
            raise CollectiveTimeout(
                f"shm round {rnd} on rank {self.rank}: rank(s) {gone} will not arrive ({'; '.join(why)})",
                gone,
            )

    def _check_nobody_gave_up(self, rnd: int) -> None:
        """A rank that timed out in this round reports failure; do not report success against it."""
        seg = self._seg
        assert seg is not None
        w = seg.w
        for r in self._peers:
            c = seg.ctrl_of(r)
            if w[c] == _ABORTED and w[c + 3] >= rnd:
                raise CollectiveTimeout(
                    f"shm round {rnd} on rank {self.rank}: rank {r} gave up on this round before this "
                    "rank arrived (it timed out waiting)",
                    [],
                )

    def _mark(self, state: int, rnd: int) -> None:
        seg = self._seg
        if seg is None:
            return
        c = seg.ctrl_of(self.rank)
        seg.w[c + 3] = rnd
        seg.w[c] = state

    def _close(self) -> None:
        seg, self._seg = self._seg, None
        if seg is None:
            return
        c = seg.ctrl_of(self.rank)
        if seg.w[c] == _ACTIVE:
            seg.w[c] = _CLOSED
        seg.close()
