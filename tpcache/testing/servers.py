"""Real store servers on 127.0.0.1 for tests and benchmarks: redis-server, and a Mooncake Store
(HTTP metadata server, master, and a segment-holder process that owns the store's memory).

A server that cannot start raises :class:`ServerError` with the reason and the tail of its log.
Every server dies with the thread that started it (``PR_SET_PDEATHSIG``), so a crashed test
leaves nothing running. The segment holder is a separate Mooncake client, so the cache's reads
and writes cross a real TCP connection rather than a memcpy into the caller's own segment.

``python -m tpcache.testing.servers mooncake -- COMMAND...`` is a local Mooncake Store in one
command: it enters a private network namespace, starts the metadata server, the master and a
segment holder there, runs COMMAND beside them with ``TPCACHE_STORAGE_URL`` set to the store's URL
(so ``python -m launcher local ...`` uses it as is), and stops the store when COMMAND exits, with
COMMAND's exit code. Without root it says how to run under ``unshare --net --map-root-user``;
``--shared-network`` runs without a namespace and warns which ports are open on every interface.

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
import tempfile
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
    the same ports, for outage tests. Must run in a private network namespace (see ``netns``)
    unless ``shared_network`` (then its transfer engine is reachable on every interface).
    """

    def __init__(
        self, workdir: str | os.PathLike[str], holder_bytes: int = 256 << 20, *, shared_network: bool = False
    ) -> None:
        from tpcache.testing.netns import require_isolated

        if not shared_network:
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

    @property
    def pids(self) -> list[int]:
        """The store's running processes (metadata server, master, holder)."""
        return [server.pid for server in (self._metadata, self._master, self._holder) if server.proc is not None]

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


def _listening_sockets(pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds open."""
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    out.add(int(target[8:-1]))
    return out


def ports_on_all_interfaces(pids: list[int]) -> list[int]:
    """TCP ports that ``pids`` listen on at the wildcard address (0.0.0.0 or ::), from /proc."""
    inodes = set().union(*(_listening_sockets(pid) for pid in pids)) if pids else set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            for row in fh.readlines()[1:]:
                fields = row.split()
                address, port = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and int(fields[9]) in inodes and set(address) == {"0"}:
                    ports.add(int(port, 16))
    return sorted(ports)


NO_NAMESPACE = (
    "tpcache: a local Mooncake Store runs in a private network namespace (Mooncake's transfer engine listens "
    "on every interface) and entering one needs root: run `unshare --net --map-root-user python -m "
    "tpcache.testing.servers mooncake -- COMMAND...`, or pass --shared-network to run without one"
)


def _mooncake_main(args: argparse.Namespace) -> int:
    """A Mooncake Store and ``args.command`` in one private network namespace; the command's exit code."""
    from tpcache.testing import netns

    command = [c for c in args.command if c != "--"] if args.command[:1] == ["--"] else args.command
    if not command:
        print(
            "tpcache: give the command to run beside the store after --, e.g. -- python -m launcher local",
            file=sys.stderr,
        )
        return 2
    if netns.isolated():
        netns.loopback_up()  # a namespace made by `unshare --net` starts with loopback down
    elif not args.shared_network and netns.isolate() is not None:
        print(NO_NAMESPACE, file=sys.stderr)
        return 2
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tpcache-mooncake-"))
    try:
        store = MooncakeStore(workdir, holder_bytes=args.bytes, shared_network=args.shared_network)
        store.start()
    except (ServerError, RuntimeError) as exc:
        print(f"tpcache: cannot start a local Mooncake Store: {exc}", file=sys.stderr)
        return 1
    try:
        if args.shared_network:
            ports = ", ".join(map(str, ports_on_all_interfaces(store.pids))) or "none yet"
            print(
                f"tpcache: warning: --shared-network: the Mooncake Store listens on every interface on port(s) "
                f"{ports} (its transfer engine), as does every Mooncake client the command starts: other hosts on "
                "this network can reach them",
                file=sys.stderr,
                flush=True,
            )
        print(f"tpcache: Mooncake Store ready: TPCACHE_STORAGE_URL={store.url}", file=sys.stderr, flush=True)
        env = {**store.env, "TPCACHE_STORAGE_URL": store.url}
        try:
            child = subprocess.Popen(command, env=env)
        except OSError as exc:
            print(f"tpcache: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            return 127

        def forward(signum: int, frame: object) -> None:
            child.send_signal(signum)

        signal.signal(signal.SIGINT, forward)
        signal.signal(signal.SIGTERM, forward)
        return child.wait()
    finally:
        store.stop()
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _size(text: str) -> int:
    from tpcache.service.config import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or e.g. 256MiB, 1GiB)") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tpcache.testing.servers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    holder = sub.add_parser("holder", help="a Mooncake client that mounts a segment and holds it")
    holder.add_argument("--metadata", required=True)
    holder.add_argument("--master", required=True)
    holder.add_argument("--bytes", type=int, required=True)
    mooncake = sub.add_parser(
        "mooncake",
        help="a local Mooncake Store and a command, together in a private network namespace",
        description="Start a Mooncake Store (metadata server, master, segment holder) on 127.0.0.1 and run COMMAND "
        "beside it with TPCACHE_STORAGE_URL set to its URL; the store stops when COMMAND exits.",
    )
    mooncake.add_argument(
        "--bytes", type=_size, default=1 << 30, help="memory the segment holder mounts, e.g. 256MiB [default 1GiB]"
    )
    mooncake.add_argument("--dir", help="directory for the servers' logs [default: a temporary one]")
    mooncake.add_argument(
        "--shared-network",
        action="store_true",
        help="run in this network namespace (no root needed; Mooncake's ports are then open on every interface)",
    )
    mooncake.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = ap.parse_args(argv)
    if args.cmd == "mooncake":
        return _mooncake_main(args)
    return _holder_main(args.metadata, args.master, args.bytes)


if __name__ == "__main__":
    raise SystemExit(main())
