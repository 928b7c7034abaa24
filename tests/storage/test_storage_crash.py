"""A writer killed with SIGKILL mid-write: a fresh instance never sees a torn page and still works."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.storage.storage_helpers import make_keys, make_page
from tpcache.io.storage.file import FileBackend

REPO = Path(__file__).resolve().parents[2]
PAGE = 256 << 10

# The child stops halfway through writing one record (a real partial write on disk), tells the
# parent, and waits to be killed; the parent decides when, so the tear is at a known place.
TORN_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from tpcache.io.storage.file import FileBackend
    from tests.storage.storage_helpers import make_keys, make_page
    root, page = sys.argv[1], int(sys.argv[2])
    b = FileBackend(root, capacity_bytes=64 << 20, fsync="never")
    keys = make_keys(4)
    assert b.put(keys[:3], [make_page(i, page) for i in range(3)]) == [True] * 3
    real = os.pwritev
    def half(fd, bufs, offset):
        data = b"".join(bytes(x) for x in bufs)
        os.pwrite(fd, data[: len(data) // 2], offset)
        print("torn", flush=True)
        time.sleep(60)
    os.pwritev = half
    b.put(keys[3:], [make_page(3, page)])
    """
)

# The child writes pages as fast as it can and reports each completed put; the kill lands
# wherever it lands (often inside a write syscall).
LOOP_CHILD = textwrap.dedent(
    """
    import sys
    from tpcache.io.storage.file import FileBackend
    from tests.storage.storage_helpers import make_keys, make_page
    root, page = sys.argv[1], int(sys.argv[2])
    b = FileBackend(root, capacity_bytes=1 << 30, fsync="never")
    keys = make_keys(100000)
    for i, k in enumerate(keys):
        assert b.put([k], [make_page(i, page)]) == [True]
        print(i, flush=True)
    """
)


def _spawn(code: str, root: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-c", code, str(root), str(PAGE)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.multiprocess
def test_torn_write_is_never_visible(tmp_path: Path) -> None:
    proc = _spawn(TORN_CHILD, tmp_path)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "torn"
    _kill(proc)
    keys = make_keys(4)
    with FileBackend(tmp_path, capacity_bytes=64 << 20) as b:
        assert b.stats()["startup_discarded_torn"] == 1
        assert b.exists(keys) == [True, True, True, False]
        out = [bytearray(PAGE) for _ in keys]
        assert b.get(keys, out) == [True, True, True, False]
        assert [bytes(o) for o in out[:3]] == [make_page(i, PAGE) for i in range(3)]
        # Still fully usable: the torn key can be written and read again.
        assert b.put(keys[3:], [make_page(3, PAGE)]) == [True]
        assert b.get(keys[3:], out[3:]) == [True] and bytes(out[3]) == make_page(3, PAGE)
    with FileBackend(tmp_path, capacity_bytes=64 << 20) as b:
        assert b.exists(keys) == [True] * 4


@pytest.mark.multiprocess
def test_kill_at_any_point_gives_only_whole_pages(tmp_path: Path) -> None:
    proc = _spawn(LOOP_CHILD, tmp_path)
    assert proc.stdout is not None
    acked = -1
    while acked < 30:
        acked = int(proc.stdout.readline())
    _kill(proc)
    keys = make_keys(acked + 200)
    with FileBackend(tmp_path, capacity_bytes=1 << 30) as b:
        out = [bytearray(PAGE) for _ in keys]
        ok = b.get(keys, out)
        assert all(ok[: acked + 1])  # every acked put survives a process kill
        for i, hit in enumerate(ok):
            if hit:
                assert bytes(out[i]) == make_page(i, PAGE)  # never wrong or partial bytes
            else:
                assert bytes(out[i]) == bytes(PAGE)
        assert b.put(keys[-1:], [make_page(1, PAGE)]) == [True]
