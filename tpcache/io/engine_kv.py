"""Copies between an engine's own KV blocks and tpcache's host slots (engine-owned device pages).

An engine such as vLLM keeps KV in one tensor per layer, in a layout of its own. ``EngineKV`` sees
each layer as one or more *parts*: 2-D views ``[num_blocks, row]`` in which one block's data of
that part is one contiguous row (vLLM on CPU: one part per layer, K and V side by side; a layout
with K and V apart: two parts per layer). A host page is the concatenation of a block's rows over
every part in order, so a page holds exactly the bytes of one block across all layers, in the
engine's own format (storage keys carry that format, never mixing it with another).

``EngineTransfer`` has the interface of ``TransferEngine`` that the shell drives (submit, finished,
close), so the round, the queues and the shell stay as they are. Outside an engine step its copies
are synchronous: an op is complete, every byte written, when its submit returns. Inside a step
(``begin_step`` .. ``end_step``, ``layered=True``) they are copied layer by layer on a copy thread
(a side CUDA stream on a GPU): a load's layers from its submit on, in layer order, each waited for
by ``wait_layer`` before the engine reads that layer; a save's layer once the engine says the layer
is computed (``layer_computed``), every layer not announced by then at ``end_step``, which returns
only when every copy of the step landed. Either way no copy outlives the step that issued it, so
none is ever left running into a block the engine may reuse; only the agreement on the outcome is
asynchronous, and it comes from the round like every other completion.

A layer's blocks are copied as slices where block ids and host slots run consecutively (a run of
blocks is one contiguous span of a layer-first tensor), else by one batched ``index_select`` /
``index_copy_`` per layer part. Tensor copies release the GIL; the copy thread runs no Python loop
over blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tpcache.io.errors import EngineClosedError, KVLayoutError, OpIdError, PageIndexError, TransferError
from tpcache.io.kv_pool import HostPool
from tpcache.io.transfer import D2H, H2D, Completion, LoadHandle, OpHandle

log = logging.getLogger("tpcache.engine_kv")

CopyHook = Callable[[int, str], None] | None
"""Test hook: called as (op_id, direction) before a copy; if it raises, the op fails (ok=False)."""
AfterCopy = Callable[[int, str, Sequence[int]], None] | None
"""Test hook: called as (op_id, direction, destination pages) after a copy landed."""
HoldHook = Callable[[int, str], bool] | None
"""Test hook: asked on every poll whether a finished op's completion is still withheld (an op that
the engine sees as in flight, as a slow copy on one rank would be)."""
LayerDelay = Callable[[str, int], float] | None
"""Test hook: seconds the copy thread sleeps before copying layer ``layer`` of an op, asked as
(direction, layer) (a slow copy, to show the engine waits for it)."""
MAX_RUNS = 4  # a layer's copy as at most this many slice copies; more runs: one batched indexed copy


@dataclass
class CopyPlan:
    """One op's pages, per KV cache group: (block indices, slot indices, runs or None)."""

    groups: list[tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]] | None]]
    num_pages: int


def _runs(b: torch.Tensor, s: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """Runs of pages whose blocks and slots both go up by one, as (first block, first slot, count);
    None when there are more than ``MAX_RUNS``."""
    n = len(b)
    if n == 0:
        return []
    if n > 1:
        step = ((b[1:] - b[:-1]) != 1) | ((s[1:] - s[:-1]) != 1)
        starts = [0, *(torch.nonzero(step).flatten() + 1).tolist()]
    else:
        starts = [0]
    if len(starts) > MAX_RUNS:
        return None
    bl, sl = b.tolist(), s.tolist()
    ends = [*starts[1:], n]
    return [(bl[i], sl[i], j - i) for i, j in zip(starts, ends, strict=True)]


class EngineKV:
    """An engine's paged KV as ``parts``: 2-D ``[num_blocks, row]`` views sharing its memory.

    With ``groups`` (one per part), the parts belong to block tables of their own (vLLM's KV cache
    groups under its hybrid allocator: one page has a block in each group). A page is then named by
    one int, ``sum(block_g * num_blocks ** g)`` (``page_id``); a group in ``nullable`` may name the
    engine's null block (block 0) for a page it no longer holds: its rows are skipped, neither read
    nor written. A group in ``states`` (a recurrent state kept at some page boundaries) names block
    0 for a page whose state it does not save: a save copies block 0's rows (the engine keeps them
    as no state, see ``tpcache.integrations.vllm.layout``), a load skips them, so the engine's null
    block is never written."""

    def __init__(
        self,
        parts: Sequence[torch.Tensor],
        groups: Sequence[int] | None = None,
        nullable: Sequence[int] = (),
        layers: Sequence[int] | None = None,
        states: Sequence[int] = (),
    ) -> None:
        if not parts:
            raise KVLayoutError("an engine KV needs at least one layer")
        first = parts[0]
        for i, part in enumerate(parts):
            if not isinstance(part, torch.Tensor) or part.dim() != 2:
                raise KVLayoutError(f"engine KV part {i} must be a 2-D [num_blocks, row] tensor view")
            if part.shape[0] != first.shape[0] or part.dtype != first.dtype or part.device != first.device:
                raise KVLayoutError(
                    f"engine KV part {i} is {tuple(part.shape)} {part.dtype} on {part.device}; part 0 is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}: every part needs the same blocks"
                )
            if part.stride(1) != 1:
                raise KVLayoutError(f"engine KV part {i}: a block's row must be contiguous")
        self.parts = list(parts)
        self.num_blocks = int(first.shape[0])
        self.dtype = first.dtype
        self.device = first.device
        self.offsets: list[int] = []  # element offset of each part in a host page
        offset = 0
        for part in self.parts:
            self.offsets.append(offset)
            offset += int(part.shape[1])
        self.page_elems = offset
        self.groups = list(groups) if groups is not None else [0] * len(self.parts)
        if len(self.groups) != len(self.parts) or any(g < 0 for g in self.groups):
            raise KVLayoutError(f"engine KV groups {self.groups}: not one group per part ({len(self.parts)} parts)")
        self.num_groups = max(self.groups) + 1
        if self.num_blocks**self.num_groups > 1 << 63:
            raise KVLayoutError(
                f"{self.num_groups} KV cache groups of {self.num_blocks} blocks: a page names one block of every "
                "group in a 63-bit id, which this many blocks overflow (fewer groups or blocks are served)"
            )
        self.nullable = frozenset(nullable)
        self.states = frozenset(states)
        self.state_flag_part: int | None = None  # the part whose rows say a page carries its state
        # The engine's layer of each part (the unit of copies by layer); default: a part per layer.
        self.part_layers = list(layers) if layers is not None else list(range(len(self.parts)))
        if len(self.part_layers) != len(self.parts) or sorted(set(self.part_layers)) != list(
            range(max(self.part_layers) + 1)
        ):
            raise KVLayoutError(f"engine KV layers {self.part_layers}: not one layer per part, numbered from 0")
        self.num_layers = max(self.part_layers) + 1
        self.layer_parts: list[list[int]] = [[] for _ in range(self.num_layers)]
        for i, layer in enumerate(self.part_layers):
            self.layer_parts[layer].append(i)

    def page_id(self, blocks: Sequence[int]) -> int:
        """The int naming a page whose block in group g is ``blocks[g]``."""
        out = 0
        for b in reversed(blocks):
            out = out * self.num_blocks + b
        return out

    def _group_rows(
        self, b: torch.Tensor, s: torch.Tensor, load: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group: the blocks of the pages ``b`` and the matching slots ``s``, null blocks of a
        nullable group left out (and of a state group, for a load)."""
        if self.num_groups == 1 and not self.nullable and not self.states:
            return [(b, s)]
        out = []
        for g in range(self.num_groups):
            d = (b // self.num_blocks**g) % self.num_blocks
            if g in self.nullable or (load and g in self.states):
                keep = d != 0
                d, sg = d[keep], s[keep]
            else:
                sg = s
            out.append((d, sg))
        return out

    def state_flags(self, host: torch.Tensor, slots: Sequence[int]) -> list[bool]:
        """Per host slot (a page; ``host`` from ``check_host``), whether it carries its recurrent
        state: the first byte of its ``state_flag_part`` row is not 0 (all True without one)."""
        part = self.state_flag_part
        if part is None or not slots:
            return [True] * len(slots)
        index = torch.tensor(list(slots), dtype=torch.int64)
        return [bool(v) for v in host[index, self.offsets[part]].tolist()]

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.dtype.itemsize

    def check_host(self, host: HostPool) -> torch.Tensor:
        """The host pool as ``[slots, page_elems]`` in the engine's dtype; raises if a page differs."""
        if host.layout.page_bytes != self.page_bytes or host.layout.dtype != self.dtype:
            raise KVLayoutError(
                f"host pages of {host.layout.page_bytes} bytes ({host.layout.dtype}) cannot hold an engine block "
                f"of {self.page_bytes} bytes ({self.dtype})"
            )
        if not host.page_first:
            raise KVLayoutError("engine pages need a page_first host pool (a page is one contiguous slot)")
        return host.kv.view(host.num_slots, self.page_elems)

    def _index(self, values: Sequence[int], limit: int, what: str) -> torch.Tensor:
        out = list(values)
        for v in out:
            if isinstance(v, bool) or not isinstance(v, int):
                raise PageIndexError(f"{what} must hold ints, found {v!r}")
            if not 0 <= v < limit:
                raise PageIndexError(f"{what}: index {v} is out of range for {limit}")
        if len(set(out)) != len(out):
            raise PageIndexError(f"{what} names an index twice")
        return torch.tensor(out, dtype=torch.int64)

    def plan(self, host: torch.Tensor, blocks: Sequence[int], slots: Sequence[int], load: bool = False) -> CopyPlan:
        """Page ``blocks[i]`` <-> host slot ``slots[i]``, checked, per group: its block and slot
        indices (block indices on the engine's device) and, where they fall into at most
        ``MAX_RUNS`` runs consecutive in both, those runs as (block, slot, count). ``load``: for a
        copy into the engine's blocks."""
        b, s = self._indices(host, blocks, slots)
        out = []
        for bg, sg in self._group_rows(b, s, load):
            out.append((bg.to(self.device), sg, _runs(bg, sg)))
        return CopyPlan(out, len(blocks))

    def copy_layer(self, host: torch.Tensor, plan: CopyPlan, layer: int, direction: str) -> None:
        """Copy layer ``layer`` of the planned pages: engine -> host (``D2H``) or host -> engine."""
        for i in self.layer_parts[layer]:
            part, offset, (bg, sg, runs) = self.parts[i], self.offsets[i], plan.groups[self.groups[i]]
            if not len(sg):
                continue
            rows = host[:, offset : offset + part.shape[1]]
            if runs is not None:
                for b0, s0, n in runs:
                    if direction == D2H:
                        rows[s0 : s0 + n].copy_(part[b0 : b0 + n])
                    else:
                        part[b0 : b0 + n].copy_(rows[s0 : s0 + n], non_blocking=True)
            elif direction == D2H:
                rows.index_copy_(0, sg, part.index_select(0, bg).to(host.device))
            else:
                part.index_copy_(0, bg, rows.index_select(0, sg).to(self.device, non_blocking=True))

    def layer_equal(self, host: torch.Tensor, plan: CopyPlan, layer: int) -> bool:
        """Whether the planned pages' layer ``layer`` holds the same bytes in the engine and in host
        (tests: a copy checked after it landed)."""
        for i in self.layer_parts[layer]:
            part, offset, (bg, sg, _) = self.parts[i], self.offsets[i], plan.groups[self.groups[i]]
            engine_rows = part.index_select(0, bg).to(host.device)
            if not torch.equal(engine_rows, host[:, offset : offset + part.shape[1]].index_select(0, sg)):
                return False
        return True

    def save(self, host: torch.Tensor, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Copy engine ``blocks[i]`` into host slot ``slots[i]`` (``host`` from ``check_host``)."""
        plan = self.plan(host, blocks, slots)
        for layer in range(self.num_layers):
            self.copy_layer(host, plan, layer, D2H)

    def load(self, host: torch.Tensor, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy host slot ``slots[i]`` into engine block ``blocks[i]``."""
        plan = self.plan(host, blocks, slots, load=True)
        for layer in range(self.num_layers):
            self.copy_layer(host, plan, layer, H2D)

    def fill(self, blocks: Sequence[int], value: float = 0.0, groups: Sequence[int] | None = None) -> None:
        """Overwrite the pages ``blocks`` (only their blocks of ``groups``, if given) with ``value``
        (tests; the state flags stay)."""
        b = self._index(blocks, self.num_blocks**self.num_groups, "engine blocks")
        rows_of = self._group_rows(b, b, load=True)
        for i, (part, g) in enumerate(zip(self.parts, self.groups, strict=True)):
            if (groups is None or g in groups) and i != self.state_flag_part:
                part.index_fill_(0, rows_of[g][0].to(self.device), value)

    def _indices(
        self, host: torch.Tensor, blocks: Sequence[int], slots: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(blocks) != len(slots):
            raise PageIndexError(f"{len(blocks)} engine blocks but {len(slots)} host slots")
        pages = self._index(blocks, self.num_blocks**self.num_groups, "engine blocks")
        return pages, self._index(slots, host.shape[0], "host slots")


@dataclass
class _LayeredOp:
    """An op copied layer by layer within a step."""

    handle: OpHandle
    plan: CopyPlan
    dst: Sequence[int]
    waiting: list[int]  # layers not queued yet (a save's layers wait for the engine to compute them)
    left: int  # layers not landed yet
    failed: str | None = None
    checked: set[int] = field(default_factory=set)  # layers compared after they landed (tests)


@dataclass
class _Step:
    """The copies of one engine step, between ``begin_step`` and ``end_step``."""

    computed: dict[int, torch.cuda.Event | None] = field(default_factory=dict)  # layers the engine computed
    saves: list[_LayeredOp] = field(default_factory=list)
    loads: list[_LayeredOp] = field(default_factory=list)


class EngineTransfer:
    """The transfer engine of engine-owned pages: ``submit_backup`` saves blocks to host slots,
    ``submit_load`` loads host slots into blocks. Completions are reported by op id, once each, as
    with ``TransferEngine``. With ``layered``, ops submitted inside a step are copied by layer on a
    copy thread (see the module docstring)."""

    def __init__(
        self,
        kv: EngineKV,
        host_pool: HostPool,
        *,
        before_copy: CopyHook = None,
        after_copy: AfterCopy = None,
        hold: HoldHook = None,
        layered: bool = False,
        layer_delay: LayerDelay = None,
    ) -> None:
        self.kv = kv
        self._after_copy = after_copy
        self.host_pool = host_pool
        self._host = kv.check_host(host_pool)
        self.host = self._host  # the host pool as [slots, page elements] (read by queries of page bytes)
        self._before_copy = before_copy
        self._hold = hold
        self._lock = threading.Lock()
        self._held: dict[int, OpHandle] = {}  # submitted and not yet reported, by op id
        self._last_op_id: int | None = None
        self._closed = False
        self._num_layers = host_pool.layout.num_layers
        if layered and kv.num_layers != self._num_layers:
            raise KVLayoutError(f"engine KV of {kv.num_layers} layers, host pages of {self._num_layers}")
        self.layered = layered
        self.layer_delay = layer_delay
        self.check = False  # tests: compare the bytes of every layered copy once it landed
        self.counters = {
            "layer_copies": 0,  # layers copied by the copy thread
            "save_layers_by_hook": 0,  # save layers queued as soon as the engine computed the layer
            "save_layers_at_step_end": 0,  # save layers queued at the step's end (no layer hook)
            "load_layer_waits": 0,  # layer waits that found a load's layer not landed yet
            "checked_layers": 0,
            "check_failures": 0,
        }
        self._step: _Step | None = None
        self._cuda = kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(kv.device) if layered and self._cuda else None
        self._jobs: queue.SimpleQueue[tuple[_LayeredOp, int, str, torch.cuda.Event | None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if layered:
            self._threads = torch.get_num_threads()
            self._thread = threading.Thread(target=self._copy_loop, name="tpcache-layer-copies", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ submit

    def submit_backup(self, op_id: int, device_pages: Sequence[int], host_slots: Sequence[int]) -> OpHandle:
        """Copy engine blocks ``device_pages[i]`` -> host ``host_slots[i]`` (queue "d2h"): now, or
        inside a step layer by layer as the engine computes each layer."""
        self._check_blocks(device_pages, host_slots)
        handle = OpHandle(op_id, D2H, 0)
        if self._step is not None:
            return self._submit_layered(handle, device_pages, host_slots, host_slots)
        return self._run(handle, lambda: self.kv.save(self._host, device_pages, host_slots), host_slots)

    def submit_load(self, op_id: int, host_slots: Sequence[int], device_pages: Sequence[int]) -> LoadHandle:
        """Copy host ``host_slots[i]`` -> engine blocks ``device_pages[i]`` (queue "h2d"): now, or
        inside a step layer by layer from now on."""
        self._check_blocks(device_pages, host_slots)
        handle = LoadHandle(op_id, self._num_layers)
        if self._step is not None:
            self._submit_layered(handle, device_pages, host_slots, device_pages)
            return handle

        def copy() -> None:
            self.kv.load(self._host, host_slots, device_pages)
            for layer in range(self._num_layers):
                handle._layer_landed(layer, None)

        self._run(handle, copy, device_pages)
        return handle

    def _check_blocks(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        # Validated before the op is queued: a refused submit changes nothing (the shell reports it).
        self.kv._indices(self._host, blocks, slots)

    def _register(self, handle: OpHandle) -> None:
        op_id = handle.op_id
        if isinstance(op_id, bool) or not isinstance(op_id, int):
            raise OpIdError(f"op id must be an int, got {op_id!r}")
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine transfer is closed")
            if self._last_op_id is not None and op_id <= self._last_op_id:
                raise OpIdError(f"op id {op_id} is not greater than the last one ({self._last_op_id})")
            self._last_op_id = op_id
            self._held[op_id] = handle

    def _run(self, handle: OpHandle, copy: Callable[[], None], dst: Sequence[int]) -> OpHandle:
        self._register(handle)
        op_id = handle.op_id
        try:
            if self._before_copy is not None:
                self._before_copy(op_id, handle.direction)
            copy()
            if self._after_copy is not None:
                self._after_copy(op_id, handle.direction, dst)
        except Exception as exc:  # a failed copy is a completion, reported to the round as such
            handle._finish(False, f"{type(exc).__name__}: {exc}")
        else:
            handle._finish(True, None)
        return handle

    # ------------------------------------------------------------------ copies by layer

    def begin_step(self) -> None:
        """From now until ``end_step``, ops are copied by layer (a no-op unless ``layered``)."""
        if self.layered and not self._closed:
            self._step = _Step()

    def layer_computed(self, layer: int) -> None:
        """The engine wrote layer ``layer`` of this step's KV: start saving it (on a GPU, after the
        work the current stream has queued so far)."""
        step = self._step
        if step is None or layer in step.computed or not 0 <= layer < self._num_layers:
            return
        step.computed[layer] = self._marker()
        for op in step.saves:
            if layer in op.waiting:
                op.waiting.remove(layer)
                self._queue(op, layer, D2H, step.computed[layer])
                self.counters["save_layers_by_hook"] += 1

    def wait_layer(self, layer: int) -> None:
        """Return once layer ``layer`` of every load of this step landed (on a GPU: order the
        current stream after it). A failed load releases its waiter too: its blocks are reported
        failed by the round, and the engine computes them again."""
        step = self._step
        if step is None or not 0 <= layer < self._num_layers:
            return
        for op in step.loads:
            handle = op.handle
            assert isinstance(handle, LoadHandle)
            if not handle._layer_set[layer].is_set():
                self.counters["load_layer_waits"] += 1
            try:
                if self._cuda:
                    handle.stream_wait_layer(layer)
                else:
                    handle.wait_layer(layer)
            except TransferError:
                continue
            if self.check:
                self._check_layer(op, layer)

    def end_step(self) -> None:
        """Queue every save layer the engine did not announce, and return when every copy of the
        step landed (none outlives the step). Ops submitted after this are copied at once."""
        step, self._step = self._step, None
        if step is None:
            return
        marker = self._marker() if any(op.waiting for op in step.saves) else None
        for op in step.saves:
            for layer in op.waiting:
                self._queue(op, layer, D2H, marker)
                self.counters["save_layers_at_step_end"] += 1
            op.waiting = []
        for op in [*step.loads, *step.saves]:
            op.handle._host_done.wait()
        if self._stream is not None:
            self._stream.synchronize()
        if self.check:  # every layer not checked yet (saves; loads no forward pass waited for)
            for op in [*step.loads, *step.saves]:
                if op.failed is None:
                    for layer in range(self._num_layers):
                        self._check_layer(op, layer)

    def _submit_layered(
        self, handle: OpHandle, blocks: Sequence[int], slots: Sequence[int], dst: Sequence[int]
    ) -> OpHandle:
        step = self._step
        assert step is not None
        plan = self.kv.plan(self._host, blocks, slots, load=handle.direction == H2D)
        self._register(handle)
        op = _LayeredOp(handle, plan, dst, [], self._num_layers)
        try:
            if self._before_copy is not None:
                self._before_copy(handle.op_id, handle.direction)
        except Exception as exc:  # noqa: BLE001 - a copy refused before it starts fails its op
            handle._finish(False, f"{type(exc).__name__}: {exc}")
            return handle
        if self.check:  # a copy that had not landed when checked then shows, whatever the blocks held before
            if handle.direction == H2D:
                self.kv.fill(blocks, 0.0)
            else:
                self._host.index_fill_(0, torch.tensor(list(slots), dtype=torch.int64), 0)
        if handle.direction == H2D:
            step.loads.append(op)
            marker = self._marker()
            for layer in range(self._num_layers):
                self._queue(op, layer, H2D, marker)
        else:
            step.saves.append(op)
            for layer in range(self._num_layers):
                if layer in step.computed:
                    self._queue(op, layer, D2H, step.computed[layer])
                    self.counters["save_layers_by_hook"] += 1
                else:
                    op.waiting.append(layer)
        return handle

    def _marker(self) -> torch.cuda.Event | None:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record()  # the current (compute) stream
        return event

    def _queue(self, op: _LayeredOp, layer: int, direction: str, after: torch.cuda.Event | None) -> None:
        self._jobs.put((op, layer, direction, after))

    def _copy_loop(self) -> None:
        torch.set_num_threads(self._threads)
        if self._cuda:
            torch.cuda.set_device(self.kv.device)
        while (job := self._jobs.get()) is not None:
            op, layer, direction, after = job
            event = None
            if op.failed is None:
                try:
                    delay = self.layer_delay(direction, layer) if self.layer_delay is not None else 0.0
                    if delay > 0:
                        time.sleep(delay)
                    if self._stream is not None:
                        with torch.cuda.stream(self._stream):
                            if after is not None:
                                self._stream.wait_event(after)
                            self.kv.copy_layer(self._host, op.plan, layer, direction)
                            event = torch.cuda.Event()
                            event.record(self._stream)
                    else:
                        self.kv.copy_layer(self._host, op.plan, layer, direction)
                    self.counters["layer_copies"] += 1
                except Exception as exc:  # noqa: BLE001 - a failed copy fails its op, never the thread
                    op.failed = f"{type(exc).__name__}: {exc}"
            if op.failed is None and isinstance(op.handle, LoadHandle):
                op.handle._layer_landed(layer, event)
            op.left -= 1
            if op.left == 0:
                self._complete(op, event)

    def _complete(self, op: _LayeredOp, event: torch.cuda.Event | None) -> None:
        handle = op.handle
        if op.failed is None and self._after_copy is not None:
            try:
                if event is not None:
                    event.synchronize()
                self._after_copy(handle.op_id, handle.direction, op.dst)
            except Exception as exc:  # noqa: BLE001
                op.failed = f"{type(exc).__name__}: {exc}"
        if op.failed is not None:
            handle._finish(False, op.failed)
        else:
            handle._finish(True, None, event if handle.direction == D2H else None)

    def _check_layer(self, op: _LayeredOp, layer: int) -> None:
        if layer in op.checked:
            return
        op.checked.add(layer)
        if self._cuda:
            torch.cuda.synchronize(self.kv.device)
        self.counters["checked_layers"] += 1
        if not self.kv.layer_equal(self._host, op.plan, layer):
            self.counters["check_failures"] += 1
            handle = op.handle
            log.error("tpcache: %s op %d: layer %d differs after its copy", handle.direction, handle.op_id, layer)

    # ------------------------------------------------------------------ completions

    def finished(self) -> list[Completion]:
        """Completions of the ops not reported yet, in op id order, except those ``hold`` withholds
        and those still copying."""
        with self._lock:
            done = [
                h
                for h in self._held.values()
                if h.done() and (self._hold is None or not self._hold(h.op_id, h.direction))
            ]
            for handle in done:
                del self._held[handle.op_id]
        return [h.completion() for h in done]

    def pending(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Refuse new ops, let the copies queued finish, stop the copy thread. Idempotent."""
        with self._lock:
            self._closed = True
        if self._step is not None:
            self.end_step()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
            self._thread = None
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)


__all__ = ["H2D", "D2H", "EngineKV", "EngineTransfer"]
