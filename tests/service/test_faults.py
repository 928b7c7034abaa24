"""Failures of ranks and of the internal channel: fail closed with a clear reason, never hang;
signals on any rank stop every rank cleanly, leaving nothing behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import protocol as p
from tests.service.checks import fresh_tokens
from tests.service.harness import pid_alive, running_service, wait_for

pytestmark = pytest.mark.multiprocess

FAST = ("--page-size", "4", "--device-pages", "64", "--host-pages", "64")


def shm_files_of(pids: list[int]) -> list[str]:
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return [n for n in names if n.startswith("tpcache") and any(f"-{pid}-" in n for pid in pids)]


def insert(c: object, tokens: list[int]) -> None:
    lk = c.lock(tokens)  # type: ignore[attr-defined]
    pages = c.alloc(lk.lease, len(tokens) // 4).device_page_ids  # type: ignore[attr-defined]
    c.insert(tokens, pages, lease=lk.lease)  # type: ignore[attr-defined]
    c.release(lk.lease)  # type: ignore[attr-defined]


def test_dead_rank_closes_the_cache_with_a_reason(tmp_path: Path) -> None:
    args = (*FAST, "--round-timeout", "2", "--heartbeat", "0.2", "--broken-group-exit", "120")
    with running_service(tmp_path, *args) as service, service.client(timeout_s=20) as c:
        tokens = fresh_tokens(16)
        insert(c, tokens)
        assert c.match(tokens).hit_tokens == 16
        os.kill(service.pids[1], signal.SIGKILL)
        health = wait_for(lambda: (h := c.health()).state == "closed" and h, timeout_s=20)
        assert health, "the survivors did not fail closed"
        assert "collective failed" in health.reason, health.reason
        assert pid_alive(service.pids[0])
        # A closed cache serves misses and never reports a hit; what needs a round is refused,
        # saying the group must be restarted (no round can run without every rank).
        assert c.match(tokens).hit_tokens == 0
        with pytest.raises(p.CacheClosed, match="must be restarted"):
            c.lock(tokens)
        with pytest.raises(p.CacheClosed, match="flush cannot reopen it"):
            c.flush()
        assert c.health().state == "closed"
    assert not pid_alive(service.pids[0])


def test_a_stalled_rank_breaks_the_group_for_good(tmp_path: Path) -> None:
    """A rank stopped past the round timeout: rank 0's collective fails, and even once the rank
    runs again the group cannot agree: flush is refused (restart needed), never "ok" on a cache
    that stays closed."""
    args = (*FAST, "--round-timeout", "2", "--heartbeat", "0.2", "--broken-group-exit", "120")
    with running_service(tmp_path, *args) as service, service.client(timeout_s=20) as c:
        insert(c, fresh_tokens(8))
        os.kill(service.pids[1], signal.SIGSTOP)
        try:
            assert wait_for(lambda: c.health().state == "closed", timeout_s=30)
        finally:
            os.kill(service.pids[1], signal.SIGCONT)
        for _ in range(3):
            with pytest.raises(p.CacheClosed, match="must be restarted"):
                c.flush()
            health = c.health()
            assert health.state == "closed" and "collective failed" in health.reason, health


def test_a_broken_group_exits_for_a_restart(tmp_path: Path) -> None:
    """By default the ranks of a broken group exit non-zero soon after, for torchrun to restart."""
    args = (*FAST, "--round-timeout", "2", "--heartbeat", "0.2", "--broken-group-exit", "1")
    with running_service(tmp_path, *args) as service:
        with service.client(timeout_s=20) as c:
            insert(c, fresh_tokens(8))
        os.kill(service.pids[1], signal.SIGKILL)
        assert service.proc.wait(60) != 0, service.log()
        assert not pid_alive(service.pids[0])
        assert "must be restarted" in service.log() and "Traceback" not in service.log(), service.log()


def test_a_rank_that_misses_a_batch_fails_the_group_closed(tmp_path: Path) -> None:
    # Batch 0 is the first lock; rank 1 drops batch 1 (the second lock) as if it never arrived.
    env = {"TPCACHE_FAULT_DROP_BATCH": "1"}
    with running_service(tmp_path, *FAST, "--heartbeat", "60", env=env) as service, service.client() as c:
        c.lock(fresh_tokens(8))
        c.lock(fresh_tokens(8))
        health = c.health()
        assert health.state == "closed"
        assert "seq differs" in health.reason, health.reason
        stats = c.stats().values  # every rank still answers
        assert stats["rank1.closed"] == 1 and stats["rank0.closed"] == 1
        assert all(pid_alive(pid) for pid in service.pids)


@pytest.mark.parametrize(("rank", "signum"), [(1, signal.SIGTERM), (0, signal.SIGINT)])
def test_a_signal_on_any_rank_stops_every_rank_cleanly(tmp_path: Path, rank: int, signum: int) -> None:
    with running_service(tmp_path, *FAST) as service:
        with service.client() as c:
            insert(c, fresh_tokens(8))
        pids = service.pids
        os.kill(pids[rank], signum)
        assert service.proc.wait(30) == 0, service.log()
        assert not any(pid_alive(pid) for pid in pids)
        assert shm_files_of(pids) == []
        assert "Traceback" not in service.log(), service.log()
