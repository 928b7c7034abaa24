from __future__ import annotations

import os
from pathlib import Path

from tpcache.io.storage.keys import StorageKey


def make_keys(n: int, *, ns: str = "ns", layout: int = 1, rank: int = 0, size: int = 1, base: int = 0):
    return [StorageKey(ns, layout, rank, size, base + i) for i in range(n)]


def make_page(i: int, nbytes: int) -> bytes:
    """Distinct, deterministic page bytes for index ``i``."""
    return (i.to_bytes(4, "little") * (nbytes // 4 + 1))[:nbytes]


def segment_files(root: Path, owner: str = "all") -> list[Path]:
    return sorted((root / owner).glob("*.seg"))


def flip_byte(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x5A]), offset)
    finally:
        os.close(fd)
