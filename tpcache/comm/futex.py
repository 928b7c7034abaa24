"""Linux futex wait/wake on a shared mapping, through ctypes (no compiled extension).

The shm transport sleeps on a peer's generation word and the peer wakes it right after publishing, so
a waiting rank gives its core away yet wakes as fast as the kernel allows. ``sched_yield`` is no
substitute: under CFS it does not reliably run the rank that shares the core, and ``time.sleep``
rounds up to the timer slack (about 50 us).

Futexes here are shared (no FUTEX_PRIVATE_FLAG): the kernel keys them by the mapped file and offset,
so processes that map the same segment meet on the same word. Only the low 32 bits of a word are
compared (little-endian: the word's address is its low half).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None or sys.byteorder != "little":
        return None
    if os.environ.get("TPCACHE_NO_FUTEX"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load()


def available() -> bool:
    """True where futex wait/wake can be used (Linux on x86-64 or aarch64)."""
    return _syscall is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``expected`` (low 32 bits), at most ``timeout_s``.

    Returns on a wake, a changed value, a signal or the timeout; the caller re-checks its condition.
    """
    assert _syscall is not None
    timeout_s = max(timeout_s, 0.0)
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    value = ctypes.c_int32(expected & 0xFFFFFFFF).value
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, value, ctypes.byref(ts), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address``."""
    assert _syscall is not None
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
