"""Leftover segments of crashed runs are removed on the next start; live runs' segments are kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tpcache.comm.shm import PREFIX, cleanup_stale_segments, segment_name


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_segments_of_dead_creators_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / f"{PREFIX}{dead_pid()}-29500-0123456789ab"
    live = tmp_path / segment_name(port=1234)
    other = tmp_path / "unrelated-file"
    garbled = tmp_path / f"{PREFIX}notapid-1"
    for path in (stale, live, other, garbled):
        path.write_bytes(b"x")
    removed = cleanup_stale_segments(str(tmp_path))
    assert removed == [stale.name]
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name, garbled.name])


def test_segment_names_carry_pid_port_and_a_random_token() -> None:
    a, b = segment_name(port=29500), segment_name(port=29500)
    assert a.startswith(f"{PREFIX}{os.getpid()}-29500-")
    assert a != b


def test_missing_directory_is_not_an_error(tmp_path: Path) -> None:
    assert cleanup_stale_segments(str(tmp_path / "absent")) == []
