"""A child process in a session of its own, bounded in time: for engines (vLLM, SGLang) whose own
processes (engine core, workers, schedulers) must all go when the run ends or times out."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


def run_in_own_session(
    argv: Sequence[str], log_file: Path, env: Mapping[str, str], timeout_s: float, cwd: Path | None = None
) -> int | str:
    """Run ``argv`` with stdout and stderr in ``log_file``; its exit code, or why it did not finish.
    Whatever it started is killed with it (its process group), finished or not."""
    with open(log_file, "w") as log:
        proc = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"timeout after {timeout_s:.0f} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
