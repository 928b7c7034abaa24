"""What a user meets when a start fails: one line on stderr that names the setting and the cause,
exit code 2, nothing created on disk (the checks create nothing; the ranks create the storage tier
only once every rank passed them), the traceback only with --log-level DEBUG. A client whose first
call times out says what listens at the endpoint and how to start a service."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import protocol as p
from launcher.__main__ import main
from launcher.local import free_port
from tests.service.harness import REPO, repo_env
from tpcache.client import AsyncClient, Client
from tpcache.io.storage.file import FileBackend

STORE_ARGS = ["--kv-layout", "L2xH2xD4:fp32", "--host-pages", "16"]  # a storage tier needs a host tier
# 4 MiB a page: 3.8 TiB of device pages a rank
TOO_BIG = ["--kv-layout", "L32xH8xD128:bf16", "--device-pages", "1000000", "--host-pages", "16"]


def one_line(err: str) -> str:
    """The one non-empty line of ``err`` (fails when there are more, or none)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def test_a_storage_directory_in_use_by_a_running_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kv = tmp_path / "kv"
    running = FileBackend(kv / "rank1", capacity_bytes=1 << 20, shard=(1, 2))  # rank 1 of a running 2-rank group
    try:
        before = tree(tmp_path)
        assert main(["local", "--nproc", "2", "--storage-dir", str(kv), *STORE_ARGS]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"tpcache: configuration error: --storage-dir {kv}: in use by a running group ("), line
        assert tree(tmp_path) == before
    finally:
        running.close()


def test_an_unwritable_storage_directory_and_a_failed_check_create_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    assert main(["local", "--storage-dir", str(tmp_path / "a-file" / "kv"), *STORE_ARGS]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"--storage-dir {tmp_path / 'a-file' / 'kv'}: cannot write the storage tier there" in line
    # Every check but the memory check passes: still nothing on disk.
    assert main(["local", "--nproc", "2", "--storage-dir", str(tmp_path / "kv"), *TOO_BIG]) == 2
    assert "not enough memory for the KV pools" in one_line(capsys.readouterr().err)
    assert tree(tmp_path) == ["a-file"]


def test_a_remote_store_that_nothing_serves(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    assert main(["local", "--storage-url", f"redis://:hunter2@127.0.0.1:{port}/0", *STORE_ARGS]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"--storage-url redis://:***@127.0.0.1:{port}/0: cannot reach the Redis server at 127.0.0.1:{port} (" in line
    assert "hunter2" not in line
    url = f"mooncake://127.0.0.1:{port}?metadata=http://127.0.0.1:{port}/metadata"
    assert main(["local", "--storage-url", url, *STORE_ARGS]) == 2
    assert f"cannot reach the Mooncake master at 127.0.0.1:{port}" in one_line(capsys.readouterr().err)


def test_a_missing_or_unreadable_trace_for_the_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "trace.jsonl"
    assert main(["demo", "--trace", str(missing)]) == 2
    assert one_line(capsys.readouterr().err) == (
        f"tpcache: configuration error: --trace {missing}: no such file (a Mooncake-format trace, one JSON object "
        "a line)"
    )
    missing.write_text('{"input_length": 1}\n')
    assert main(["demo", "--trace", str(missing)]) == 2
    assert f"--trace {missing}: cannot read it as a Mooncake-format trace: " in one_line(capsys.readouterr().err)


@pytest.fixture
def not_a_store() -> Iterator[int]:
    """A port that accepts connections and closes them at once (some other program, not a store)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join(5)


@pytest.mark.multiprocess
def test_a_store_the_ranks_cannot_open_stops_the_group_with_one_line(not_a_store: int, tmp_path: Path) -> None:
    """The launcher's checks pass (the port accepts); every rank then fails to open the store: the
    group stops with rank 0's one line, and the demo adds nothing to it."""
    url = f"redis://127.0.0.1:{not_a_store}/0"
    argv = [sys.executable, "-m", "launcher", "demo", "--nproc", "2", "--storage-url", url, *STORE_ARGS]
    done = subprocess.run(argv, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr
    line = one_line(done.stderr)
    assert line.startswith(f"tpcache: cannot start: rank 0: --storage-url {url}: cannot open the storage tier: "), line
    assert done.stdout == ""
    # At DEBUG the traceback comes too (one rank, as torchrun would start it).
    env = repo_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    argv = [sys.executable, "-m", "launcher", "serve", "--storage-url", url, *STORE_ARGS, "--log-level", "DEBUG"]
    debug = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert debug.returncode == 2, debug.stderr
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.rstrip().splitlines()[-1].startswith(f"tpcache: cannot start: --storage-url {url}: ")


def test_an_event_stream_port_in_use_is_named_before_start(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["local", "--events-endpoint", f"tcp://127.0.0.1:{port}"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        f"tpcache: configuration error: --events-endpoint tcp://127.0.0.1:{port}: cannot bind port"
    ), line


@pytest.mark.multiprocess
def test_an_event_stream_that_cannot_bind_stops_rank_0_with_its_setting_named(tmp_path: Path) -> None:
    """The checks pass (they probe TCP ports only); rank 0 then cannot bind the stream's IPC path:
    it names the setting and exits, its client endpoint closed again."""
    where = f"ipc://{tmp_path}/absent/events"
    argv = [
        sys.executable,
        "-m",
        "launcher",
        "local",
        "--nproc",
        "1",
        "--events-endpoint",
        where,
        "--log-level",
        "WARNING",
    ]
    done = subprocess.run(argv, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert one_line(done.stderr).startswith(f"tpcache: cannot bind --events-endpoint {where}: event stream "), (
        done.stderr
    )


@pytest.mark.multiprocess
def test_a_failed_check_under_torchrun_is_one_line_from_rank_0_and_creates_nothing(tmp_path: Path) -> None:
    """The README's torchrun command on a machine too small for its pools, on two ranks."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    kv = tmp_path / "kv"
    argv = [torchrun, "--nproc-per-node", "2", "-m", "launcher", "serve", *TOO_BIG, "--storage-dir", str(kv)]
    done = subprocess.run(argv, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("tpcache: configuration error: ")]
    assert len(ours) == 1 and "not enough memory for the KV pools" in ours[0], done.stderr
    # No rank printed a traceback ("[rank0]: Traceback ..."); torchrun prints its own, once.
    assert not any(line.startswith("[rank") for line in done.stderr.splitlines()), done.stderr
    assert done.stderr.count("Traceback (most recent call last)") <= 1, done.stderr
    # torchrun's summary names one failure, rank 0's, with the same line (from its error file).
    assert f"traceback : {ours[0]}" in done.stderr and "<NO_OTHER_FAILURES>" in done.stderr, done.stderr
    assert not kv.exists() and tree(tmp_path) == []


def test_a_client_whose_first_call_times_out_says_what_listens_there(tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(p.RequestTimeout) as refused:
        Client(f"tcp://127.0.0.1:{port}", timeout_s=0.2)
    assert f"nothing listens on 127.0.0.1:{port} (connection refused)" in str(refused.value)
    assert f"`python -m launcher local --nproc 2 --endpoint tcp://127.0.0.1:{port}`" in str(refused.value)
    path = tmp_path / "service.sock"
    with pytest.raises(p.RequestTimeout, match=f"no socket at {path}"):
        Client(f"ipc://{path}", timeout_s=0.2)
    with socket.socket(socket.AF_UNIX) as stale:  # what a stopped service leaves behind
        stale.bind(str(path))
    with pytest.raises(p.RequestTimeout, match=f"nothing listens on the socket {path} \\(connection refused"):
        Client(f"ipc://{path}", timeout_s=0.2)
    with pytest.raises(p.RequestTimeout, match=f"nothing listens on 127.0.0.1:{port} "):
        asyncio.run(AsyncClient.connect(f"tcp://127.0.0.1:{port}", timeout_s=0.2))
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        with pytest.raises(p.RequestTimeout, match=f"something listens on 127.0.0.1:{port} but sent no reply"):
            Client(f"tcp://127.0.0.1:{port}", timeout_s=0.2)
