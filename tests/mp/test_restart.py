"""torchrun --max-restarts brings the service back after a rank dies: clients reconnect to the
same endpoint and what was durable in storage hits again, with the bytes that were written."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

import protocol as p
from launcher.local import free_port
from tests.service.checks import fresh_tokens
from tests.service.harness import pid_alive, running_service, wait_for
from tpcache.client import Client

pytestmark = pytest.mark.multiprocess

LAYOUT = "L2xH2xD8:fp32"
PAGE, PAGES = 4, 8
SECRET = "a secret the restarted group knows too"


def healthy(c: Client) -> bool:
    try:
        return c.call(p.HealthRequest(), timeout_s=5).state == "open"
    except p.RequestTimeout:  # sent to the group that died
        return False


def test_torchrun_restarts_a_group_that_lost_a_rank(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    command += ["--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.5"]
    command += ["--master-port", str(free_port()), "-m", "launcher", "serve"]
    args = ("--page-size", str(PAGE), "--device-pages", "32", "--host-pages", "64", "--kv-layout", LAYOUT)
    args += ("--storage-dir", str(tmp_path / "kv"), "--round-timeout", "3", "--heartbeat", "0.2")
    args += ("--endpoint", endpoint)  # a restarted group comes back where clients know to look
    ready = tmp_path / "ready.json"
    tokens = fresh_tokens(PAGES * PAGE)
    with running_service(tmp_path, *args, command=command, env={"TPCACHE_SECRET": SECRET}) as service:
        assert service.endpoint == endpoint
        first = service.pids
        survivor = Client(endpoint, token=SECRET, timeout_s=30)  # stays connected through the restart
        with Client(endpoint, token=SECRET, timeout_s=30) as c:
            lk = c.lock(tokens, prefetch="none")
            pages = list(c.alloc(lk.lease, PAGES).device_page_ids)
            data = os.urandom(len(c.get_pages(pages, lease=lk.lease).data))
            c.put_pages(pages, data, lease=lk.lease)
            c.insert(tokens, pages, lease=lk.lease)
            c.release(lk.lease)
            assert wait_for(
                lambda: (
                    (v := c.stats().values)["rank0.storage_written_pages"] >= PAGES
                    and v["rank1.storage_written_pages"] >= PAGES
                ),
                timeout_s=60,
            )
        os.kill(first[1], signal.SIGKILL)
        # torchrun stops the survivor and starts a new group; rank 0 writes a new ready file.
        info = wait_for(lambda: ready.exists() and (i := json.loads(ready.read_text()))["pids"] != first and i, 120)
        assert info, service.log()
        assert not any(pid_alive(pid) for pid in first)
        assert wait_for(lambda: healthy(survivor), timeout_s=60)  # reconnected, said hello again
        survivor.close()
        with Client(endpoint, token=SECRET, timeout_s=30) as c:  # the same endpoint, a new group behind it
            assert c.health().state == "open"
            assert c.match(tokens).hit_tokens == 0  # the tree is new ...
            lk = c.lock(tokens, prefetch="wait_complete")
            assert lk.storage_pages == PAGES  # ... and storage has it all
            loaded = list(c.load(lk.lease).device_page_ids)
            assert len(loaded) == PAGES
            assert wait_for(lambda: c.match(tokens).device_pages == PAGES, timeout_s=60)
            assert c.get_pages(loaded).data == data
            c.release(lk.lease)
            with pytest.raises(p.NotFound):
                c.release(lk.lease)
        # The whole log: the restarted ranks' start-up blocks push these lines out of log()'s tail.
        log = service.log_path.read_text(errors="replace")
        # Rank 0 says so if its round timed out first; else torchrun, which stops it, names the kill.
        said = ("must be restarted", "Signals.SIGKILL", "exitcode: -9")
        assert any(line in log for line in said), service.log()


def _write_durable(c: Client, tokens: list[int]) -> bytes:
    """PAGES pages of ``tokens`` with random bytes, written through to storage on both ranks."""
    lk = c.lock(tokens, prefetch="none")
    pages = list(c.alloc(lk.lease, PAGES).device_page_ids)
    data = os.urandom(len(c.get_pages(pages, lease=lk.lease).data))
    c.put_pages(pages, data, lease=lk.lease)
    c.insert(tokens, pages, lease=lk.lease)
    c.release(lk.lease)
    written = wait_for(
        lambda: (
            (v := c.stats().values)["rank0.storage_written_pages"] >= PAGES
            and v["rank1.storage_written_pages"] >= PAGES
        ),
        timeout_s=60,
    )
    assert written, c.stats().values
    return data


def _traffic(endpoint: str, stop: threading.Event) -> None:
    """Lookups and locks, back to back, until ``stop`` (errors and timeouts are expected)."""
    with contextlib.suppress(Exception), Client(endpoint, timeout_s=2.0) as c:
        while not stop.is_set():
            with contextlib.suppress(p.ProtocolError):
                c.release(c.lock(fresh_tokens(2 * PAGE), prefetch="none").lease)


@pytest.mark.parametrize("load", ["idle", "busy"])
def test_a_dead_leader_ends_the_group_and_a_restart_serves_what_was_durable(tmp_path: Path, load: str) -> None:
    """Rank 0 SIGKILLed: the follower exits on its own (it watches rank 0's process), the launcher
    stops and exits 3 saying why, and a group started on the same storage directory a second later
    starts (nothing holds the storage) and serves every durable page with its bytes. Rank 0 stopped
    (SIGSTOP) for less than the round timeout is a stall, not a death: the group serves on."""
    args = ("--page-size", str(PAGE), "--device-pages", "32", "--host-pages", "64", "--kv-layout", LAYOUT)
    args += ("--storage-dir", str(tmp_path / "kv"), "--round-timeout", "3", "--heartbeat", "0.2")
    tokens = fresh_tokens(PAGES * PAGE)
    with running_service(tmp_path / "first", *args) as service:
        leader, follower = service.pids
        with service.client() as c:
            data = _write_durable(c, tokens)
            os.kill(leader, signal.SIGSTOP)  # a stall shorter than the round timeout
            time.sleep(1.0)
            os.kill(leader, signal.SIGCONT)
            assert c.health().state == "open"
            assert pid_alive(follower)
        stop = threading.Event()
        traffic = threading.Thread(target=_traffic, args=(service.endpoint, stop), daemon=True)
        if load == "busy":
            traffic.start()
            time.sleep(0.5)
        try:
            os.kill(leader, signal.SIGKILL)
            code = service.proc.wait(30)
        finally:
            stop.set()
        assert code == 3, service.log()
        assert not pid_alive(follower)
        log = service.log_path.read_text(errors="replace")
        assert f"rank 0 (pid {leader}) was killed by SIGKILL" in log
        assert f"the leader (rank 0, pid {leader})" in log or "will not arrive" in log, log[-3000:]
    time.sleep(1.0)
    with running_service(tmp_path / "second", *args) as service, service.client() as c:
        lk = c.lock(tokens, prefetch="wait_complete")
        assert lk.storage_pages == PAGES
        loaded = list(c.load(lk.lease).device_page_ids)
        assert len(loaded) == PAGES
        assert wait_for(lambda: c.match(tokens).device_pages == PAGES, timeout_s=60)
        assert c.get_pages(loaded).data == data
        c.release(lk.lease)


@pytest.mark.parametrize("restarts", ["0", "1"])
def test_under_torchrun_rank_0_answers_what_is_in_flight_when_a_rank_dies(tmp_path: Path, restarts: str) -> None:
    """Requests waiting for a rank that then dies are answered CACHE_CLOSED by rank 0 before it
    exits on torchrun's SIGTERM, with or without restarts: none is left to time out."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    command += ["--nproc-per-node", "2", "--max-restarts", restarts, "--monitor-interval", "0.5"]
    command += ["--master-port", str(free_port()), "-m", "launcher", "serve"]
    args = ("--page-size", str(PAGE), "--device-pages", "32", "--round-timeout", "10", "--heartbeat", "0.2")
    with running_service(tmp_path, *args, command=command) as service, service.client(timeout_s=30) as c:
        follower = service.pids[1]
        os.kill(follower, signal.SIGSTOP)  # what is sent now waits for it (a round, a gathered answer)
        try:
            waiting = [c.submit(p.StatsRequest()) for _ in range(4)]
            waiting += [c.submit(p.LockRequest(tokens=fresh_tokens(2 * PAGE), prefetch="none")) for _ in range(4)]
            time.sleep(0.5)
        finally:
            os.kill(follower, signal.SIGKILL)
        outcomes = []
        for rid in waiting:
            try:
                outcomes.append(type(c.wait(rid)).__name__)
            except p.ProtocolError as exc:
                outcomes.append(type(exc).__name__)
        assert outcomes == ["CacheClosed"] * len(waiting), service.log()


@pytest.mark.parametrize("end", ["killed", "stopped"])
def test_a_follower_on_another_host_notices_a_dead_leader_by_its_connection(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], end: str
) -> None:
    """A follower that cannot watch rank 0's process (it runs on another host; a test setting makes
    it act so here) notices rank 0's death by its connection closing: rank 0 SIGKILLed while idle,
    the follower closes its cache and exits 3 at once, long before it would give rank 0 up for
    silent (twice the round timeout and more). Rank 0 stopped (SIGTERM) closes its connections
    too, after its stop batch: the follower stops with it (0), not taking that for a death. Ranks
    started without the launcher, which would stop the follower itself."""
    from launcher.local import ServiceConfig, spawn_ranks
    from tests.service.harness import REPO

    ready = tmp_path / "ready.json"
    config = ServiceConfig(
        endpoint="tcp://127.0.0.1:0",
        ready_file=str(ready),
        page_size=PAGE,
        device_pages=32,
        kv_layout=LAYOUT,
        round_timeout_s=10.0,
        heartbeat_s=0.2,
    )
    env = {"PYTHONPATH": str(REPO), "TPCACHE_TEST_NO_PIDFD": "1"}
    procs = spawn_ranks(config, 2, extra_env=env)
    try:
        assert wait_for(ready.exists, timeout_s=60), capfd.readouterr().err[-3000:]
        leader, follower = procs
        with Client(json.loads(ready.read_text())["endpoint"], timeout_s=5) as c:
            assert healthy(c)
        time.sleep(0.5)  # idle: heartbeats only
        start = time.monotonic()
        if end == "killed":
            leader.kill()
        else:
            leader.send_signal(signal.SIGTERM)
        code = follower.wait(3)  # the silence rule would take 2 x 10 s + 5 s
        elapsed = time.monotonic() - start
        err = capfd.readouterr().err
        gone = f"the leader (rank 0, pid {leader.pid}) closed its connection"
        if end == "killed":
            assert code == 3 and gone in err, err[-3000:]
        else:
            assert code == 0 and leader.wait(10) == 0 and gone not in err, err[-3000:]
        print(f"follower exited {code} {elapsed:.2f} s after rank 0 was {end}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
