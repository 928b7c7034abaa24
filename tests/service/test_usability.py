"""What a person running the service meets: the start-up block, the metrics port's /metrics,
/health and /ready, settings compared across ranks, and stopping (requests in flight answered,
nothing left behind, ranks gone with their launcher)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import protocol as p
from launcher.local import free_port
from tests.service.checks import cache_round_trip, fresh_tokens
from tests.service.harness import REPO, pid_alive, repo_env, running_service, wait_for
from tpcache.testing.procs import stop

pytestmark = pytest.mark.multiprocess

LAYOUT = "L2xH2xD4:fp32"  # 512 bytes a page of 4 tokens


def free_ports(n: int) -> int:
    """A port P with P..P+n-1 free on 127.0.0.1."""
    for _ in range(50):
        socks = [socket.socket() for _ in range(n)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            base = socks[0].getsockname()[1]
            for i, s in enumerate(socks[1:], 1):
                s.bind(("127.0.0.1", base + i))
            return int(base)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} adjacent free ports")


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def readme_metrics() -> set[str]:
    """The metrics docs/reference/metrics.md lists."""
    text = (REPO / "docs" / "reference" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(tpcache_[a-z_]+)` \|", text, re.M))


def exported_families(text: str) -> set[str]:
    """tpcache's metric families in a Prometheus text scrape (from its # TYPE lines)."""
    return {name for name in re.findall(r"^# TYPE (\S+) \S+$", text, re.M) if name.startswith("tpcache_")}


def shm_files_of(pids: list[int]) -> list[str]:
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return [n for n in names if n.startswith("tpcache") and any(f"-{pid}-" in n for pid in pids)]


def test_start_up_block_metrics_health_and_ready(tmp_path: Path) -> None:
    port = free_ports(2)
    config = tmp_path / "tpcache.yaml"
    config.write_text("page_size: 4\nround_timeout_s: 2\n")
    storage = tmp_path / "kv"
    args = ("--config", str(config), "--device-pages", "64", "--kv-layout", LAYOUT, "--storage-dir", str(storage))
    args += ("--storage-bytes", "4MiB", "--metrics-port", str(port), "--heartbeat-s", "0.2")
    # A broken group keeps answering (and its health says why) until stopped, instead of exiting.
    args += ("--broken-group-exit-s", "-1")
    args += ("--events-endpoint", "tcp://127.0.0.1:0")  # the event stream's families too
    with running_service(tmp_path, *args, env={"TPCACHE_HOST_PAGES": "32"}) as service:
        cache_round_trip(service)
        log = service.log()
        for rank in (0, 1):
            block = re.search(rf"tpcache \S+: rank {rank} of 2 serving \(pid \d+\)\n((?:  .*\n)+)", log)
            assert block, log
            lines = block.group(1)
            settings = dict(re.findall(r"^  settings \((.+?)\) (.*)$", lines, re.M))
            assert "device_pages=64 kv_layout=L2xH2xD4:fp32" in settings["command line"]
            assert (
                "storage_bytes=4 MiB heartbeat_s=0.2 broken_group_exit_s=-1.0 metrics_port=" in settings["command line"]
            )
            assert settings["environment"] == "host_pages=32"
            assert settings[f"file {config}"] == "page_size=4 round_timeout_s=2.0"
            assert "max_batch=1024" in settings["default"]
            assert "memory: L2xH2xD4:fp32, 512 B a page: device tier 64 pages = 32 KiB (host memory), " in lines
            assert "host tier 32 pages = 16 KiB" in lines
            assert re.search(r"round transport: shm; .*internal channel tcp://127\.0\.0\.1:\d+", lines)
            assert f"storage: {storage / f'rank{rank}'} (file backend), capacity 4 MiB" in lines
            assert "records checksummed, not authenticated (set storage_key to authenticate them)" in lines
            assert f"metrics: http://127.0.0.1:{port + rank}/metrics (/health, /ready)" in lines
        assert f"clients {service.endpoint}; internal channel" in log
        for rank in (0, 1):
            assert get(port + rank, "/ready") == (200, "ready\n")
            status, body = get(port + rank, "/health")
            assert status == 200 and json.loads(body)["state"] == "open"
            assert get(port + rank, "/nothing-here")[0] == 404
            text = get(port + rank, "/metrics")[1]
            assert exported_families(text) == readme_metrics(), "docs/reference/metrics.md's table and /metrics differ"
            for sample in (
                'tpcache_pages_capacity{tier="device"} 64.0',
                'tpcache_pages_capacity{tier="host"} 32.0',
                "tpcache_storage_capacity_bytes 4.194304e+06",
                'tpcache_transfer_issued_pages_total{kind="backup"}',
                "process_cpu_seconds_total",
                "python_gc_objects_collected_total",
            ):
                assert sample in text, (rank, sample)
            # No family mixes issued with done: one state per family.
            assert not re.search(r'state="(issued|done|written)"', text)
        # The cache holds the round trip's pages on both tiers; the gauges say so once published.
        used = wait_for(
            lambda: re.search(r'tpcache_pages_used\{tier="device"\} ([1-9][\d.]*)', get(port, "/metrics")[1]), 30
        )
        assert used, get(port, "/metrics")[1]
        # Rank 0 published the round trip's pages on the event stream; the other rank exports 0.
        stored = wait_for(
            lambda: re.search(r"^tpcache_event_stored_pages_total ([1-9][\d.]*)", get(port, "/metrics")[1], re.M), 30
        )
        assert stored, get(port, "/metrics")[1]
        text = get(port, "/metrics")[1]
        batches = float(re.search(r"^tpcache_event_batches_total (\S+)", text, re.M).group(1))
        ring = float(re.search(r"^tpcache_event_ring_batches (\S+)", text, re.M).group(1))
        assert batches >= 2 and ring == batches  # batch 0, then the round trip's; the ring holds them all
        assert float(re.search(r"^tpcache_event_published_bytes_total (\S+)", text, re.M).group(1)) > 0
        assert "tpcache_event_batches_total 0.0" in get(port + 1, "/metrics")[1]
        # A dead rank closes the survivor: /health says 503 and why.
        os.kill(service.pids[1], signal.SIGKILL)
        closed = wait_for(lambda: get(port, "/health")[0] == 503, 60)
        status, body = get(port, "/health")
        assert closed and status == 503, body
        health = json.loads(body)
        assert health["state"] == "closed" and "collective" in health["reason"], health
        assert "tpcache_closed 1.0" in get(port, "/metrics")[1]


def test_stop_answers_requests_in_flight_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """rank 1 is paused so that rank 0 sits in a round with a stats request (which then waits for
    rank 1's answer) and 64 more requests queued behind it; SIGTERM to rank 0 must answer all of
    them, with a result or with "the service is stopping", and every rank must exit 0."""
    with running_service(tmp_path, "--page-size", "4", "--device-pages", "64") as service:
        pids = service.pids
        with service.client(timeout_s=60) as c:
            cache_round_trip(service)
            try:
                stop(pids[1])
                stats = c.submit(p.StatsRequest())
                queued = c.submit_many([p.MatchRequest(tokens=fresh_tokens(8)) for _ in range(64)])
                os.kill(pids[0], signal.SIGTERM)
            finally:
                os.kill(pids[1], signal.SIGCONT)
            with pytest.raises(p.CacheClosed, match="the service is stopping"):
                c.wait(stats)
            outcomes = []
            for request_id in queued:
                try:
                    outcomes.append(c.wait(request_id).hit_tokens == 0)
                except p.CacheClosed as exc:
                    outcomes.append("the service is stopping" in exc.message)
            assert all(outcomes)
        assert service.proc.wait(60) == 0, service.log()
        assert not any(pid_alive(pid) for pid in pids)
        assert shm_files_of(pids) == []
        assert "Traceback" not in service.log(), service.log()


def test_ranks_exit_when_their_launcher_dies(tmp_path: Path) -> None:
    with running_service(tmp_path, "--page-size", "4", "--device-pages", "64") as service:
        pids = service.pids
        service.proc.kill()  # SIGKILL: the launcher cannot forward anything
        service.proc.wait(30)
        assert wait_for(lambda: not any(pid_alive(pid) for pid in pids), 60), service.log()
        assert shm_files_of(pids) == []
        assert "stopped" in service.log()


def test_ranks_with_different_settings_stop_together_and_say_which(tmp_path: Path) -> None:
    """torchrun-style ranks, each with its own command line: one differs in two settings."""
    env = repo_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    base = [sys.executable, "-m", "launcher", "serve", "--endpoint", "tcp://127.0.0.1:0", "--page-size", "4"]
    extra = [["--device-pages", "64"], ["--device-pages", "32", "--namespace", "other-model"]]
    procs = [
        subprocess.Popen(
            [*base, *extra[rank]],
            cwd=REPO,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2], results
    line = (
        "tpcache: configuration error: settings that must be equal on every rank differ: "
        'device_pages (rank 0 64, rank 1 32); namespace (rank 0 "", rank 1 "other-model")\n'
    )
    assert line in results[0][1], results[0][1]
    assert "Traceback" not in results[0][1] + results[1][1]
    assert results[0][0] == results[1][0] == ""  # nothing on stdout


def test_the_demo_stops_on_ctrl_c_with_every_rank(tmp_path: Path) -> None:
    """SIGINT to the demo's process group, as a terminal's Ctrl-C sends it, once the ranks serve."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", "demo", "--conversations", "40"],
        cwd=REPO,
        env=repo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        seen = ""
        assert proc.stderr is not None
        while "rank 1 of 2 serving" not in seen or "rank 0 of 2 serving" not in seen:
            line = proc.stderr.readline()
            assert line, f"the demo ended before its ranks served: {seen}"
            seen += line
        pids = [int(pid) for pid in re.findall(r"serving \(pid (\d+)\)", seen)]
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert out == ""
    assert re.search(r"tpcache demo: stopped by SIGINT after \d+ of \d+ requests; every rank stopped", err), err
    assert "Traceback" not in err, err
    assert not any(pid_alive(pid) for pid in pids) and shm_files_of(pids) == []
