"""Paged KV pools as torch tensors: the device tier (L1) and the host tier (L2) of one TP rank.

A page holds `page_size` tokens of K and V for every layer, for this rank's shard of the KV heads only.
Its canonical byte order (what `read_page`/`write_page` and `HostPool.page_view` use) is layer-major:
for each layer, K then V, each `[page_size, heads_per_rank, head_dim]`. The same page therefore has the
same bytes in every pool and every host layout, which is what lets tests and storage compare them.

Transfers see each pool as a 2-D table of *rows*: one row is the K (or V) block of one layer of one page
(`KVLayout.row_bytes`), and `row_ids` maps (page, layer, K/V) to a row number. Both layouts are affine in
that mapping, so a copy plan computed for layer 0 serves every layer by adding a constant.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tpcache.io.errors import KVLayoutError, PageIndexError
from tpcache.io.memory import PoolMemoryError, check_fits, format_bytes

HostLayout = Literal["layer_first", "page_first"]
HOST_LAYOUTS: tuple[str, ...] = ("layer_first", "page_first")

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its name ("bfloat16", "float16", "bf16", ...)."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        resolved = _DTYPE_ALIASES.get(name) or getattr(torch, name, None)
        if not isinstance(resolved, torch.dtype):
            raise KVLayoutError(f"unknown KV dtype name {dtype!r} (try 'bfloat16', 'float16' or 'float32')")
    else:
        raise KVLayoutError(f"KV dtype must be a torch.dtype or a name, not {type(dtype).__name__}")
    if resolved is torch.bool or resolved.is_complex:
        raise KVLayoutError(f"KV dtype {resolved} is not a KV cache element type")
    return resolved


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KVLayoutError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class KVLayout:
    """Shape of this rank's KV shard per page. Immutable; `dtype` is normalised to a torch.dtype."""

    num_layers: int
    heads_per_rank: int
    head_dim: int
    dtype: torch.dtype
    page_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "heads_per_rank", "head_dim", "page_size"):
            _positive_int(name, getattr(self, name))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    @classmethod
    def from_model(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        tp_size: int,
        dtype: torch.dtype | str = torch.bfloat16,
        page_size: int = 16,
        *,
        pp_size: int = 1,
        cp_size: int = 1,
    ) -> KVLayout:
        """The layout of one rank's shard: the KV heads are split evenly over `tp_size` ranks and,
        with `pp_size` pipeline stages, the layers evenly over the stages (each rank holds its
        stage's `num_layers / pp_size`); with `cp_size` context ranks each holds `page_size /
        cp_size` tokens of every `page_size`-token page."""
        _positive_int("num_layers", num_layers)
        _positive_int("num_kv_heads", num_kv_heads)
        _positive_int("tp_size", tp_size)
        _positive_int("page_size", page_size)
        if num_kv_heads % tp_size:
            raise KVLayoutError(
                f"{num_kv_heads} KV heads cannot be split evenly over tp_size={tp_size} ranks "
                "(replicated KV heads are not supported)"
            )
        if num_layers % _positive_int("pp_size", pp_size):
            raise KVLayoutError(f"{num_layers} layers cannot be split evenly over pp_size={pp_size} pipeline stages")
        if page_size % _positive_int("cp_size", cp_size):
            raise KVLayoutError(f"a {page_size}-token page cannot be split evenly over cp_size={cp_size} context ranks")
        return cls(num_layers // pp_size, num_kv_heads // tp_size, head_dim, dtype, page_size // cp_size)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of the K (or V) block of one layer of one page."""
        return self.page_size * self.heads_per_rank * self.head_dim * self.itemsize

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of K and V of one layer of one page."""
        return 2 * self.row_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole page (all layers, K and V) on this rank."""
        return self.num_layers * self.layer_page_bytes

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Canonical shape of one page: [layers, 2 (K, V), page_size, heads, head_dim]."""
        return (self.num_layers, 2, self.page_size, self.heads_per_rank, self.head_dim)

    @property
    def token_shape(self) -> tuple[int, int, int]:
        return (self.page_size, self.heads_per_rank, self.head_dim)


def state_layout(num_layers: int, bytes_per_layer: int) -> KVLayout:
    """The layout of a recurrent-state (Mamba) pool: one slot holds one state of every recurrent
    layer on this rank, ``bytes_per_layer`` bytes each (its conv and SSM state, packed by the
    engine), as two equal rows per layer so the transfer engine moves it like a page."""
    if bytes_per_layer <= 0 or bytes_per_layer % 2:
        raise KVLayoutError(f"a layer's state must be a positive, even number of bytes, got {bytes_per_layer}")
    return KVLayout(num_layers, 1, bytes_per_layer // 2, torch.uint8, 1)


def _wide_dtype(tensor: torch.Tensor, row_bytes: int) -> torch.dtype:
    """The widest element type that tiles a row and the tensor's alignment.

    Transfers only move bytes, and torch's scatter kernels run per element, so copying 16-byte
    elements is several times faster than 2-byte ones. complex128 is used purely as a 16-byte
    container: copies never do arithmetic on it, so every bit pattern is preserved.
    """
    address = tensor.data_ptr()
    for dtype in (torch.complex128, torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if row_bytes % size == 0 and address % size == 0:
            return dtype
    return torch.uint8


_INT_ONLY = frozenset((int,))


def _tensor_index(values: torch.Tensor, what: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from an integer tensor."""
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype is torch.bool:
        raise PageIndexError(f"{what} must hold integers, got a {values.dtype} tensor")
    if values.dim() != 1:
        raise PageIndexError(f"{what} must be 1-D, got shape {tuple(values.shape)}")
    return values.to(device="cpu", dtype=torch.int64)


_EMPTY = torch.empty(0, dtype=torch.int64)


def _int_array(values: Sequence[int], what: str) -> array:
    """``values`` as array('q'); refuses anything but a sequence of plain ints."""
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(values, Sequence):
        raise PageIndexError(f"{what} must be a sequence of ints, got {type(values).__name__}")
    # Plain ints only (no bools, floats, numpy scalars), checked and converted in C: map/set over
    # the element types, then array('q'), which also refuses values past int64.
    packed = None
    if set(map(type, values)) <= _INT_ONLY:
        with contextlib.suppress(OverflowError):
            packed = array("q", values)
    if packed is None:
        bad = [v for v in values if type(v) is not int or v.bit_length() > 63]
        raise PageIndexError(f"{what} must hold ints, found {bad[0]!r}"[:200])
    return packed


class PagedKV:
    """Common part of the device and host pools: a KV tensor, its row table and page accessors."""

    kind = "pool"

    def __init__(self, layout: KVLayout, tensor: torch.Tensor, num_pages: int, page_first: bool) -> None:
        self.layout = layout
        self.kv = tensor
        self.num_pages = num_pages
        self.page_first = page_first
        L = layout.num_layers
        if page_first:  # [pages, layers, 2, ...]: a page's 2L rows are consecutive
            self.page_row_stride, self.layer_row_stride, self.kv_row_stride = 2 * L, 2, 1
        else:  # [layers, 2, pages, ...]: a (layer, K/V) block of all pages is consecutive
            self.page_row_stride, self.layer_row_stride, self.kv_row_stride = 1, 2 * num_pages, num_pages
        self.row_dtype = _wide_dtype(tensor, layout.row_bytes)
        row_elems = layout.row_bytes // self.row_dtype.itemsize
        self.rows = tensor.view(-1).view(torch.uint8).view(self.row_dtype).view(-1, row_elems)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def check_pages(self, pages: Sequence[int] | torch.Tensor, what: str = "pages") -> torch.Tensor:
        """Validate a page list (ints, in range, no duplicates) and return it as an int64 CPU tensor."""
        if not isinstance(pages, torch.Tensor):
            # a list (what the core's effects carry): checked with C-level builtins, no torch op
            packed = _int_array(pages, what)
            if not packed:
                return _EMPTY
            self.check_range(what, min(pages), max(pages))  # over the caller's ints: no boxing
            if len(set(pages)) != len(packed):
                seen: set[int] = set()
                dup = next(v for v in pages if v in seen or seen.add(v))  # type: ignore[func-returns-value]
                raise self.duplicate_error(what, dup)
            return torch.frombuffer(packed, dtype=torch.int64)
        index = _tensor_index(pages, what)
        if index.numel() == 0:
            return index
        self.check_range(what, int(index.min()), int(index.max()))
        if torch.unique(index).numel() != index.numel():
            values, counts = torch.unique(index, return_counts=True)
            raise self.duplicate_error(what, int(values[counts > 1][0]))
        return index

    def check_range(self, what: str, low: int, high: int) -> None:
        """Raise for the lowest index if negative, else the highest if past the pool."""
        if low < 0 or high >= self.num_pages:
            raise self.range_error(what, low if low < 0 else high)

    def range_error(self, what: str, index: int) -> PageIndexError:
        return PageIndexError(f"{what}: index {index} is out of range for a {self.kind} of {self.num_pages}")

    @staticmethod
    def duplicate_error(what: str, index: int) -> PageIndexError:
        return PageIndexError(f"{what}: index {index} appears more than once")

    def row_ids(self, pages: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Row numbers of `pages` (validated int64) in canonical order.

        layer=None: [pages, layers, K/V] flattened (whole pages); layer=i: [pages, K/V] of layer i.
        """
        base = pages * self.page_row_stride
        kv = torch.arange(2, dtype=torch.int64) * self.kv_row_stride
        if layer is not None:
            return (base[:, None] + (layer * self.layer_row_stride + kv)[None, :]).reshape(-1)
        layers = torch.arange(self.layout.num_layers, dtype=torch.int64) * self.layer_row_stride
        return (base[:, None, None] + layers[None, :, None] + kv[None, None, :]).reshape(-1)

    def _check_one(self, page: int) -> int:
        if isinstance(page, bool) or not isinstance(page, int):
            raise PageIndexError(f"{self.kind} index must be an int, got {page!r}")
        if not 0 <= page < self.num_pages:
            raise PageIndexError(f"index {page} is out of range for a {self.kind} of {self.num_pages}")
        return page

    def page_tensor(self, page: int) -> torch.Tensor:
        """A view of one page in canonical shape [layers, 2, page_size, heads, head_dim] (may be strided)."""
        page = self._check_one(page)
        return self.kv[page] if self.page_first else self.kv[:, :, page]

    def k(self, layer: int, page: int) -> torch.Tensor:
        """View of the K block [page_size, heads, head_dim] of `layer` in `page`."""
        return self.page_tensor(page)[layer, 0]

    def v(self, layer: int, page: int) -> torch.Tensor:
        """View of the V block [page_size, heads, head_dim] of `layer` in `page`."""
        return self.page_tensor(page)[layer, 1]

    def read_page(self, page: int) -> torch.Tensor:
        """A copy of one page as a 1-D uint8 CPU tensor of `page_bytes`, in canonical order."""
        data = self.page_tensor(page).clone(memory_format=torch.contiguous_format)
        return data.view(-1).view(torch.uint8).cpu()

    def write_page(self, page: int, data: bytes | bytearray | memoryview | torch.Tensor) -> None:
        """Overwrite one page with `page_bytes` bytes in canonical order."""
        if isinstance(data, torch.Tensor):
            raw = data.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            raise TypeError(f"page data must be bytes or a tensor, got {type(data).__name__}")
        if raw.numel() != self.layout.page_bytes:
            raise KVLayoutError(f"page data has {raw.numel()} bytes, a page has {self.layout.page_bytes}")
        self.page_tensor(page).copy_(raw.view(self.layout.dtype).view(self.layout.page_shape))


_HUGE_PAGE = 2 << 20


def cpu_zeros(shape: tuple[int, ...], dtype: torch.dtype, what: str = "KV pool") -> torch.Tensor:
    """A zeroed CPU tensor for a pool: anonymous memory, 2 MiB aligned and advised for transparent
    huge pages where the OS offers them. A pool is large, long-lived and read at scattered rows; with
    4 KiB pages nearly every row copied costs a TLB miss. The memory is touched here, as torch.zeros
    would: a host short of memory fails at startup, not with a killed rank in the middle of a copy.
    Raises PoolMemoryError, naming ``what`` and both sizes, when the host cannot give the bytes."""
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    check_fits(nbytes, what)
    try:
        if nbytes < _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
            return torch.zeros(shape, dtype=dtype)
        region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    except (OSError, RuntimeError) as exc:  # the OS refused the mapping (overcommit limits)
        raise PoolMemoryError(f"cannot allocate the {what} ({format_bytes(nbytes)}): {exc}") from None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` until the tensor is freed
    start = -raw.data_ptr() % _HUGE_PAGE
    with contextlib.suppress(OSError):  # huge pages off or unsupported: 4 KiB pages are still correct
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    memory = raw[start : start + nbytes]
    memory.zero_()  # commit every page now (see above)
    return memory.view(dtype).view(shape)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class DevicePool(PagedKV):
    """The device tier: KV as one tensor [layers, 2, pages, page_size, heads, head_dim].

    On the GPU when one is available (or `device` says so), a CPU tensor otherwise.
    """

    kind = "device pool"

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str | None = None) -> None:
        _positive_int("num_pages", num_pages)
        dev = _default_device() if device is None else torch.device(device)
        shape = (layout.num_layers, 2, num_pages, *layout.token_shape)
        kv = (
            cpu_zeros(shape, layout.dtype, "device pool")
            if dev.type == "cpu"
            else torch.zeros(shape, dtype=layout.dtype, device=dev)
        )
        super().__init__(layout, kv, num_pages, False)

    @classmethod
    def from_tensor(cls, layout: KVLayout, tensor: torch.Tensor) -> DevicePool:
        """Wrap an engine's own KV buffer [layers, 2, pages, page_size, heads, head_dim] without copying."""
        if not isinstance(tensor, torch.Tensor):
            raise KVLayoutError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != layout.dtype:
            raise KVLayoutError(f"tensor dtype {tensor.dtype} does not match layout dtype {layout.dtype}")
        if tensor.dim() != 6:
            raise KVLayoutError(
                f"KV tensor must be 6-D [layers, 2, pages, page_size, heads, head_dim], got {tuple(tensor.shape)}"
            )
        expected = (layout.num_layers, 2, tensor.shape[2], *layout.token_shape)
        if tuple(tensor.shape) != expected or tensor.shape[2] == 0:
            raise KVLayoutError(f"KV tensor shape {tuple(tensor.shape)} does not match layout, expected {expected}")
        if not tensor.is_contiguous():
            raise KVLayoutError("KV tensor must be contiguous")
        pool = cls.__new__(cls)
        PagedKV.__init__(pool, layout, tensor, int(tensor.shape[2]), False)
        return pool

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for all pages, each [pages, page_size, heads, head_dim] (for attention)."""
        return self.kv[layer, 0], self.kv[layer, 1]


class HostPool(PagedKV):
    """The host tier, pinned when CUDA is available.

    layer_first: [layers, 2, slots, page_size, heads, head_dim] (same as the device pool);
    page_first:  [slots, layers, 2, page_size, heads, head_dim] (a page is contiguous, what storage wants).
    """

    kind = "host pool"

    def __init__(
        self,
        layout: KVLayout,
        num_slots: int,
        host_layout: HostLayout = "layer_first",
        pin_memory: bool | None = None,
    ) -> None:
        _positive_int("num_slots", num_slots)
        if host_layout not in HOST_LAYOUTS:
            raise KVLayoutError(f"unknown host layout {host_layout!r}, expected one of {HOST_LAYOUTS}")
        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            raise KVLayoutError("pinned host memory needs CUDA, which is not available")
        pinned = cuda if pin_memory is None else bool(pin_memory)
        page_first = host_layout == "page_first"
        if page_first:
            shape = (num_slots, layout.num_layers, 2, *layout.token_shape)
        else:
            shape = (layout.num_layers, 2, num_slots, *layout.token_shape)
        if pinned:
            check_fits(layout.page_bytes * num_slots, "host pool")
            tensor = torch.zeros(shape, dtype=layout.dtype, pin_memory=True)
        else:
            tensor = cpu_zeros(shape, layout.dtype, "host pool")
        super().__init__(layout, tensor, num_slots, page_first)
        self.host_layout: HostLayout = host_layout
        self.pinned = pinned

    @property
    def num_slots(self) -> int:
        return self.num_pages

    def page_view(self, slot: int) -> torch.Tensor:
        """The bytes of one slot as a 1-D uint8 tensor sharing memory with the pool (page_first only)."""
        if not self.page_first:
            raise KVLayoutError("page_view needs host_layout='page_first' (a layer_first page is not contiguous)")
        return self.kv[self._check_one(slot)].view(-1).view(torch.uint8)

    def page_memoryview(self, slot: int) -> memoryview:
        """A writable memoryview over one slot's bytes (page_first only), e.g. for file I/O."""
        view = self.page_view(slot)
        buffer = (ctypes.c_ubyte * view.numel()).from_address(view.data_ptr())
        buffer._owner = self.kv  # type: ignore[attr-defined]  # keep the pool alive while the view lives
        return memoryview(buffer).cast("B")
