"""How much memory this host can still give, and byte counts in words (for messages)."""

from __future__ import annotations

import contextlib
import os


def available_memory() -> int | None:
    """Bytes this host can still give without swapping (Linux MemAvailable), or None if unknown."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units, for people: ``64 MiB``, ``1.5 GiB``, ``512 B``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} B"


class PoolMemoryError(MemoryError):
    """A KV pool does not fit in the memory this host has; the message gives both sizes."""


def check_fits(nbytes: int, what: str) -> None:
    """Raise PoolMemoryError before allocating ``nbytes`` for ``what`` when the host cannot give
    them: touching memory the host does not have gets the process killed, not an error."""
    have = available_memory()
    if have is not None and nbytes > have:
        raise PoolMemoryError(
            f"the {what} needs {format_bytes(nbytes)}, but this machine has {format_bytes(have)} available; "
            "make the pool smaller"
        )
