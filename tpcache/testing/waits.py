"""Waiting for a rank's storage work in tests, by progress rather than by a count of rounds.

A storage lookup or read runs on the rank's I/O threads; a round only agrees what has landed. A
test that steps a fixed number of rounds therefore depends on how fast those threads get the CPU,
and on a loaded machine it can run out of rounds with the read still in flight. These helpers wait
for the rank's own operations to land between rounds, so each round sees the progress the last one
started, and only a hang guard is timed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

HANG_GUARD_S = 120.0  # a healthy run never gets near it


def landed(tp: Any, deadline: float) -> None:
    """Wait until no copy or storage operation this rank started is still running."""
    while True:
        tp.shell.landed()
        if tp.shell.drained():
            return
        assert time.monotonic() < deadline, "this rank's copies and storage operations never landed"
        time.sleep(0.001)


def stepped_until(tp: Any, done: Callable[[], Any], what: str, timeout_s: float = HANG_GUARD_S) -> None:
    """Step ``tp`` until ``done()`` holds, letting this rank's operations land between rounds."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        tp.step()
        landed(tp, deadline)


def prefetched(tp: Any, lease: int, timeout_s: float = HANG_GUARD_S) -> tuple[str, int]:
    """Step ``tp`` until the storage prefetch of ``lease`` is done; return its final status."""

    def done() -> bool:
        return tp.core.prefetch_status(lease)[0] == "done"

    stepped_until(tp, done, "the prefetch did not finish", timeout_s)
    return tp.core.prefetch_status(lease)


def settled(tp: Any, timeout_s: float = HANG_GUARD_S) -> None:
    """Step ``tp`` until a round finds nothing in flight on any rank."""
    deadline = time.monotonic() + timeout_s
    while not tp.step().idle:
        assert time.monotonic() < deadline, f"copies and storage operations still in flight after {timeout_s:.0f} s"
        landed(tp, deadline)
