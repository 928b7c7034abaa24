"""A storage layout shaped by the model, not the group: any TP or PP shape reads what another wrote.

A page's KV is the model's ``[layers, 2 (K, V), page_size, kv_heads, head_dim]``; a rank holds the
slice of its stage's layers and its tensor rank's heads. In this layout a page is stored as
*shards*: each holds ``layers_per_shard`` consecutive layers of ``heads_per_shard`` consecutive KV
heads, head-major (``[heads, layers, 2, page_size, head_dim]``, transposed on write and assembled
on read), under a key that names the model and the shard's global ranges, never the writer's
place (``keys.StorageKey`` with ``layers``/``heads``: ``v2/<model>/<layout id>/l0-1.h2-2/<hash>``).

The shard granularity is fixed per model (``ModelShape``): one KV head a shard by default, so every
TP size that divides the KV heads reads whole shards, and ``gcd(layers, 4)`` layer blocks, so every
pipeline size that divides that count does. A group whose ranks would split a shard is refused at
start with one line.

Invariants:
- complete sets only: a page is stored for a rank (``put`` True) only when every shard of its slice
  was stored, and is present (``exists``) or read (``get`` True) only when every shard it needs is
  there and verified (checksum, and MAC when a storage key is set); anything less is a miss of the
  whole page and its buffer is zero-filled. The round's agreement on storage hits takes the least
  over the ranks, so a shard missing for one rank makes the page a miss on every rank;
- a store written by one model never serves another: the key names the model id and the layout id
  (layers, KV heads, head dim, dtype, page size, byte order, shard granularity).
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from tpcache.comm.parallel import Shard
from tpcache.io.kv_pool import KVLayout
from tpcache.io.storage.base import StorageBackend, StorageCounters, StorageInUse, check_keys, check_pairs
from tpcache.io.storage.buffers import byte_view, check_tensor
from tpcache.io.storage.keys import StorageKey, StorageKeyError

SHARD_FORMAT_VERSION = 1
DEFAULT_LAYER_BLOCKS = 4  # layer blocks are gcd(layers, 4): pipeline sizes 1, 2, 4 where they divide


def _wide(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The tensors' bytes as numpy arrays of the widest integer type that tiles the last dimension
    and every tensor's alignment. numpy copies a strided array on the calling thread at a few
    microseconds a call (torch costs tens, and splits a large copy over its intra-op threads, which
    the storage worker should not take from the engine); a copy of integers keeps every bit pattern."""
    width = tensors[0].shape[-1]
    arrays = [t.numpy() for t in tensors]
    for dtype in (np.uint64, np.uint32, np.uint16):
        size = np.dtype(dtype).itemsize
        if width % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return [a.view(dtype) for a in arrays]
    return arrays


# Staging buffers up to this size are kept per thread for its next call (a fresh one costs page
# faults on every call). A backend reads or writes the caller's buffers only until its call returns
# (a remote call abandoned at its deadline makes the calls after it fail fast until it has returned).
KEEP_STAGING_BYTES = 16 << 20
_kept = threading.local()


def _staging(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialized uint8 buffer of ``shape`` for one call of this thread (``name``: put or get)."""
    n = math.prod(shape)
    if n > KEEP_STAGING_BYTES:
        return torch.empty(shape, dtype=torch.uint8)
    buf = getattr(_kept, name, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=torch.uint8)
        setattr(_kept, name, buf)
    return buf[:n].view(shape)


def _rows(staging: torch.Tensor, size: int) -> list[memoryview]:
    """``staging``'s bytes as consecutive ``size``-byte views (cheaper to hand a backend than tensors)."""
    n = staging.numel()
    buffer = (ctypes.c_ubyte * n).from_address(staging.data_ptr())
    buffer._owner = staging  # type: ignore[attr-defined]  # the views keep the tensor alive
    view = memoryview(buffer).cast("B")
    return [view[off : off + size] for off in range(0, n, size)]


# A page's bytes (flat uint8) seen as [layers, 2, page_size, heads, head_dim bytes] (any strides).
PageView = Callable[[torch.Tensor], torch.Tensor]


class ShardLayoutError(ValueError):
    """A model or group shape that the shard layout cannot serve; the message says why."""


@dataclass(frozen=True)
class ModelShape:
    """The model a shared store holds, and its fixed shard granularity.

    ``model_id`` names the model (a checkpoint and revision, in the user's words); two checkpoints
    with the same id and the same layout cannot be told apart. ``layers_per_shard`` 0 takes
    ``layers / gcd(layers, 4)``."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    heads_per_shard: int = 1
    layers_per_shard: int = 0
    byteorder: str = sys.byteorder

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ShardLayoutError("the shared storage layout needs a model id (a non-empty string)")
        probe = KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.page_size)
        object.__setattr__(self, "dtype", probe.dtype)
        if not self.layers_per_shard:
            blocks = math.gcd(self.num_layers, DEFAULT_LAYER_BLOCKS)
            object.__setattr__(self, "layers_per_shard", self.num_layers // blocks)
        for name, total in (("heads_per_shard", self.num_kv_heads), ("layers_per_shard", self.num_layers)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or total % value:
                raise ShardLayoutError(f"{name}={value!r} must be a positive divisor of {total}")
        StorageKey(self.model_id, 0, 0, 1, 0)  # the model id must be a valid key namespace

    @classmethod
    def of_rank(cls, model_id: str, layout: KVLayout, shard: Shard, **granularity: int) -> ModelShape:
        """The whole model from one rank's slice (``layout``) and its place in the group."""
        if shard.cp_size > 1:
            raise ShardLayoutError(
                "the shared storage layout does not serve context-parallel groups (cp_size > 1): each context "
                "rank holds some of a page's tokens; use the per-shape layout (no model id)"
            )
        return cls(
            model_id,
            layout.num_layers * shard.pp_size,
            layout.heads_per_rank * shard.tp_size,
            layout.head_dim,
            layout.dtype,
            layout.page_size,
            **granularity,
        )

    @functools.cached_property
    def layout_id(self) -> int:
        """A stable id of the byte format of every shard; part of every key."""
        fields = (
            f"shard{SHARD_FORMAT_VERSION}",
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.page_size,
            self.byteorder,
            self.heads_per_shard,
            self.layers_per_shard,
        )
        return xxhash.xxh32_intdigest("/".join(map(str, fields)).encode()) & 0x7FFFFFFF

    @property
    def shard_bytes(self) -> int:
        itemsize = self.dtype.itemsize
        return self.heads_per_shard * self.layers_per_shard * 2 * self.page_size * self.head_dim * itemsize

    def describe(self) -> str:
        return (
            f"model {self.model_id!r}: {self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim}, "
            f"{str(self.dtype).removeprefix('torch.')}, {self.page_size}-token pages, shards of "
            f"{self.layers_per_shard} layer(s) x {self.heads_per_shard} KV head(s)"
        )

    def ranges(self, layout: KVLayout, shard: Shard) -> list[tuple[int, int, int, int]]:
        """The shards rank ``shard`` holds, as local ``(layer0, layer1, head0, head1)`` ranges of its
        slice (half-open), head-major. Raises ShardLayoutError when the rank's slice is not whole
        shards or is not a slice of this model."""
        s = Shard(*shard)
        if s.cp_size > 1:
            raise ShardLayoutError("the shared storage layout does not serve context-parallel groups (cp_size > 1)")
        lr, hr = layout.num_layers, layout.heads_per_rank
        same = (
            lr * s.pp_size == self.num_layers
            and hr * s.tp_size == self.num_kv_heads
            and (layout.head_dim, layout.dtype, layout.page_size) == (self.head_dim, self.dtype, self.page_size)
        )
        if not same:
            raise ShardLayoutError(f"a rank's KV layout {layout} is not a PP{s.pp_size}xTP{s.tp_size} slice of {self}")
        lg, hg = self.layers_per_shard, self.heads_per_shard
        if lr % lg or hr % hg:
            raise ShardLayoutError(
                f"PP{s.pp_size}xTP{s.tp_size} gives each rank {lr} layer(s) x {hr} KV head(s), which splits the "
                f"model's shards of {lg} layer(s) x {hg} KV head(s); use a pipeline size that divides "
                f"{self.num_layers // lg} and a tensor size that divides {self.num_kv_heads // hg}"
            )
        return [(lo, lo + lg, ho, ho + hg) for ho in range(0, hr, hg) for lo in range(0, lr, lg)]


class ShardedStorage(StorageBackend):
    """One rank's view of a store in the shard layout, behind the per-page ``StorageBackend`` calls the
    rank makes: each page key becomes the keys of the shards of the rank's slice, each page buffer
    (the canonical ``[layers, 2, page_size, heads, head_dim]`` bytes of its slice) their payloads.

    ``inner`` serves every shard (opened without a shard: a remote store, or ``SharedFileStore``);
    it is owned and closed with this view. ``page_view``: for pages in another byte order than the
    canonical one (an engine's own), a function from a page's bytes (a flat ``uint8`` tensor) to a
    view of them as ``[layers, 2, page_size, heads, head_dim bytes]``; the shards are the same bytes
    whatever the order of the pages they come from."""

    def __init__(
        self,
        inner: StorageBackend,
        model: ModelShape,
        shard: Shard,
        layout: KVLayout,
        page_view: PageView | None = None,
    ) -> None:
        self._inner = inner
        self.model = model
        self.shard = Shard(*shard)
        self.layout = layout
        self._ranges = model.ranges(layout, self.shard)
        self._first_layer = self.shard.pp_rank * layout.num_layers
        self._first_head = self.shard.tp_rank * layout.heads_per_rank
        self._shape = (layout.num_layers, 2, layout.page_size, layout.heads_per_rank, layout.head_dim * layout.itemsize)
        self._view = page_view
        # One KV head a shard, or every layer in one: a page's shards in key order are the page head-major.
        self._whole = model.heads_per_shard == 1 or model.layers_per_shard == layout.num_layers
        self._templates = []
        for l0, l1, h0, h1 in self._ranges:
            layers = (self._first_layer + l0, self._first_layer + l1 - 1)
            heads = (self._first_head + h0, self._first_head + h1 - 1)
            template = StorageKey(model.model_id, model.layout_id, 0, 1, 0, layers=layers, heads=heads)
            fields = dict(template.__dict__)
            # A shard key's encoding is its template's with the page hash last (16 hex digits).
            self._templates.append((fields, template.encode()[:-16]))
        # The shard keys' encodings without the page hash, as bytes (the native path's key echoes).
        self._echo_prefixes = [prefix.encode("ascii") for _, prefix in self._templates]
        self._geometry, self._offsets = self._shard_rows()
        self._places: dict[int, bytes] = {}
        self._counters = StorageCounters(0)
        self._names = ("page_gets", "page_hits", "page_partial", "page_puts", "page_put_ok")
        for name in self._names:
            self._counters.set(name, 0)
        self.record_mac = inner.record_mac

    # ---- keys and bytes ----------------------------------------------------------------------
    def shard_keys(self, key: StorageKey) -> list[StorageKey]:
        """The keys of the shards of this rank's slice of ``key``'s page."""
        if key.layers is not None:
            raise StorageKeyError("the shard layout takes a rank's page key, not a model shard key")
        out = []
        h = key.page_hash
        suffix = f"{h:016x}"
        new, put = object.__new__, object.__setattr__
        for fields, prefix in self._templates:  # checked once; a key's page hash was checked when it was made
            k = new(StorageKey)
            d = fields.copy()
            d["page_hash"] = h
            d["_encoded"] = prefix + suffix
            put(k, "__dict__", d)
            out.append(k)
        return out

    def _shard_rows(self) -> tuple[tuple[int, ...] | None, list[int]]:
        """Where a shard's rows lie in a page, for the native path (``_record``): its geometry (row
        bytes, then counts and byte strides of heads, layers, K/V and tokens, outermost first) and
        each shard's byte offset in the page, in key order; None where the page's byte order has
        rows that are not contiguous or strides that are negative. A page view is strides over a
        page's bytes, the same for every page, so one probe page gives them."""
        probe = torch.empty(self.layout.page_bytes, dtype=torch.uint8)
        page = self._view(probe) if self._view is not None else probe.view(self._shape)
        st = page.stride()
        if page.dim() != 5 or st[4] != 1 or min(st) < 0:
            return None, []
        base = page.data_ptr() - probe.data_ptr()
        width, ps = self._shape[4], self._shape[2]
        dims = [(self.model.heads_per_shard, st[3]), (self.model.layers_per_shard, st[0]), (2, st[1]), (ps, st[2])]
        while dims[-1][0] > 1 and dims[-1][1] == width:  # rows that follow each other are one longer row
            width *= dims.pop()[0]
            dims.insert(0, (1, 0))
        geometry = (width, *(x for d in dims for x in d))
        return geometry, [base + l0 * st[0] + h0 * st[3] for l0, _, h0, _ in self._ranges]

    def _flat(self, buf: Any, writable: bool) -> Any:
        """A page buffer for the native path: a CPU tensor as ``(address, bytes)`` (its caller keeps
        it for the call; the cheapest form to take), anything else as ``byte_view``'s flat view."""
        if isinstance(buf, torch.Tensor):
            if not buf.is_cpu or not buf.is_contiguous() or (writable and buf.requires_grad):
                check_tensor(buf, writable)  # raises the same error as every backend
            n = buf.nbytes
            flat: Any = (buf.data_ptr(), n)
        else:
            flat = byte_view(buf, writable=writable)
            n = len(flat)
        if n != self.layout.page_bytes:
            raise ValueError(f"a page buffer of {n} bytes; this rank's pages are {self.layout.page_bytes}")
        return flat

    def _native_for(self) -> Any:
        """The inner store when it serves the native path now (see ``RemoteBackend.shard_records``)."""
        if self._geometry is not None and getattr(self._inner, "shard_records", False):
            return self._inner
        return None

    def _echoes(self, keys: list[StorageKey]) -> list[bytes]:
        """The key echoes of every page's shards, in key order (``shard_keys``' encodings)."""
        for key in keys:
            if key.layers is not None:
                raise StorageKeyError("the shard layout takes a rank's page key, not a model shard key")
        prefixes = self._echo_prefixes
        return [p + b"%016x" % key.page_hash for key in keys for p in prefixes]

    def _places_of(self, pages: int) -> bytes:
        """``(page index, byte offset)`` of every shard of ``pages`` pages, as int64 pairs."""
        places = self._places.get(pages)
        if places is None:
            per = len(self._offsets)
            pairs = np.empty((pages * per, 2), dtype=np.int64)
            pairs[:, 0] = np.repeat(np.arange(pages, dtype=np.int64), per)
            pairs[:, 1] = np.tile(np.asarray(self._offsets, dtype=np.int64), pages)
            places = pairs.tobytes()
            if len(self._places) < 64:
                self._places[pages] = places
        return places

    def _page(self, buf: Any, writable: bool) -> torch.Tensor:
        if isinstance(buf, torch.Tensor):
            check_tensor(buf, writable)  # the same checks as every backend: CPU, contiguous
            flat = buf.reshape(-1).view(torch.uint8)
        else:
            view = byte_view(buf, writable=writable)
            flat = torch.frombuffer(view if not view.readonly else bytearray(view), dtype=torch.uint8)
        if flat.numel() != self.layout.page_bytes:
            raise ValueError(f"a page buffer of {flat.numel()} bytes; this rank's pages are {self.layout.page_bytes}")
        if self._view is not None:
            return self._view(flat)
        return flat.view(self._shape)

    def _split(self, pages: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every page's shards, in key order, in one new buffer (head-major)."""
        lr, _, ps, hr, width = self._shape
        if self._whole:  # the shards of a page, in order, are the page head-major: one copy a page
            staging = _staging("put", (len(pages), hr, lr, 2, ps, width))
            for i, page in enumerate(pages):
                dst, src = _wide(staging[i], page)
                np.copyto(dst, src.transpose(3, 0, 1, 2, 4))
            return _rows(staging, self.model.shard_bytes)
        out = []
        for page in pages:
            for l0, l1, h0, h1 in self._ranges:
                shard = torch.empty((h1 - h0, l1 - l0, 2, ps, width), dtype=torch.uint8)
                dst, src = _wide(shard, page)
                np.copyto(dst, src[l0:l1, :, :, h0:h1].transpose(3, 0, 1, 2, 4))
                out.append(shard.view(-1))
        return out

    def _assemble(self, page: torch.Tensor, staging: torch.Tensor) -> None:
        """Copy one page's shards (``staging``: all of them, in key order) into ``page``."""
        lr, _, ps, hr, width = self._shape
        if self._whole:
            dst, src = _wide(page, staging.view(hr, lr, 2, ps, width))
            np.copyto(dst, src.transpose(1, 2, 3, 0, 4))
            return
        rows = staging.view(len(self._ranges), -1)
        for (l0, l1, h0, h1), data in zip(self._ranges, rows, strict=True):
            dst, src = _wide(page, data.view(h1 - h0, l1 - l0, 2, ps, width))
            np.copyto(dst[l0:l1, :, :, h0:h1], src.transpose(1, 2, 3, 0, 4))

    # ---- StorageBackend ----------------------------------------------------------------------
    def authenticate(self, mac: Any) -> None:
        self._inner.authenticate(mac)
        self.record_mac = mac

    def unusable(self) -> str | None:
        return self._inner.unusable()

    @property
    def trust(self) -> str:
        return self._inner.trust

    def _all_keys(self, keys: Sequence[StorageKey]) -> list[StorageKey]:
        return [k for key in keys for k in self.shard_keys(key)]

    def _per_page(self, results: Sequence[bool], n: int) -> list[list[bool]]:
        per = len(self._ranges)
        return [list(results[i * per : (i + 1) * per]) for i in range(n)]

    def exists(self, keys: Sequence[StorageKey]) -> list[bool]:
        ks = check_keys(keys)
        found = self._per_page(self._inner.exists(self._all_keys(ks)), len(ks))
        self._counters.add("page_partial", sum(any(page) and not all(page) for page in found))
        return [all(page) for page in found]

    def get(self, keys: Sequence[StorageKey], out: Sequence[Any]) -> list[bool]:
        ks = check_pairs(keys, out, "output buffers")
        native = self._native_for()
        if native is not None:
            flats = [self._flat(b, writable=True) for b in out]
            ok = native.get_shards(self._echoes(ks), flats, self._places_of(len(ks)), self._geometry)
            return self._got(flats, bytes(ok))
        pages = [self._page(b, writable=True) for b in out]
        per = len(self._ranges)
        staging = _staging("get", (len(ks), per, self.model.shard_bytes))
        got = self._per_page(self._inner.get(self._all_keys(ks), _rows(staging, self.model.shard_bytes)), len(ks))
        results = []
        for i, (page, ok) in enumerate(zip(pages, got, strict=True)):
            self._counters.add("page_gets")
            if all(ok):
                self._assemble(page, staging[i])
                self._counters.add("page_hits")
            else:
                page.zero_()  # never leave a partial set in the caller's buffer
                if any(ok):
                    self._counters.add("page_partial")
            results.append(all(ok))
        return results

    def _got(self, flats: list[Any], ok: bytes) -> list[bool]:
        """Each page's verdict from its shards' (``ok``: 1 a verified shard); a page that lacks one
        is zero-filled (its other shards' rows may already be in it)."""
        per = len(self._ranges)
        full = b"\x01" * per
        results = []
        partial = 0
        for i, flat in enumerate(flats):
            mine = ok[i * per : (i + 1) * per]
            results.append(mine == full)
            if mine != full:
                if isinstance(flat, tuple):  # never leave a partial set in the caller's buffer
                    ctypes.memset(flat[0], 0, flat[1])
                else:
                    flat[:] = bytes(len(flat))
                partial += 1 in mine
        self._counters.add("page_gets", len(flats))
        self._counters.add("page_hits", sum(results))
        self._counters.add("page_partial", partial)
        return results

    def put(self, keys: Sequence[StorageKey], pages: Sequence[Any]) -> list[bool]:
        ks = check_pairs(keys, pages, "pages")
        native = self._native_for()
        if native is not None:
            flats = [self._flat(p, writable=False) for p in pages]
            stored = native.put_shards(self._echoes(ks), flats, self._places_of(len(ks)), self._geometry)
            done = self._per_page(stored, len(ks))
            self._counters.add("page_puts", len(ks))
            self._counters.add("page_put_ok", sum(all(d) for d in done))
            return [all(d) for d in done]
        shards = self._split([self._page(p, writable=False) for p in pages])
        done = self._per_page(self._inner.put(self._all_keys(ks), shards), len(ks))
        self._counters.add("page_puts", len(ks))
        self._counters.add("page_put_ok", sum(all(d) for d in done))
        return [all(d) for d in done]

    def delete(self, keys: Sequence[StorageKey]) -> list[bool]:
        ks = check_keys(keys)
        gone = self._per_page(self._inner.delete(self._all_keys(ks)), len(ks))
        return [any(g) for g in gone]

    def stats(self) -> dict[str, int]:
        """The store's counters (per shard record) and this view's per page: ``page_gets``,
        ``page_hits``, ``page_partial`` (pages looked up or read with some but not all of their shards: a miss),
        ``page_puts``, ``page_put_ok``."""
        mine = self._counters.snapshot()
        return {**self._inner.stats(), **{name: mine[name] for name in self._names}}

    def close(self) -> None:
        self._inner.close()


# Owner directories one shard's writers may take: groups of one shape sharing a directory (data-
# parallel replicas) each take the first one no running instance holds.
MAX_OWNER_SLOTS = 64


def shard_owner(shard: Shard, slot: int = 0) -> str:
    """The file store's owner directory of a writer: its place in its group's shape (``r0of2``,
    ``p1of2.r0of1``), so deployments of different shapes never write each other's directories,
    and for the ``slot``-th writer of one shape at once, ``.i<slot>`` after it (``r0of2.i1``)."""
    label = Shard(*shard).label
    return label if slot == 0 else f"{label}.i{slot}"


def open_shared_storage(
    url: str,
    *,
    model: ModelShape,
    shard: Shard,
    layout: KVLayout,
    capacity_bytes: int = 1 << 30,
    storage_key: bytes | None = None,
    page_view: PageView | None = None,
) -> ShardedStorage:
    """The shard-layout store ``url`` names, for rank ``shard`` holding ``layout`` of ``model``.

    A file URL keeps every writer in ``PATH/model/<owner>`` (``shard_owner``: the first of its shard's
    directories no running writer holds); each rank reads its own directory and, read-only, every
    other owner's (``SharedFileStore``). Mooncake and Redis keep
    one value per shard key, shared by every group."""
    from tpcache.io.storage.url import _open, parse_storage_url

    spec = parse_storage_url(url)
    s = dict(spec.settings)
    model.ranges(layout, shard)  # refuse a shape that splits shards before opening anything
    inner: StorageBackend
    if spec.backend == "file":
        from tpcache.io.storage.file import DEFAULT_SEGMENT_BYTES
        from tpcache.io.storage.shared_file import SharedFileStore

        # The first owner directory of this shard that no running writer holds: a restart takes
        # its own again (or a stopped replica's: any owner's records serve every group alike).
        for slot in range(MAX_OWNER_SLOTS):
            try:
                inner = SharedFileStore(
                    Path(spec.location) / "model",
                    shard_owner(shard, slot),
                    capacity_bytes=s.get("capacity", capacity_bytes),
                    fsync=s.get("fsync", "batch"),
                    segment_bytes=s.get("segment", DEFAULT_SEGMENT_BYTES),
                )
                break
            except StorageInUse:
                continue
        else:
            where = Path(spec.location) / "model" / shard_owner(shard)
            raise StorageInUse(f"{MAX_OWNER_SLOTS} running writers of this shard hold {where} and its siblings")
    else:
        inner = _open(spec, None, capacity_bytes)  # type: ignore[arg-type]  # every shard key
    if storage_key:
        from tpcache.io.storage.record import RecordMac

        inner.authenticate(RecordMac(storage_key))
    return ShardedStorage(inner, model, shard, layout, page_view)
