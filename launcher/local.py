"""`python -m launcher local`: N rank processes on this host without torchrun (gloo, free port).

The ranks are children in this launcher's process group. SIGINT/SIGTERM here are forwarded to
every rank (each then stops the group cleanly); the launcher exits when every rank has, with the
first non-zero exit code. A follower that dies does not take the others down: they fail closed and
keep answering (health says why) until stopped, as the design asks. Rank 0 dying (a signal, not a
stop) ends the group: nobody can answer clients any more. The followers notice it themselves and
exit; the launcher stops any that remain and exits with ``EXIT_LEADER_GONE`` (3), after one line
that names rank 0's signal. Ranks die with the launcher:
each asks the kernel for SIGTERM when its parent exits (Linux ``PR_SET_PDEATHSIG``), so a
launcher killed with SIGKILL leaves no orphan serving. The ranks write nothing to stdout (their
logs go to stderr), so a command's stdout holds only what the command itself prints.
"""

from __future__ import annotations

import ctypes
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
from tpcache.comm.store import LISTEN_FD_ENV
from tpcache.service.config import FIELDS, Resolved, ServiceConfig

STOP_GRACE_S = 15.0
EXIT_LEADER_GONE = 3  # rank 0 died: the group is gone (the followers exit with the same code)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Any:
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies (Linux; elsewhere
    None: the ranks then notice the leader's silence and exit on their own)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child runs only the call
    parent = os.getpid()

    def setup() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call took effect
            os._exit(1)

    return setup


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a file
        return None


def as_resolved(config: ServiceConfig | Resolved) -> Resolved:
    """A caller's configuration; a bare ServiceConfig has no sources to report beyond 'caller'."""
    if isinstance(config, Resolved):
        return config
    return Resolved(config, {name: "caller" for name in FIELDS})


def spawn_ranks(
    config: ServiceConfig | Resolved, nproc: int, *, extra_env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    if nproc < 1:
        raise ValueError("--nproc must be >= 1")
    # Rank 0's rendezvous socket is bound here and handed over, so no other process can take the
    # port between its choice and its use (tpcache.comm.store.LISTEN_FD_ENV).
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(max(128, nproc))
        port = int(listener.getsockname()[1])
        base = {**os.environ, **resolved_env(as_resolved(config)), **(extra_env or {})}
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
        base.setdefault("OMP_NUM_THREADS", "1")  # ranks share the host's cores
        # torch's C++ warnings (c10d's "hostname of the client socket cannot be retrieved" on a host
        # without a resolvable name) would bury the one line a failed start prints; errors still show.
        base.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        procs = []
        for rank in range(nproc):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"}
            fds = (listener.fileno(),) if rank == 0 else ()
            if fds:
                env[LISTEN_FD_ENV] = str(listener.fileno())
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "launcher", "serve"],
                    env=env,
                    stdout=_stderr_fd(),  # a rank's stdout is the launcher's stderr
                    preexec_fn=_die_with_parent(),
                    pass_fds=fds,
                )
            )
    finally:
        listener.close()  # rank 0 holds its own copy
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


class RankExited(RuntimeError):
    """A rank exited before the service was ready. ``code`` is its exit code: 2 when the group
    refused to start, after rank 0 printed the one line that says why."""

    def __init__(self, rank: int, code: int) -> None:
        super().__init__(f"rank {rank} exited with code {code} before the service was ready")
        self.rank, self.code = rank, code


def wait_ready(path: str | Path, procs: list[subprocess.Popen], timeout_s: float = 120.0) -> dict[str, Any]:
    """The ready file rank 0 writes once serving; raises RankExited if a rank exits first,
    TimeoutError when time runs out."""
    deadline = time.monotonic() + timeout_s
    target = Path(path)
    while time.monotonic() < deadline:
        if target.exists():
            return json.loads(target.read_text())
        for rank, proc in enumerate(procs):
            if proc.poll() is not None:
                raise RankExited(rank, int(proc.returncode))
        time.sleep(0.05)
    raise TimeoutError(f"the service was not ready within {timeout_s:g} s")


def run_local(config: ServiceConfig | Resolved, nproc: int) -> int:
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
    leader_died: int | None = None

    def leader_killed() -> bool:
        """Whether rank 0 was killed (not stopped by a forwarded signal); says so once."""
        nonlocal leader_died
        code = procs[0].poll()
        if not forwarded and leader_died is None and code is not None and code < 0:
            leader_died = -code
            print(
                f"tpcache: rank 0 (pid {procs[0].pid}) was killed by {signal.Signals(-code).name}; "
                f"stopping the other ranks (exit code {EXIT_LEADER_GONE})",
                file=sys.stderr,
                flush=True,
            )
            return True
        return False

    while any(proc.poll() is None for proc in procs):
        if leader_killed():
            forward(signal.SIGTERM, None)
        if forwarded and stop_deadline is None:
            stop_deadline = time.monotonic() + STOP_GRACE_S
        if stop_deadline is not None and time.monotonic() > stop_deadline:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        time.sleep(0.1)
    leader_killed()  # the followers may all have exited on their own before the loop saw rank 0 die
    codes = [int(proc.returncode) for proc in procs]
    if leader_died is not None:
        return EXIT_LEADER_GONE
    bad = [c for c in codes if c not in (0, -signal.SIGTERM)]
    return bad[0] if bad else 0
