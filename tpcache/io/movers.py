"""The copy back-ends of the transfer engine: CPU (synchronous torch ops on a worker thread) and CUDA.

A mover executes one op on the thread that calls it and reports per-layer progress through
`on_layer(layer, cuda_event_or_None)`. The engine owns ordering, completion and failure handling;
movers only copy. The CPU mover copies rows by byte offset with the native row copy (`native`), or
through torch page tables (`row_copy`) where that was not built; the CUDA mover sees the pools as row
tables (`PagedKV.rows`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from tpcache.io import native
from tpcache.io.kv_pool import DevicePool, HostPool
from tpcache.io.row_copy import CopyPlan, PageTables, Stage

LayerDone = Callable[[int, "torch.cuda.Event | None"], None]
BeforeLayer = Callable[[int], None]


class CpuMover:
    """Both pools on the CPU: copies run synchronously on the calling (worker) thread.

    A backup copies every row of its pages in one call; a load copies the rows of layer 0 of every
    page, then layer 1, ... with one plan shifted per layer. `use_native` picks the native row copy
    (default: wherever it was built) or the torch page-table planner, which gives the same bytes.
    """

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, use_native: bool | None = None) -> None:
        if use_native and not native.AVAILABLE:
            raise RuntimeError("use_native=True but the native row copy was not built (no C compiler at install?)")
        self.dev = device_pool
        self.host = host_pool
        self.native = native.AVAILABLE if use_native is None else use_native
        self._to_host = PageTables.of(device_pool, host_pool)
        to_device = PageTables.of(host_pool, device_pool)
        self._to_device_layers = [to_device.layer(i) for i in range(device_pool.layout.num_layers)]
        self._local = threading.local()  # one staging buffer per copying thread, reused across ops

    def _stage(self) -> Stage:
        stage = getattr(self._local, "stage", None)
        if stage is None:
            stage = self._local.stage = Stage(self.dev.device)
        return stage

    def submit_marker(self) -> None:
        """CPU copies need no stream ordering: the caller's writes are already done."""
        return None

    def plan(self, direction: str, src_pages: object, dst_pages: object) -> native.RowCopy | None:
        """The whole copy, validated and planned in C at submit time, when the native copy is built and
        both page lists are lists or tuples of ints (what the core's effects carry); None otherwise,
        and the engine validates with check_pages. Raises PageIndexError like check_pages."""
        if not self.native or type(src_pages) not in (list, tuple) or type(dst_pages) not in (list, tuple):
            return None
        src_pool, dst_pool = (self.dev, self.host) if direction == "d2h" else (self.host, self.dev)
        if len(src_pages) > src_pool.num_pages or len(dst_pages) > dst_pool.num_pages:
            return None  # cannot be valid: check_pages says why, before anything is allocated
        if direction == "d2h":
            return native.RowCopy.plan(self.dev, src_pages, "device_pages", self.host, dst_pages, "host_slots", True)
        return native.RowCopy.plan(self.host, src_pages, "host_slots", self.dev, dst_pages, "device_pages", False)

    def run_backup(self, rows: native.RowCopy, before: BeforeLayer) -> None:
        before(-1)
        rows.run(self.host.kv, self.dev.kv)

    def run_load(self, rows: native.RowCopy, before: BeforeLayer, on_layer: LayerDone) -> None:
        """A planned load, layer 0's rows shifted to each layer in turn."""
        for layer in range(self.dev.layout.num_layers):
            before(layer)
            rows.run(self.dev.kv, self.host.kv, layer * self.dev.layer_row_stride, layer * self.host.layer_row_stride)
            on_layer(layer, None)

    def backup(self, device_pages: torch.Tensor, host_slots: torch.Tensor, before: BeforeLayer, after: None) -> None:
        """Copy whole pages device -> host."""
        if self.native:
            self.run_backup(native.RowCopy.build(self.dev, device_pages, self.host, host_slots, None), before)
            return
        before(-1)
        CopyPlan.build(device_pages, host_slots, self._to_host.slab_bytes).run(self._to_host, self._stage())

    def load(
        self,
        host_slots: torch.Tensor,
        device_pages: torch.Tensor,
        before: BeforeLayer,
        on_layer: LayerDone,
        after: None,
    ) -> None:
        """Copy pages host -> device layer by layer: layer i of every page, then layer i + 1."""
        if self.native:
            self.run_load(
                native.RowCopy.build(self.host, host_slots, self.dev, device_pages, layer=0), before, on_layer
            )
            return
        plan = CopyPlan.build(host_slots, device_pages, self._to_device_layers[0].slab_bytes)
        stage = self._stage()
        for layer, tables in enumerate(self._to_device_layers):
            before(layer)
            plan.run(tables, stage)
            on_layer(layer, None)


class PinnedStaging:
    """Pinned host buffers reused across ops by one copying thread: ``slots`` buffers taken in turn,
    each grown on demand, and written again only once the copy that last read it has completed."""

    def __init__(self, width: int, dtype: torch.dtype, slots: int) -> None:
        self.width = width
        self.dtype = dtype
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._busy: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def take(self, rows: int) -> tuple[torch.Tensor, int]:
        """A pinned ``[rows, width]`` view and its slot (hand the slot's last reader to ``release``)."""
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        busy = self._busy[i]
        if busy is not None:
            busy.synchronize()
            self._busy[i] = None
        buf = self._bufs[i]
        if buf is None or buf.shape[0] < rows:
            grown = max(rows, 2 * buf.shape[0]) if buf is not None else rows
            buf = torch.empty((grown, self.width), dtype=self.dtype, pin_memory=True)
            self._bufs[i] = buf
        return buf[:rows], i

    def release(self, slot: int, reader: torch.cuda.Event | None) -> None:
        """The slot may be written again once ``reader`` (None: nothing pending) has completed."""
        self._busy[slot] = reader


class CudaMover:
    """Device pool on a GPU, host pool pinned: one stream per direction, an event per loaded layer.

    Only exercised by the gpu-marked tests (GPU machines); the CPU copy planner does not apply here.

    Backups gather the pages on the GPU (on the d2h stream, after the caller's stream reached the
    submit point), copy them to a pinned staging buffer, then scatter into the host slots on the CPU.
    Loads gather each layer into pinned staging on the CPU, copy it to the GPU and scatter it there,
    recording one event per layer so a forward pass can wait for layer i only. The pinned staging is
    allocated once per copying thread and reused (two buffers in turn for loads, so gathering layer
    i + 1 overlaps the upload of layer i).
    """

    def __init__(self, device_pool: DevicePool, host_pool: HostPool) -> None:
        if not host_pool.pinned:
            raise ValueError("a GPU transfer engine needs a pinned host pool (HostPool(pin_memory=True))")
        self.dev = device_pool
        self.host = host_pool
        self.device = device_pool.device
        self.d2h_stream = torch.cuda.Stream(device=self.device)
        self.h2d_stream = torch.cuda.Stream(device=self.device)
        self._local = threading.local()  # per copying thread: its own staging buffers

    def _staging(self, direction: str) -> PinnedStaging:
        staging = getattr(self._local, direction, None)
        if staging is None:
            slots = 1 if direction == "d2h" else 2
            staging = PinnedStaging(self.host.rows.shape[1], self.host.rows.dtype, slots)
            setattr(self._local, direction, staging)
        return staging

    def plan(self, direction: str, src_pages: object, dst_pages: object) -> None:
        """GPU copies are planned on their stream (see backup/load)."""
        return None

    def submit_marker(self) -> torch.cuda.Event:
        """An event on the caller's current stream: the KV written so far is what a backup copies."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def backup(
        self,
        device_pages: torch.Tensor,
        host_slots: torch.Tensor,
        before: BeforeLayer,
        after: torch.cuda.Event | None,
    ) -> None:
        before(-1)
        src = self.dev.row_ids(device_pages)
        dst = self.host.row_ids(host_slots)
        if src.numel() == 0:
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.d2h_stream):
            if after is not None:
                self.d2h_stream.wait_event(after)
            gathered = torch.index_select(self.dev.rows, 0, src.to(self.device))
            pinned, _ = self._staging("d2h").take(gathered.shape[0])
            pinned.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        done.synchronize()
        self.host.rows.index_copy_(0, dst, pinned)  # synchronous: the buffer is free again after it

    def load(
        self,
        host_slots: torch.Tensor,
        device_pages: torch.Tensor,
        before: BeforeLayer,
        on_layer: LayerDone,
        after: torch.cuda.Event | None,
    ) -> None:
        src0 = self.host.row_ids(host_slots, 0)
        if src0.numel() == 0:
            for layer in range(self.dev.layout.num_layers):
                on_layer(layer, None)
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d_stream):
            if after is not None:  # earlier kernels may still read the pages being overwritten
                self.h2d_stream.wait_event(after)
            dst0 = self.dev.row_ids(device_pages, 0).to(self.device)
            staging = self._staging("h2d")
            for layer in range(self.dev.layout.num_layers):
                before(layer)
                pinned, slot = staging.take(src0.numel())
                torch.index_select(self.host.rows, 0, src0 + layer * self.host.layer_row_stride, out=pinned)
                staged = pinned.to(self.device, non_blocking=True)
                self.dev.rows.index_copy_(0, dst0 + layer * self.dev.layer_row_stride, staged)
                event = torch.cuda.Event()
                event.record(self.h2d_stream)
                staging.release(slot, event)  # the upload reads the buffer until this event
                on_layer(layer, event)

    def synchronize(self) -> None:
        """Wait for everything enqueued on both copy streams."""
        self.d2h_stream.synchronize()
        self.h2d_stream.synchronize()
