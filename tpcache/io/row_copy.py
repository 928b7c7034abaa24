"""Batched page copies between two page tables on one device, planned once per op.

A *page table* is a strided view `[pages, rows, row_elems]` of a pool (`page_table`): entry p is
the slab of page p (all 2L rows for a backup, the 2 rows of one layer for a load). The plan sorts
the (src, dst) pairs by destination and splits them so each byte is read and written once wherever
torch has a single-pass op for the pattern:

- slice runs: source and destination both consecutive -> one `copy_` of a slice;
- gather runs: destination consecutive, source not -> one `index_select(out=dst slice)`, which copies
  slab by slab into the strided destination (no temporary);
- singles (isolated destinations): one `copy_` per pair when a slab is large enough to amortise the
  per-call cost of a torch op (microseconds); smaller slabs go through a small cache-resident staging
  buffer (`index_select` gather, then `index_copy_` scatter), which costs a second pass but far fewer
  calls. `scripts/bench_transfer.py --copier torch` measures where the threshold pays.

Whatever the method, scattered small granules stay below a contiguous copy: each row restarts the
hardware prefetcher. A row here is a page's K (or V) block of one layer.

Plans are computed once per op; a load reuses its plan for every layer by passing that layer's
slab views. Torch ops release the GIL, so copies on a worker thread run in parallel with the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpcache.io.kv_pool import PagedKV

# A slab at least this large is copied pair by pair (one pass); smaller ones through staging.
PAIR_COPY_BYTES = 64 << 10
# A run of pages consecutive on the destination side is copied in one op when it moves at least this
# much (below, one op per run costs more than staging its rows); with pair copies any run of 2 is.
RUN_BYTES = 128 << 10
# Staging chunk of the two-pass path: large enough to amortise op overhead, small enough to stay cached.
STAGE_BYTES = 2 << 20

_COPY_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
# index_copy_ moves one element per step, so the widest container wins; complex128 is used purely as
# a 16-byte container: copies never do arithmetic on it, so every bit pattern is preserved.
_SCATTER_DTYPES = (torch.complex128, *_COPY_DTYPES)


def _tiling_dtype(candidates: tuple[torch.dtype, ...], row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest candidate whose size divides a row and the address of every tensor."""
    for dtype in candidates:
        size = dtype.itemsize
        if row_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


def _flat(pool: PagedKV, dtype: torch.dtype) -> torch.Tensor:
    return pool.kv.view(-1).view(torch.uint8).view(dtype)


def page_table(pool: PagedKV, dtype: torch.dtype) -> torch.Tensor:
    """A view [pages, 2 * layers, row_elems] of `pool` in `dtype` (no copy); row 2l + kv is (layer l, K/V).

    Page-first pools give a contiguous view, layer-first pools a strided one (rows `pages` apart).
    """
    rows, elems = 2 * pool.layout.num_layers, pool.layout.row_bytes // dtype.itemsize
    if pool.page_first:
        return _flat(pool, dtype).view(pool.num_pages, rows, elems)
    return _flat(pool, dtype).view(rows, pool.num_pages, elems).transpose(0, 1)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i."""
    foreach_copy = getattr(torch, "_foreach_copy_", None)  # private; absent from some older builds
    if foreach_copy is not None:
        foreach_copy(dst, src)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


@dataclass(frozen=True)
class Side:
    """One pool as a copy sees it: its slabs (page table rows first_row .. first_row + k - 1) and, for
    the staged path, its flat row table, where (page p, slab row r) is row p * page_stride + r * row_stride.
    """

    slabs: torch.Tensor  # [pages, k, row_elems], strided view in the copy dtype
    rows: torch.Tensor  # [all rows, row_elems'], contiguous view in the scatter dtype
    page_stride: int
    row_stride: int
    first_row: int

    @classmethod
    def of(cls, pool: PagedKV, copy: torch.dtype, scatter: torch.dtype) -> Side:
        rows = _flat(pool, scatter).view(-1, pool.layout.row_bytes // scatter.itemsize)
        return cls(page_table(pool, copy), rows, pool.page_row_stride, pool.kv_row_stride, 0)

    def layer(self, layer: int) -> Side:
        """The slabs of one layer: [pages, 2 (K, V), row_elems]."""
        first = 2 * layer
        return Side(self.slabs[:, first : first + 2], self.rows, self.page_stride, self.row_stride, first)

    def row_ids(self, pages: torch.Tensor) -> torch.Tensor:
        """Row numbers of the slab rows of `pages`, page-major, less `row_offset` (the same for every
        layer, so a load computes them once)."""
        offsets = torch.arange(self.slabs.shape[1]) * self.row_stride
        return (pages[:, None] * self.page_stride + offsets[None, :]).reshape(-1)

    @property
    def row_offset(self) -> int:
        return self.first_row * self.row_stride


@dataclass(frozen=True)
class PageTables:
    """The two sides of a copy between two pools with the same layout (dtypes chosen for both)."""

    src: Side
    dst: Side
    row_bytes: int

    @classmethod
    def of(cls, src: PagedKV, dst: PagedKV) -> PageTables:
        row_bytes = src.layout.row_bytes
        copy = _tiling_dtype(_COPY_DTYPES, row_bytes, src.kv, dst.kv)
        scatter = _tiling_dtype(_SCATTER_DTYPES, row_bytes, src.kv, dst.kv)
        return cls(Side.of(src, copy, scatter), Side.of(dst, copy, scatter), row_bytes)

    def layer(self, layer: int) -> PageTables:
        """The tables restricted to the K and V rows of one layer."""
        return PageTables(self.src.layer(layer), self.dst.layer(layer), self.row_bytes)

    @property
    def slab_bytes(self) -> int:
        return self.src.slabs.shape[1] * self.row_bytes


class Stage:
    """A reusable staging buffer for the two-pass path (one per copying thread)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer = torch.empty(0, dtype=torch.uint8, device=device)

    def get(self, nbytes: int) -> torch.Tensor:
        """At least `nbytes` bytes, 16-byte aligned (the allocator aligns far more)."""
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer


@dataclass
class CopyPlan:
    """How to copy page src[i] -> page dst[i] of two page tables (see the module docstring)."""

    slices: list[tuple[int, int, int]] = field(default_factory=list)  # (src_start, dst_start, length)
    gathers: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (src pages, dst_start)
    single_src: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    single_dst: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    num_pages: int = 0
    pair_copies: bool = False  # singles are copied pair by pair (else through the stage)
    _pair_src: list[int] = field(default_factory=list, repr=False)  # the singles as ints, for pair copies
    _pair_dst: list[int] = field(default_factory=list, repr=False)
    _staged: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, src: torch.Tensor, dst: torch.Tensor, slab_bytes: int) -> CopyPlan:
        """Plan copying pages `src` to pages `dst` (1-D int64 CPU tensors of equal length, dst unique)
        for slabs of `slab_bytes` (the plan is valid for any slab size, `slab_bytes` only tunes it)."""
        plan = cls(num_pages=int(src.numel()), pair_copies=slab_bytes >= PAIR_COPY_BYTES)
        if plan.num_pages == 0:
            return plan
        dst_sorted, order = torch.sort(dst)
        src_sorted = src[order]
        zero = torch.zeros(1, dtype=torch.int64)
        # runs: maximal stretches where the destination is consecutive
        starts = torch.cat([zero, torch.nonzero(dst_sorted[1:] != dst_sorted[:-1] + 1).reshape(-1) + 1])
        ends = torch.cat([starts[1:], torch.tensor([plan.num_pages])])
        lengths = ends - starts
        # a run is a plain slice when its sources are consecutive too (no source break inside it)
        src_breaks = torch.cat([zero, (src_sorted[1:] != src_sorted[:-1] + 1).cumsum(0)])
        src_consecutive = src_breaks[ends - 1] == src_breaks[starts]
        is_run = lengths >= (2 if plan.pair_copies else max(2, -(-RUN_BYTES // slab_bytes)))
        is_slice = is_run & src_consecutive
        for start, length in zip(starts[is_slice].tolist(), lengths[is_slice].tolist(), strict=True):
            plan.slices.append((int(src_sorted[start]), int(dst_sorted[start]), length))
        is_gather = is_run & ~src_consecutive
        for start, length in zip(starts[is_gather].tolist(), lengths[is_gather].tolist(), strict=True):
            plan.gathers.append((src_sorted[start : start + length], int(dst_sorted[start])))
        single = ~is_run.repeat_interleave(lengths)
        plan.single_src, plan.single_dst = src_sorted[single], dst_sorted[single]
        if plan.pair_copies:
            plan._pair_src, plan._pair_dst = plan.single_src.tolist(), plan.single_dst.tolist()
        return plan

    def run(self, tables: PageTables, stage: Stage) -> None:
        """Copy every planned page from `tables.src` to `tables.dst`."""
        src, dst = tables.src.slabs, tables.dst.slabs
        for s, d, n in self.slices:
            dst[d : d + n].copy_(src[s : s + n])
        for s_idx, d in self.gathers:
            torch.index_select(src, 0, s_idx, out=dst[d : d + s_idx.numel()])
        if self.single_dst.numel() == 0:
            return
        if self.pair_copies:
            # one C++ loop of copy_ calls: about half the per-pair cost of a Python loop
            _copy_all([dst[d] for d in self._pair_dst], [src[s] for s in self._pair_src])
        else:
            self._run_staged(tables, stage)

    def _run_staged(self, tables: PageTables, stage: Stage) -> None:
        """Row by row through the stage: index_select and index_copy_ on contiguous row tables take
        their per-row fast paths, which beat per-slab kernel calls for small slabs."""
        src, dst = tables.src, tables.dst
        src_ids, dst_ids = self._staged_rows(src, dst)
        if src.row_offset or dst.row_offset:
            src_ids, dst_ids = src_ids + src.row_offset, dst_ids + dst.row_offset
        chunk = max(1, STAGE_BYTES // tables.row_bytes)
        count = min(chunk, src_ids.numel())
        nbytes = count * tables.row_bytes
        buffer = stage.get(nbytes)[:nbytes].view(src.rows.dtype).view(count, src.rows.shape[1])
        for s_idx, d_idx in zip(src_ids.split(chunk), dst_ids.split(chunk), strict=True):
            rows = buffer[: s_idx.numel()]
            torch.index_select(src.rows, 0, s_idx, out=rows)
            dst.rows.index_copy_(0, d_idx, rows)

    def _staged_rows(self, src: Side, dst: Side) -> tuple[torch.Tensor, torch.Tensor]:
        """Row numbers (less the row offsets) of the singles, sorted by destination row; computed once
        per op, since every layer of a load has the same ones."""
        key = (src.slabs.shape[1], src.page_stride, src.row_stride, dst.page_stride, dst.row_stride)
        if self._staged is None or self._staged[0] != key:
            # ascending destination rows: the scatter then walks each row block forwards
            dst_ids, order = torch.sort(dst.row_ids(self.single_dst))
            self._staged = (key, src.row_ids(self.single_src)[order], dst_ids)
        return self._staged[1], self._staged[2]
