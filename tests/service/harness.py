"""Start a real local service (``python -m launcher local``) for a test and always clean it up.

The launcher runs in its own session (process group); teardown sends SIGTERM (the launcher
forwards it to every rank, which stop cleanly) and, if anything is still alive after a bounded
wait, SIGKILLs the whole group. Nothing outlives the test, even when it fails.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpcache.client import Client

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0


def repo_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPCACHE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


@dataclass
class Service:
    proc: subprocess.Popen
    info: dict[str, Any]
    log_path: Path
    stopped: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return str(self.info["endpoint"])

    @property
    def pids(self) -> list[int]:
        return [int(p) for p in self.info["pids"]]

    def client(self, **kw: Any) -> Client:
        kw.setdefault("timeout_s", 30.0)
        return Client(self.endpoint, **kw)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM the launcher and wait; returns its exit code (kills the group on timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            raise AssertionError(f"the service did not stop within {timeout_s} s\n{self.log()}") from None
        self.stopped = True
        return code


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def running_service(
    tmp: Path, *args: str, nproc: int = 2, env: dict[str, str] | None = None, command: list[str] | None = None
) -> Iterator[Service]:
    """A service started with ``args`` (launcher options); stopped and reaped on exit."""
    tmp.mkdir(parents=True, exist_ok=True)
    ready = tmp / "ready.json"
    log_path = tmp / "service.log"
    ready.unlink(missing_ok=True)
    argv = command or [sys.executable, "-m", "launcher", "local", "--nproc", str(nproc)]
    argv = [*argv, "--endpoint", "tcp://127.0.0.1:0", "--ready-file", str(ready), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=repo_env(**(env or {})), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    service = Service(proc, {}, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None:
                raise AssertionError(f"the service exited with {proc.returncode} before it was ready\n{service.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the service was not ready in {START_TIMEOUT_S} s\n{service.log()}")
            time.sleep(0.05)
        service.info = json.loads(ready.read_text())
        yield service
    finally:
        if proc.poll() is None:
            with contextlib.suppress(AssertionError):
                service.stop()
        kill_group(proc)


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket process ``pid`` listens on, read from /proc (no
    ss or netstat needed): what a local process looking for the service's ports would find."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with contextlib.suppress(OSError), open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                addr_hex, port_hex = fields[1].split(":")
                raw = bytes.fromhex(addr_hex)
                if width == 8:
                    addr = ".".join(str(b) for b in raw[::-1])
                else:
                    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                    addr = ipaddress.IPv6Address(b"".join(words)).compressed
                found.append((addr, int(port_hex, 16)))
    return sorted(found)
