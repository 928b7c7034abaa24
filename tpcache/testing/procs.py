"""Stopping a process for a stall test, and knowing it is stopped.

``kill(pid, SIGSTOP)`` returns once the signal is queued, not once the process is stopped: the
kernel stops a multi-threaded process when one of its threads handles the signal, and until then
its other threads keep running. On a loaded machine that thread may wait for a CPU long enough for
another thread to answer a request the test meant to hang. ``stop`` waits until every thread is
stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

STOP_TIMEOUT_S = 30.0


def _thread_states(pid: int) -> list[str]:
    """The scheduler state letter of each of ``pid``'s threads (``/proc/<pid>/task/*/stat``)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just exited
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
            states.append(stat[stat.rindex(")") + 2])  # after the command name, which may hold spaces
    return states


def stop(pid: int, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped (state T)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = _thread_states(pid)
        if states and all(s in "Tt" for s in states):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"process {pid} not stopped {timeout_s:g} s after SIGSTOP (thread states {states})")
        time.sleep(0.001)


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """``pid`` stopped for the block (every thread), continued after it."""
    try:
        stop(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
