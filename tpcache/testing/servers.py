"""Real store servers on 127.0.0.1 for tests and benchmarks: redis-server, and a Mooncake Store
(HTTP metadata server, master, and a segment-holder process that owns the store's memory).

A server that cannot start raises :class:`ServerError` with the reason and the tail of its log.
Every server dies with the thread that started it (``PR_SET_PDEATHSIG``), so a crashed test
leaves nothing running. The segment holder is a separate Mooncake client, so the cache's reads
and writes cross a real TCP connection rather than a memcpy into the caller's own segment.

``python -m tpcache.testing.servers holder --metadata URL --master HOST:PORT --bytes N`` is the
holder process itself: it joins the store, mounts N bytes, prints ``ready`` and stays until its
standard input closes or it is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


class ServerError(RuntimeError):
    """A test server could not be started; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class _Server:
    """One child process with its log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log, self.env = name, argv, log, env
        self.proc: subprocess.Popen | None = None

    def start(self, stdin: int | None = None, stdout: int | None = None) -> None:
        log = open(self.log, "ab")  # noqa: SIM115 - the child owns it
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=stdin if stdin is not None else subprocess.DEVNULL,
                stdout=stdout if stdout is not None else log,
                stderr=log,
                env=self.env,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise ServerError(f"cannot start {self.name} ({self.argv[0]}): {exc}") from None
        finally:
            log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def fail(self, why: str) -> ServerError:
        self.stop()
        return ServerError(f"{self.name} did not start: {why}\n{' '.join(self.argv)}\n{_tail(self.log)}")

    def wait_port(self, port: int, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise self.fail(f"it exited with code {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                return
            time.sleep(0.05)
        raise self.fail(f"nothing listened on 127.0.0.1:{port} within {timeout_s:.0f} s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self.proc = None


class RedisServer:
    """``redis-server --bind 127.0.0.1 --save '' --appendonly no`` on a free port (no persistence:
    a restart empties it). ``TPCACHE_REDIS_SERVER`` names another binary (e.g. valkey-server)."""

    def __init__(self, workdir: str | os.PathLike[str], port: int | None = None) -> None:
        binary = os.environ.get("TPCACHE_REDIS_SERVER") or shutil.which("redis-server") or shutil.which("valkey-server")
        if not binary:
            raise ServerError(
                "redis-server is not installed: `make setup` installs it as root (Debian package redis-server); "
                "otherwise install it or set TPCACHE_REDIS_SERVER to a redis-server or valkey-server binary"
            )
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        argv = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.dir), "--protected-mode", "yes"]
        self._server = _Server("redis-server", argv, self.dir / "redis.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self._server.pid

    def start(self) -> RedisServer:
        self._server.start()
        self._server.wait_port(self.port)
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _mooncake_dir() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("Mooncake is not installed: pip install 'tpcache[mooncake]' (make setup does)")
    return Path(list(spec.submodule_search_locations)[0])


class MooncakeStore:
    """A Mooncake Store on loopback: metadata server, master, segment holder (``holder_bytes``).

    ``stop_master``/``start_master`` and ``kill_holder``/``start_holder`` restart the pieces on
    the same ports, for outage tests. Must run in a private network namespace (see ``netns``).
    """

    def __init__(self, workdir: str | os.PathLike[str], holder_bytes: int = 256 << 20) -> None:
        from tpcache.testing.netns import require_isolated

        require_isolated("a local Mooncake Store")
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        master_bin = _mooncake_dir() / "mooncake_master"
        self.metadata_port, self.master_port, self.admin_port = free_port(), free_port(), free_port()
        self.holder_bytes = holder_bytes
        self.env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}
        self._metadata = _Server(
            "mooncake_http_metadata_server",
            [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1"]
            + ["--port", str(self.metadata_port), "--log-level", "WARNING"],
            self.dir / "metadata.log",
        )
        self._master = _Server(
            "mooncake_master",
            [str(master_bin), "-rpc_address=127.0.0.1", f"-rpc_port={self.master_port}", "-rpc_thread_num=2"]
            + ["-metrics_host=127.0.0.1", f"-metrics_port={self.admin_port}", "-enable_metric_reporting=false"],
            self.dir / "master.log",
            self.env,
        )
        self._holder = _Server(
            "Mooncake segment holder",
            [sys.executable, "-m", "tpcache.testing.servers", "holder", "--metadata", self.metadata]
            + ["--master", self.master, "--bytes", str(holder_bytes)],
            self.dir / "holder.log",
            self.env,
        )

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def master_pid(self) -> int:
        return self._master.pid

    @property
    def url(self) -> str:
        return f"mooncake://{self.master}?metadata={self.metadata}"

    @property
    def holder_pid(self) -> int:
        return self._holder.pid

    def start(self) -> MooncakeStore:
        try:
            self._metadata.start()
            self._metadata.wait_port(self.metadata_port)
            self.start_master()
            self.start_holder()
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        self._master.start()
        self._master.wait_port(self.master_port)

    def stop_master(self) -> None:
        self._master.stop(signal.SIGKILL)

    def start_holder(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the holder and wait until it has mounted its segment."""
        self._holder.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        proc = self._holder.proc
        assert proc is not None and proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
        if line != "ready":
            raise self._holder.fail(f"it said {line!r}" if line else f"no 'ready' within {timeout_s:.0f} s")

    def kill_holder(self) -> None:
        """SIGKILL the holder: its segment, and every page in it, is gone without a goodbye."""
        self._holder.stop(signal.SIGKILL)

    def stop(self) -> None:
        for server in (self._holder, self._master, self._metadata):
            server.stop()

    def __enter__(self) -> MooncakeStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _holder_main(metadata: str, master: str, nbytes: int) -> int:
    from tpcache.io.storage.mooncake_store import _load_client

    store = _load_client()()
    rc = store.setup("127.0.0.1", metadata, nbytes, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"setup returned {rc}", flush=True)
        return 1
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes the pipe (or dies)
    store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tpcache.testing.servers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    holder = sub.add_parser("holder", help="a Mooncake client that mounts a segment and holds it")
    holder.add_argument("--metadata", required=True)
    holder.add_argument("--master", required=True)
    holder.add_argument("--bytes", type=int, required=True)
    args = ap.parse_args(argv)
    return _holder_main(args.metadata, args.master, args.bytes)


if __name__ == "__main__":
    raise SystemExit(main())
