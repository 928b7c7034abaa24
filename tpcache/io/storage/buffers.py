"""Zero-copy byte views of page buffers: bytes-likes and contiguous CPU torch tensors.

Invariant: a returned view aliases the caller's memory (no copy); the caller keeps the object
alive and unchanged for as long as the view is used.
"""

from __future__ import annotations

import ctypes
import sys
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import torch

PageBuffer = Union[bytes, bytearray, memoryview, "torch.Tensor"]


class StorageBufferError(TypeError):
    """A page buffer cannot be used: wrong type, not contiguous, not on the CPU, read-only."""


def check_tensor(t: Any, writable: bool) -> None:
    """``byte_view``'s checks of a tensor, without making the view."""
    if t.device.type != "cpu":
        raise StorageBufferError(f"storage needs CPU tensors, got one on {t.device}")
    if not t.is_contiguous():
        raise StorageBufferError("storage needs contiguous tensors (call .contiguous() first)")
    if writable and t.requires_grad:
        raise StorageBufferError("cannot read storage into a tensor that requires grad")


def _tensor_view(t: Any, writable: bool) -> memoryview:
    check_tensor(t, writable)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    # numpy is not a dependency; a ctypes array over data_ptr() is the same zero-copy alias.
    arr = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    return memoryview(arr).cast("B")


def byte_view(buf: Any, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of ``buf`` without copying."""
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1 and buf.c_contiguous:
        if writable and buf.readonly:
            raise StorageBufferError("output buffer is read-only")
        return buf  # already one: the common case of a backend's caller (ShardedStorage's rows)
    # A tensor exists only once torch is imported: this module never imports it, so the launcher
    # and the settings check start without torch's import (seconds of CPU).
    torch_ = sys.modules.get("torch")
    if torch_ is not None and isinstance(buf, torch_.Tensor):
        return _tensor_view(buf, writable)
    try:
        view = memoryview(buf)
    except TypeError:
        raise StorageBufferError(
            f"page buffer must be bytes-like or a CPU torch.Tensor, got {type(buf).__name__}"
        ) from None
    if not view.c_contiguous:
        raise StorageBufferError("page buffer must be C-contiguous")
    if writable and view.readonly:
        raise StorageBufferError("output buffer is read-only")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def address_of(view: memoryview) -> int | None:
    """The address of a writable byte view's first byte, or None for a read-only one (ctypes
    cannot take the address of memory it may not write). The address is valid as long as the
    view's memory is."""
    if view.readonly or not len(view):
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
