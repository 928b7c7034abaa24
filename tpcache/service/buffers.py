"""Registered KV buffers: a client's device-tier memory, mapped by the rank that serves it.

Two descriptor kinds (keys of one ``register_buffers`` descriptor map):

- ``{"rank": r, "kind": "shm", "name": "tpcache-kv-r", "pages": N}``: a file in /dev/shm holding
  the KV tensor ``[layers, 2, N, page_size, heads, head_dim]`` of rank r, in the service's layout;
- ``{"rank": r, "kind": "cuda_ipc", "pages": N, "device": d, "handle": <bin>, "storage_size": n,
  "storage_offset": o, "ref_counter_handle": <bin>, "ref_counter_offset": k, "event_handle": <bin>,
  "event_sync_required": bool}``: the fields of ``UntypedStorage._share_cuda_()`` (see
  ``cuda_ipc_descriptor``); no pickle crosses the wire.

Mapping is the first phase of a registration (every rank, possibly failing locally); the leader
commits the swap only when every rank mapped its buffer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tpcache.io.kv_pool import DevicePool, KVLayout

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^/?[A-Za-z0-9._-]{1,200}$")


class KVBufferError(ValueError):
    """A descriptor is malformed or its memory cannot be mapped as the service's KV layout."""


@dataclass
class StagedBuffer:
    pool: DevicePool
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        self.pool = None  # type: ignore[assignment]  # drop tensor views before unmapping
        for fn in reversed(self.closers):
            with contextlib.suppress(BufferError, OSError, ValueError):  # live views: the GC unmaps later
                fn()
        self.closers.clear()


def kv_shape(layout: KVLayout, pages: int) -> tuple[int, ...]:
    return (layout.num_layers, 2, pages, *layout.token_shape)


def kv_bytes(layout: KVLayout, pages: int) -> int:
    return layout.page_bytes * pages


def _int(desc: Mapping[str, Any], key: str, lo: int = 0) -> int:
    value = desc.get(key)
    if type(value) is not int or value < lo:
        raise KVBufferError(f"descriptor needs {key!r}, an int >= {lo}")
    return value


def stage_buffer(desc: Mapping[str, Any], layout: KVLayout, min_pages: int) -> StagedBuffer:
    pages = _int(desc, "pages", 1)
    if pages < min_pages:
        raise KVBufferError(f"buffer has {pages} pages; the cache is configured for {min_pages}")
    kind = desc.get("kind")
    if kind == "shm":
        return _stage_shm(desc, layout, pages)
    if kind == "cuda_ipc":
        return _stage_cuda(desc, layout, pages)
    raise KVBufferError(f"unknown buffer kind {kind!r}; expected 'shm' or 'cuda_ipc'")


def _stage_shm(desc: Mapping[str, Any], layout: KVLayout, pages: int) -> StagedBuffer:
    name = desc.get("name")
    if type(name) is not str or not _NAME.match(name):
        raise KVBufferError("shm descriptor needs 'name', a /dev/shm file name of [A-Za-z0-9._-]")
    path = os.path.join(SHM_DIR, name.lstrip("/"))
    want = kv_bytes(layout, pages)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise KVBufferError(f"cannot open shared memory {name!r}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size != want:
            raise KVBufferError(f"shared memory {name!r} has {size} bytes; {pages} pages of this layout need {want}")
        mm = mmap.mmap(fd, want)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mm, dtype=torch.uint8).view(layout.dtype).view(kv_shape(layout, pages))
    pool = DevicePool.from_tensor(layout, tensor)
    return StagedBuffer(pool, [mm.close])


def _stage_cuda(desc: Mapping[str, Any], layout: KVLayout, pages: int) -> StagedBuffer:
    if not torch.cuda.is_available():
        raise KVBufferError("a cuda_ipc buffer needs CUDA on the serving rank")
    device = _int(desc, "device")
    for key in ("handle", "ref_counter_handle", "event_handle"):
        if type(desc.get(key)) is not bytes:
            raise KVBufferError(f"cuda_ipc descriptor needs {key!r} (bin)")
    if type(desc.get("event_sync_required")) is not bool:
        raise KVBufferError("cuda_ipc descriptor needs 'event_sync_required' (bool)")
    size, offset = _int(desc, "storage_size"), _int(desc, "storage_offset")
    want = kv_bytes(layout, pages)
    if size - offset < want:
        raise KVBufferError(f"CUDA storage of {size - offset} bytes is smaller than {want}")
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device,
            desc["handle"],
            size,
            offset,
            desc["ref_counter_handle"],
            _int(desc, "ref_counter_offset"),
            desc["event_handle"],
            desc["event_sync_required"],
        )
    except RuntimeError as exc:
        raise KVBufferError(f"cannot open the CUDA IPC handle: {exc}") from None
    base = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage)
    tensor = base[:want].view(layout.dtype).view(kv_shape(layout, pages))
    return StagedBuffer(DevicePool.from_tensor(layout, tensor))


# ---------------------------------------------------------------------------------------------
# Client side helpers.


def cuda_ipc_descriptor(tensor: torch.Tensor, rank: int, pages: int) -> dict[str, Any]:
    """The descriptor that lets rank ``rank`` map ``tensor`` (a CUDA KV buffer) through CUDA IPC."""
    if not tensor.is_cuda or not tensor.is_contiguous() or tensor.storage_offset() != 0:
        raise KVBufferError("cuda_ipc needs a contiguous CUDA tensor at the start of its storage")
    (device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = tensor.untyped_storage()._share_cuda_()
    return {
        "rank": rank,
        "kind": "cuda_ipc",
        "pages": pages,
        "device": int(device),
        "handle": bytes(handle),
        "storage_size": int(size),
        "storage_offset": int(offset),
        "ref_counter_handle": bytes(rc_handle),
        "ref_counter_offset": int(rc_offset),
        "event_handle": bytes(ev_handle),
        "event_sync_required": bool(ev_sync),
    }


class ShmKVBuffer:
    """A client's CPU KV buffer in /dev/shm, to register with a rank. Unlinks on ``close``."""

    def __init__(self, name: str, layout: KVLayout, pages: int) -> None:
        if not _NAME.match(name):
            raise KVBufferError(f"bad shared memory name {name!r}")
        self.name = name.lstrip("/")
        self.path = os.path.join(SHM_DIR, self.name)
        self.pages = pages
        size = kv_bytes(layout, pages)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8).view(layout.dtype).view(kv_shape(layout, pages))

    def descriptor(self, rank: int) -> dict[str, Any]:
        return {"rank": rank, "kind": "shm", "name": self.name, "pages": self.pages}

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(BufferError):
            self._mm.close()

    def __enter__(self) -> ShmKVBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
