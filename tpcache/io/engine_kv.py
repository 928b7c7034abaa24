"""Copies between an engine's own KV blocks and tpcache's host slots (engine-owned device pages).

An engine such as vLLM keeps KV in one tensor per layer, in a layout of its own. ``EngineKV`` sees
each layer as one or more *parts*: 2-D views ``[num_blocks, row]`` in which one block's data of
that part is one contiguous row (vLLM on CPU: one part per layer, K and V side by side; a layout
with K and V apart: two parts per layer). A host page is the concatenation of a block's rows over
every part in order, so a page holds exactly the bytes of one block across all layers, in the
engine's own format (storage keys carry that format, never mixing it with another).

``EngineTransfer`` has the interface of ``TransferEngine`` that the shell drives (submit, finished,
close), so the round, the queues and the shell stay as they are. Its copies are synchronous:
an op is complete, every byte written, when its submit returns. An engine hook that issues a
copy therefore never leaves one running into a block it may reuse; only the agreement on the
outcome is asynchronous, and it comes from the round like every other completion.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from tpcache.io.errors import EngineClosedError, KVLayoutError, OpIdError, PageIndexError
from tpcache.io.kv_pool import HostPool
from tpcache.io.transfer import D2H, H2D, Completion, LoadHandle, OpHandle

CopyHook = Callable[[int, str], None] | None
"""Test hook: called as (op_id, direction) before a copy; if it raises, the op fails (ok=False)."""
AfterCopy = Callable[[int, str, Sequence[int]], None] | None
"""Test hook: called as (op_id, direction, destination pages) after a copy landed."""
HoldHook = Callable[[int, str], bool] | None
"""Test hook: asked on every poll whether a finished op's completion is still withheld (an op that
the engine sees as in flight, as a slow copy on one rank would be)."""


class EngineKV:
    """An engine's paged KV as ``parts``: 2-D ``[num_blocks, row]`` views sharing its memory.

    With ``groups`` (one per part), the parts belong to block tables of their own (vLLM's KV cache
    groups under its hybrid allocator: one page has a block in each group). A page is then named by
    one int, ``sum(block_g * num_blocks ** g)`` (``page_id``); a group in ``nullable`` may name the
    engine's null block (block 0) for a page it no longer holds: its rows are skipped, neither read
    nor written."""

    def __init__(
        self, parts: Sequence[torch.Tensor], groups: Sequence[int] | None = None, nullable: Sequence[int] = ()
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

    def page_id(self, blocks: Sequence[int]) -> int:
        """The int naming a page whose block in group g is ``blocks[g]``."""
        out = 0
        for b in reversed(blocks):
            out = out * self.num_blocks + b
        return out

    def _group_rows(self, b: torch.Tensor, s: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group: the blocks of the pages ``b`` and the matching slots ``s``, null blocks of a
        nullable group left out."""
        if self.num_groups == 1 and not self.nullable:
            return [(b, s)]
        out = []
        for g in range(self.num_groups):
            d = (b // self.num_blocks**g) % self.num_blocks
            if g in self.nullable:
                keep = d != 0
                d, sg = d[keep], s[keep]
            else:
                sg = s
            out.append((d, sg))
        return out

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

    def save(self, host: torch.Tensor, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Copy engine ``blocks[i]`` into host slot ``slots[i]`` (``host`` from ``check_host``)."""
        b, s = self._indices(host, blocks, slots)
        rows_of = self._group_rows(b, s)
        for part, offset, g in zip(self.parts, self.offsets, self.groups, strict=True):
            bg, sg = rows_of[g]
            rows = part.index_select(0, bg.to(self.device))
            host[:, offset : offset + part.shape[1]].index_copy_(0, sg, rows.to(host.device))

    def load(self, host: torch.Tensor, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy host slot ``slots[i]`` into engine block ``blocks[i]``."""
        b, s = self._indices(host, blocks, slots)
        rows_of = self._group_rows(b, s)
        for part, offset, g in zip(self.parts, self.offsets, self.groups, strict=True):
            bg, sg = rows_of[g]
            rows = host[:, offset : offset + part.shape[1]].index_select(0, sg)
            part.index_copy_(0, bg.to(self.device), rows.to(self.device, non_blocking=True))

    def fill(self, blocks: Sequence[int], value: float = 0.0, groups: Sequence[int] | None = None) -> None:
        """Overwrite the pages ``blocks`` (only their blocks of ``groups``, if given) with ``value`` (tests)."""
        b = self._index(blocks, self.num_blocks**self.num_groups, "engine blocks")
        rows_of = self._group_rows(b, b)
        for part, g in zip(self.parts, self.groups, strict=True):
            if groups is None or g in groups:
                part.index_fill_(0, rows_of[g][0].to(self.device), value)

    def _indices(
        self, host: torch.Tensor, blocks: Sequence[int], slots: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(blocks) != len(slots):
            raise PageIndexError(f"{len(blocks)} engine blocks but {len(slots)} host slots")
        pages = self._index(blocks, self.num_blocks**self.num_groups, "engine blocks")
        return pages, self._index(slots, host.shape[0], "host slots")


class EngineTransfer:
    """The transfer engine of engine-owned pages: ``submit_backup`` saves blocks to host slots,
    ``submit_load`` loads host slots into blocks. Completions are reported by op id, once each, as
    with ``TransferEngine``."""

    def __init__(
        self,
        kv: EngineKV,
        host_pool: HostPool,
        *,
        before_copy: CopyHook = None,
        after_copy: AfterCopy = None,
        hold: HoldHook = None,
    ) -> None:
        self.kv = kv
        self._after_copy = after_copy
        self.host_pool = host_pool
        self._host = kv.check_host(host_pool)
        self._before_copy = before_copy
        self._hold = hold
        self._lock = threading.Lock()
        self._held: dict[int, OpHandle] = {}  # submitted and not yet reported, by op id
        self._last_op_id: int | None = None
        self._closed = False
        self._num_layers = host_pool.layout.num_layers

    def submit_backup(self, op_id: int, device_pages: Sequence[int], host_slots: Sequence[int]) -> OpHandle:
        """Copy engine blocks ``device_pages[i]`` -> host ``host_slots[i]`` now (queue "d2h")."""
        self._check_blocks(device_pages, host_slots)
        handle = OpHandle(op_id, D2H, 0)
        return self._run(handle, lambda: self.kv.save(self._host, device_pages, host_slots), host_slots)

    def submit_load(self, op_id: int, host_slots: Sequence[int], device_pages: Sequence[int]) -> LoadHandle:
        """Copy host ``host_slots[i]`` -> engine blocks ``device_pages[i]`` now (queue "h2d")."""
        self._check_blocks(device_pages, host_slots)
        handle = LoadHandle(op_id, self._num_layers)

        def copy() -> None:
            self.kv.load(self._host, host_slots, device_pages)
            for layer in range(self._num_layers):
                handle._layer_landed(layer, None)

        self._run(handle, copy, device_pages)
        return handle

    def _check_blocks(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        # Validated before the op is queued: a refused submit changes nothing (the shell reports it).
        self.kv._indices(self._host, blocks, slots)

    def _run(self, handle: OpHandle, copy: Callable[[], None], dst: Sequence[int]) -> OpHandle:
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

    def finished(self) -> list[Completion]:
        """Completions of the ops not reported yet, in op id order, except those ``hold`` withholds."""
        with self._lock:
            done = [h for h in self._held.values() if self._hold is None or not self._hold(h.op_id, h.direction)]
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
        """Refuse new ops. Nothing is ever left copying (copies are synchronous). Idempotent."""
        with self._lock:
            self._closed = True
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)


__all__ = ["H2D", "D2H", "EngineKV", "EngineTransfer"]
