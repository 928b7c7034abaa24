"""Transfer engine: asynchronous, batched page copies between a device pool and a host pool.

Two directions: "d2h" backups (`submit_backup`: device pages -> host slots) and "h2d" loads
(`submit_load`: host slots -> device pages, copied layer by layer with per-layer readiness,
`LoadHandle.wait_layer`).

Completion is local knowledge, reported by op id (`finished`), once per op, in whatever order the
copies finish. The engine decides nothing about agreement: the round decides which ops count as
complete on every rank, from what each rank reported.

The same interface runs on the CPU (one worker thread per direction; torch ops release the GIL) and
on a GPU (one CUDA stream per direction, an event per loaded layer). A copy that raises completes
with ok=False instead of killing its thread. Op ids are caller-chosen ints, strictly increasing
over both directions, so `wait_op` can tell a finished op from one never submitted.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tpcache.io.errors import (
    EngineClosedError,
    OpIdError,
    PageIndexError,
    TransferError,
    TransferTimeoutError,
)
from tpcache.io.kv_pool import DevicePool, HostPool
from tpcache.io.movers import CpuMover, CudaMover
from tpcache.io.native import RowCopy

_NO_PAGES = torch.empty(0, dtype=torch.int64)

Direction = Literal["d2h", "h2d"]
D2H: Direction = "d2h"
H2D: Direction = "h2d"
DIRECTIONS: tuple[Direction, ...] = (D2H, H2D)

Delay = float | Callable[[int], float] | None
"""Test hook: seconds to hold an op back before its copy starts (fixed, or per op id)."""
BeforeCopy = Callable[[int, int], None] | None
"""Test hook: called on the copying thread as (op_id, layer) before each layer of a load and as
(op_id, -1) before a backup. If it raises, the op completes with ok=False."""


@dataclass(frozen=True)
class Completion:
    """The outcome of one finished op."""

    op_id: int
    direction: Direction
    ok: bool
    error: str | None = None


def _wait_cuda_event(event: torch.cuda.Event, deadline: float | None) -> bool:
    if deadline is None:
        event.synchronize()
        return True
    pause = 5e-5
    while not event.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return True


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + max(0.0, timeout)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class OpHandle:
    """One submitted op. Finished means: every byte landed (ok) or the op stopped with an error."""

    def __init__(self, op_id: int, direction: Direction, num_layers: int) -> None:
        self.op_id = op_id
        self.direction = direction
        self.state: Literal["queued", "running", "done"] = "queued"
        self.ok: bool | None = None
        self.error: str | None = None
        self._host_done = threading.Event()  # the copying thread is done with this op
        self._cuda_done: torch.cuda.Event | None = None  # GPU work still to land after _host_done
        self._num_layers = num_layers

    def done(self) -> bool:
        """True once the op finished (successfully or not); never blocks."""
        return self._host_done.is_set() and (self._cuda_done is None or self._cuda_done.query())

    def wait(self, timeout: float | None = None) -> Completion:
        """Block until the op finished; raise TransferTimeoutError after `timeout` seconds."""
        deadline = _deadline(timeout)
        if not self._host_done.wait(_remaining(deadline)):
            raise TransferTimeoutError(f"op {self.op_id} ({self.direction}) did not finish in {timeout} s")
        if self._cuda_done is not None and not _wait_cuda_event(self._cuda_done, deadline):
            raise TransferTimeoutError(f"op {self.op_id} ({self.direction}) did not finish in {timeout} s")
        return self.completion()

    def completion(self) -> Completion:
        if not self.done():
            raise TransferError(f"op {self.op_id} has not finished")
        return Completion(self.op_id, self.direction, bool(self.ok), self.error)

    # called by the engine only
    def _finish(self, ok: bool, error: str | None, cuda_done: torch.cuda.Event | None = None) -> None:
        self.ok, self.error, self._cuda_done, self.state = ok, error, cuda_done, "done"
        self._host_done.set()


class LoadHandle(OpHandle):
    """A host -> device load whose layers become ready one by one, in layer order."""

    def __init__(self, op_id: int, num_layers: int) -> None:
        super().__init__(op_id, H2D, num_layers)
        self._layer_set = [threading.Event() for _ in range(num_layers)]
        self._layer_cuda: list[torch.cuda.Event | None] = [None] * num_layers
        self._failed_from: int | None = None  # first layer whose data is not valid

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self._num_layers:
            raise PageIndexError(f"layer {layer!r} is out of range for {self._num_layers} layers")

    def layer_ready(self, layer: int) -> bool:
        """True when layer `layer` of every page has landed (False if it never will: see wait_layer)."""
        self._check_layer(layer)
        event = self._layer_cuda[layer]
        landed = self._layer_set[layer].is_set() and (event is None or event.query())
        return landed and (self._failed_from is None or layer < self._failed_from)

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block the calling thread until `layer` has landed on every page of this load.

        Raises TransferError if the load failed or was cancelled before that layer was copied, and
        TransferTimeoutError when `timeout` seconds pass first.
        """
        self._check_layer(layer)
        deadline = _deadline(timeout)
        if not self._layer_set[layer].wait(_remaining(deadline)):
            raise TransferTimeoutError(f"layer {layer} of load {self.op_id} not ready in {timeout} s")
        if self._failed_from is not None and layer >= self._failed_from:
            raise TransferError(f"load {self.op_id} failed before layer {layer}: {self.error}")
        event = self._layer_cuda[layer]
        if event is not None and not _wait_cuda_event(event, deadline):
            raise TransferTimeoutError(f"layer {layer} of load {self.op_id} not ready in {timeout} s")

    def stream_wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Order `stream` (default: current) after layer `layer` without blocking the host (GPU).

        On the CPU this is `wait_layer`. The host still waits until the copy of that layer was
        enqueued, which is quick.
        """
        self._check_layer(layer)
        self._layer_set[layer].wait()
        if self._failed_from is not None and layer >= self._failed_from:
            raise TransferError(f"load {self.op_id} failed before layer {layer}: {self.error}")
        event = self._layer_cuda[layer]
        if event is not None:
            (stream or torch.cuda.current_stream(event.device)).wait_event(event)

    # called by the engine only
    def _layer_landed(self, layer: int, event: torch.cuda.Event | None) -> None:
        self._layer_cuda[layer] = event
        self._layer_set[layer].set()

    def _finish(self, ok: bool, error: str | None, cuda_done: torch.cuda.Event | None = None) -> None:
        if not ok:
            self._failed_from = next((i for i, e in enumerate(self._layer_set) if not e.is_set()), None)
        if ok and self._num_layers:
            cuda_done = self._layer_cuda[-1]
        super()._finish(ok, error, cuda_done)
        for event in self._layer_set:  # release every waiter; _failed_from tells them the outcome
            event.set()


@dataclass
class _Job:
    handle: OpHandle
    src: torch.Tensor
    dst: torch.Tensor
    marker: torch.cuda.Event | None  # caller-stream point the copy must follow (GPU)
    plan: RowCopy | None = None  # the whole copy, planned at submit (CPU native path; src/dst unused)


class TransferEngine:
    """Moves lists of pages between `device_pool` and `host_pool`; see the module docstring."""

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        *,
        delay: Delay = None,
        before_copy: BeforeCopy = None,
        threads: int | None = None,
        use_native: bool | None = None,
    ) -> None:
        """`threads`: torch intra-op threads of each copying thread (default: the caller's setting,
        which a new thread would not inherit; 1 is best when ranks share the host's cores).
        `use_native`: CPU pools only, the native row copy (default: where it was built) or torch ops."""
        if device_pool.layout != host_pool.layout:
            raise ValueError(f"pool layouts differ: {device_pool.layout} vs {host_pool.layout}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._mover: CpuMover | CudaMover
        if device_pool.device.type == "cuda":
            self._mover = CudaMover(device_pool, host_pool)
        elif device_pool.device.type == "cpu":
            self._mover = CpuMover(device_pool, host_pool, use_native)
        else:
            raise ValueError(f"unsupported device pool device {device_pool.device}")
        self._delay = delay
        self._before_copy = before_copy
        self._threads = torch.get_num_threads() if threads is None else max(1, int(threads))
        self._lock = threading.Lock()
        self._held: dict[int, OpHandle] = {}  # submitted and not yet reported finished, by op id
        self._last_op_id: int | None = None
        self._closed = False
        self._closing = threading.Event()
        self._work: dict[Direction, queue.SimpleQueue[_Job | None]] = {d: queue.SimpleQueue() for d in DIRECTIONS}
        self._delayed: list[threading.Thread] = []
        self._workers = [
            threading.Thread(target=self._worker, args=(d,), name=f"tpcache-transfer-{d}", daemon=True)
            for d in DIRECTIONS
        ]
        for worker in self._workers:
            worker.start()

    # ----------------------------------------------------------------------------------- submit
    def submit_backup(
        self,
        op_id: int,
        device_pages: Sequence[int] | torch.Tensor,
        host_slots: Sequence[int] | torch.Tensor,
        *,
        delay: float | None = None,
    ) -> OpHandle:
        """Copy `device_pages[i]` -> `host_slots[i]` asynchronously (queue "d2h").

        On a GPU the copy starts after the work already enqueued on the current stream, so KV
        written by the forward pass is what gets backed up. Raises PageIndexError / OpIdError /
        EngineClosedError without enqueuing anything.
        """
        src, dst, plan = self._checked(D2H, device_pages, host_slots)
        return self._submit(op_id, D2H, src, dst, delay, OpHandle(op_id, D2H, 0), plan)

    def submit_load(
        self,
        op_id: int,
        host_slots: Sequence[int] | torch.Tensor,
        device_pages: Sequence[int] | torch.Tensor,
        *,
        delay: float | None = None,
    ) -> LoadHandle:
        """Copy `host_slots[i]` -> `device_pages[i]` asynchronously, layer by layer (queue "h2d")."""
        src, dst, plan = self._checked(H2D, host_slots, device_pages)
        handle = LoadHandle(op_id, self.device_pool.layout.num_layers)
        self._submit(op_id, H2D, src, dst, delay, handle, plan)
        return handle

    def _checked(
        self, direction: Direction, src_pages: object, dst_pages: object
    ) -> tuple[torch.Tensor, torch.Tensor, RowCopy | None]:
        """Both page lists validated: planned whole by the mover where it can (then no tensors), else
        as checked int64 tensors. Raises PageIndexError."""
        plan = self._mover.plan(direction, src_pages, dst_pages)
        if plan is not None:
            return _NO_PAGES, _NO_PAGES, plan
        dev, host = (self.device_pool, "device_pages"), (self.host_pool, "host_slots")
        (src_pool, src_name), (dst_pool, dst_name) = (dev, host) if direction == D2H else (host, dev)
        src = src_pool.check_pages(src_pages, src_name)  # type: ignore[arg-type]
        return src, dst_pool.check_pages(dst_pages, dst_name), None  # type: ignore[arg-type]

    def _submit(
        self,
        op_id: int,
        direction: Direction,
        src: torch.Tensor,
        dst: torch.Tensor,
        delay: float | None,
        handle: OpHandle,
        plan: RowCopy | None = None,
    ) -> OpHandle:
        if src.numel() != dst.numel():
            raise PageIndexError(f"{src.numel()} source pages but {dst.numel()} destination pages")
        if isinstance(op_id, bool) or not isinstance(op_id, int):
            raise OpIdError(f"op id must be an int, got {op_id!r}")
        seconds = self._delay_for(op_id, delay)
        with self._lock:
            if self._closed:
                raise EngineClosedError("transfer engine is closed")
            if self._last_op_id is not None and op_id <= self._last_op_id:
                raise OpIdError(f"op id {op_id} is not greater than the last one ({self._last_op_id})")
            self._last_op_id = op_id
            self._held[op_id] = handle
            job = _Job(handle, src, dst, self._mover.submit_marker(), plan)
            if seconds > 0:
                thread = threading.Thread(target=self._run_delayed, args=(job, seconds), daemon=True)
                self._delayed.append(thread)
                thread.start()
            else:
                self._work[direction].put(job)
        return handle

    def _delay_for(self, op_id: int, delay: float | None) -> float:
        if delay is None:
            delay = self._delay(op_id) if callable(self._delay) else self._delay
        seconds = float(delay or 0.0)
        if seconds < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {seconds}")
        return seconds

    # -------------------------------------------------------------------------------- execution
    def _worker(self, direction: Direction) -> None:
        torch.set_num_threads(self._threads)  # OpenMP settings are per thread
        work = self._work[direction]
        while (job := work.get()) is not None:
            self._execute(job)

    def _run_delayed(self, job: _Job, seconds: float) -> None:
        torch.set_num_threads(self._threads)
        if not self._closing.wait(seconds):
            self._execute(job)

    def _execute(self, job: _Job) -> None:
        handle = job.handle
        with self._lock:
            if handle.state != "queued":  # cancelled by close()
                return
            handle.state = "running"
        hook = self._before_copy
        op_id = handle.op_id

        def before(layer: int) -> None:
            if hook is not None:
                hook(op_id, layer)

        try:
            if job.plan is not None:
                mover: CpuMover = self._mover  # type: ignore[assignment]  # only a CPU mover plans
                if isinstance(handle, LoadHandle):
                    mover.run_load(job.plan, before, handle._layer_landed)
                else:
                    mover.run_backup(job.plan, before)
            elif isinstance(handle, LoadHandle):
                self._mover.load(job.src, job.dst, before, handle._layer_landed, job.marker)  # type: ignore[arg-type]
            else:
                self._mover.backup(job.src, job.dst, before, job.marker)  # type: ignore[arg-type]
        except Exception as exc:  # a failed copy is a completion, never a dead worker
            handle._finish(False, f"{type(exc).__name__}: {exc}")
        else:
            handle._finish(True, None)

    # ------------------------------------------------------------------------------ completions
    def finished(self) -> list[Completion]:
        """Completions of the ops that finished since the last call, in op id order. Each op is
        reported once; the engine forgets it then (``wait_op`` answers None for it)."""
        with self._lock:
            done = [handle for handle in self._held.values() if handle.done()]
            for handle in done:
                del self._held[handle.op_id]
        return [handle.completion() for handle in done]

    def pending(self) -> int:
        """Ops submitted and not yet reported by ``finished`` (running, queued or finished since)."""
        with self._lock:
            return len(self._held)

    def wait_op(self, op_id: int, timeout: float | None = None) -> Completion | None:
        """Block until op `op_id` finished; return its completion, or None if it was already reported.

        Used by unwind: wait for in-flight copies into a lease's pages before releasing them.
        Raises OpIdError for an id never submitted and TransferTimeoutError on timeout.
        """
        with self._lock:
            handle = self._held.get(op_id)
            if handle is None:
                if self._last_op_id is not None and isinstance(op_id, int) and op_id <= self._last_op_id:
                    return None
                raise OpIdError(f"op {op_id!r} was never submitted")
        return handle.wait(timeout)

    # ------------------------------------------------------------------------------------ close
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting ops, cancel those not started (ok=False) and wait for copies in flight.

        After close no copy writes into either pool, so their memory may be released. Completions
        stay available to `finished`. Idempotent.
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                for handle in self._held.values():
                    if handle.state == "queued":
                        handle._finish(False, "cancelled: transfer engine closed before the copy started")
        self._closing.set()
        deadline = _deadline(timeout)
        for direction in DIRECTIONS:
            self._work[direction].put(None)
        for thread in [*self._workers, *self._delayed]:
            thread.join(_remaining(deadline))
            if thread.is_alive():
                raise TransferTimeoutError(f"transfer thread {thread.name} still copying after {timeout} s")
        if isinstance(self._mover, CudaMover):
            self._mover.synchronize()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
