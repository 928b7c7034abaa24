"""A private network namespace for tests and benchmarks: what they start is reachable only here.

Mooncake's transfer engine listens on every interface whatever its bind settings say (its data
and handshake ports), and every Mooncake client, a tpcache rank included, runs one. In a network
namespace of its own with only a loopback interface, "every interface" is loopback: nothing the
test suite starts can be reached from another host. Entering one needs root (CI runs as root);
children (rank processes, servers) inherit it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1

_reason: str | None = None  # why this process could not isolate itself, once it tried


def isolated() -> bool:
    """Whether this process sees no network interface but loopback."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def loopback_up() -> None:
    """Bring loopback up in this namespace (one ``unshare --net`` made starts with it down); best effort."""
    with contextlib.suppress(OSError):
        _loopback_up()


def isolate() -> str | None:
    """Move this process (its calling thread, and every child it starts later) into a new network
    namespace with loopback up. Returns None on success (or when already isolated), else why not."""
    global _reason
    if isolated():
        return None
    if os.geteuid() != 0:
        _reason = "entering a private network namespace needs root (or run under `unshare --net --map-root-user`)"
        return _reason
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        _reason = f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
        return _reason
    _loopback_up()
    return None


def require_isolated(what: str) -> None:
    """Raise RuntimeError, with the reason, unless this process is in a private network."""
    if not isolated():
        raise RuntimeError(
            f"{what} runs only in a private network namespace (Mooncake's transfer engine listens on all "
            f"interfaces): {_reason or 'this process is not in one'}"
        )
