"""`python -m launcher local`: N rank processes on this host without torchrun (gloo, free port).

The ranks are children in this launcher's process group. SIGINT/SIGTERM here are forwarded to
every rank (each then stops the group cleanly); the launcher exits when every rank has, with the
first non-zero exit code. A rank that dies does not take the others down: they fail closed and
keep answering (health says why) until stopped, as the design asks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launcher.options import resolved_env
from tpcache.service.config import ServiceConfig

STOP_GRACE_S = 15.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(
    config: ServiceConfig, nproc: int, *, extra_env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    if nproc < 1:
        raise ValueError("--nproc must be >= 1")
    port = free_port()
    base = {**os.environ, **resolved_env(config), **(extra_env or {})}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    base.setdefault("OMP_NUM_THREADS", "1")  # ranks share the host's cores
    procs = []
    for rank in range(nproc):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"}
        procs.append(subprocess.Popen([sys.executable, "-m", "launcher", "serve"], env=env))
    return procs


def stop_ranks(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM every live rank, wait, SIGKILL what is left; returns the exit codes."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [int(proc.returncode) for proc in procs]


def wait_ready(path: str | Path, procs: list[subprocess.Popen], timeout_s: float = 120.0) -> dict[str, Any]:
    """The ready file rank 0 writes once serving; raises if a rank exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    target = Path(path)
    while time.monotonic() < deadline:
        if target.exists():
            return json.loads(target.read_text())
        for rank, proc in enumerate(procs):
            if proc.poll() is not None:
                raise RuntimeError(f"rank {rank} exited with code {proc.returncode} before the service was ready")
        time.sleep(0.05)
    raise TimeoutError(f"the service was not ready within {timeout_s:g} s")


def run_local(config: ServiceConfig, nproc: int) -> int:
    procs = spawn_ranks(config, nproc)
    forwarded = False

    def forward(signum: int, frame: Any) -> None:
        nonlocal forwarded
        forwarded = True
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    stop_deadline: float | None = None
    while any(proc.poll() is None for proc in procs):
        if forwarded and stop_deadline is None:
            stop_deadline = time.monotonic() + STOP_GRACE_S
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        time.sleep(0.1)
    codes = [int(proc.returncode) for proc in procs]
    bad = [c for c in codes if c not in (0, -signal.SIGTERM)]
    return bad[0] if bad else 0
