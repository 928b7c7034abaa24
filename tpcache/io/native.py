"""The native row copy (`_rowcopy`, a small C extension built at install) for CPU page transfers.

One call copies every row of an op with the GIL released: no per-page or per-row dispatch, the next
row prefetched while the current one is copied, and streaming stores for large ops (see the C
source). The extension is optional; `AVAILABLE` is False where it was not built (no C compiler) or
under the reference tree core (``tpcache.core.backend``), and the CPU mover then uses the torch copy
planner (`row_copy`) instead, with the same results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tpcache.core.backend import ROWCOPY
from tpcache.io.errors import PageIndexError
from tpcache.io.kv_pool import PagedKV

_rowcopy = ROWCOPY  # None under the reference tree core, or where not built: the torch planner takes over

AVAILABLE = _rowcopy is not None

# Ops moving at least this much write with streaming stores: their destination is far larger than
# the caches, so reading each line before writing it (what a normal store does) is wasted traffic.
STREAM_BYTES = 1 << 20


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("native row copies need contiguous CPU tensors")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def _row_terms(pool: PagedKV, layer: int | None) -> np.ndarray:
    """Row offsets (in rows) of the rows a copy moves within one page: every (layer, K/V) of the page,
    or those of one layer."""
    layers = np.arange(pool.layout.num_layers, dtype=np.int64) if layer is None else np.array([layer], np.int64)
    kv = np.arange(2, dtype=np.int64) * pool.kv_row_stride
    return (layers[:, None] * pool.layer_row_stride + kv[None, :]).reshape(-1)


@dataclass(frozen=True)
class RowCopy:
    """The rows of pages src_pages[i] -> dst_pages[i] between two pools, as byte offsets in the order
    the source lies in memory (pages sorted, rows in the source's own layout order): reads then
    sweep each source block forwards, which keeps the prefetcher busy, while streaming stores make
    the scattered writes cheap. Built once per op; a load runs it once per layer with that layer's
    row deltas."""

    src: np.ndarray
    dst: np.ndarray
    row_bytes: int

    @classmethod
    def build(
        cls, src_pool: PagedKV, src_pages: torch.Tensor, dst_pool: PagedKV, dst_pages: torch.Tensor, layer: int | None
    ) -> RowCopy:
        """`layer`: None for whole pages, else only the rows of that layer (shift with `run`'s deltas)."""
        order = np.argsort(src_pages.numpy(), kind="stable")
        src_sorted, dst_sorted = src_pages.numpy()[order], dst_pages.numpy()[order]
        src = src_sorted[:, None] * src_pool.page_row_stride + _row_terms(src_pool, layer)[None, :]
        dst = dst_sorted[:, None] * dst_pool.page_row_stride + _row_terms(dst_pool, layer)[None, :]
        if not src_pool.page_first:  # a layer-first source lies row block by row block
            src, dst = src.T, dst.T
        row_bytes = src_pool.layout.row_bytes
        return cls(
            np.ascontiguousarray(src).reshape(-1) * row_bytes,
            np.ascontiguousarray(dst).reshape(-1) * row_bytes,
            row_bytes,
        )

    @classmethod
    def plan(
        cls,
        src_pool: PagedKV,
        src_pages: Sequence[int],
        src_what: str,
        dst_pool: PagedKV,
        dst_pages: Sequence[int],
        dst_what: str,
        whole_pages: bool,
    ) -> RowCopy:
        """``build`` from two lists of ints (whole pages, or layer 0's rows, which a load shifts to
        each layer), validated as ``PagedKV.check_pages`` would (same errors, same order) in C: one
        pass over the ints and no torch op, which is most of what a small transfer costs. Raises
        PageIndexError."""
        if _rowcopy is None:
            raise RuntimeError("the native row copy was not built (see tpcache/io/native.py)")
        layers = src_pool.layout.num_layers if whole_pages else 1
        rows = len(src_pages) * 2 * layers
        src, dst = np.empty(rows, np.int64), np.empty(rows, np.int64)
        problem = _rowcopy.plan_rows(
            src_pages,
            dst_pages,
            src_pool.num_pages,
            dst_pool.num_pages,
            _geometry(src_pool),
            _geometry(dst_pool),
            layers,
            src_pool.layout.row_bytes,
            src,
            dst,
        )
        if problem is not None:
            raise _page_error(problem, (src_pool, src_pages, src_what), (dst_pool, dst_pages, dst_what))
        return cls(src, dst, src_pool.layout.row_bytes)

    def run(self, dst: torch.Tensor, src: torch.Tensor, dst_delta_rows: int = 0, src_delta_rows: int = 0) -> None:
        """Copy every row from tensor `src` to tensor `dst` (the pools' whole KV tensors)."""
        if _rowcopy is None:
            raise RuntimeError("the native row copy was not built (see tpcache/io/native.py)")
        if self.dst.size == 0:
            return
        dst_addr, dst_size = _span(dst)
        src_addr, src_size = _span(src)
        _rowcopy.copy_rows(
            dst_addr,
            dst_size,
            self.dst,
            src_addr,
            src_size,
            self.src,
            self.row_bytes,
            dst_delta_rows * self.row_bytes,
            src_delta_rows * self.row_bytes,
            self.dst.size * self.row_bytes >= STREAM_BYTES,
        )


def _geometry(pool: PagedKV) -> tuple[int, int, int, int]:
    return pool.page_row_stride, pool.layer_row_stride, pool.kv_row_stride, int(pool.page_first)


def _page_error(problem: tuple, *sides: tuple[PagedKV, Sequence[int], str]) -> PageIndexError:
    """The PageIndexError check_pages (or the engine's length check) raises for ``problem``."""
    what = problem[0]
    if what == "len":
        return PageIndexError(f"{problem[1]} source pages but {problem[2]} destination pages")
    pool, pages, name = sides[problem[1]]
    if what == "type":
        return PageIndexError(f"{name} must hold ints, found {pages[problem[2]]!r}"[:200])
    if what == "range":
        return pool.range_error(name, problem[2])
    return pool.duplicate_error(name, problem[2])
