"""A real 2-rank group on a shared store (Mooncake Store with a separate segment holder, and
redis-server): restart, a second group sharing pages, a shard lost from the store, and a store that
goes away mid-run and comes back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.store.conftest import BACKENDS, store_url
from tpcache.testing.group import run_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("store")]
TIMEOUT_S = 240.0


class _Group(threading.Thread):
    """``run_group`` on a thread, so the test can act on the servers while the ranks run."""

    def __init__(self, name: str, args: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.scenario, self.args = name, args
        self.result: list[Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = run_group(2, self.scenario, self.args, timeout_s=TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001 - re-raised by outcome()
            self.error = exc

    def wait_for(self, marker: Path) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not marker.exists():
            if not self.is_alive():
                raise AssertionError(f"the group ended before {marker.name}: {self.error!r}")
            assert time.monotonic() < deadline, f"no {marker.name} within {TIMEOUT_S} s"
            time.sleep(0.02)

    def outcome(self) -> list[Any]:
        self.join(TIMEOUT_S)
        if self.error is not None:
            raise self.error
        assert self.result is not None, "the group did not finish"
        return self.result


@pytest.mark.parametrize("backend", BACKENDS)
def test_restarted_group_hits_what_was_durable_and_a_lost_shard_misses_everywhere(
    request: pytest.FixtureRequest, backend: str, namespace: str
) -> None:
    args = {"url": store_url(request, backend), "namespace": namespace}
    wrote = run_group(2, "store_restart", {**args, "phase": "write"}, timeout_s=TIMEOUT_S)
    assert [w["durable"] for w in wrote] == [7, 7]
    read = run_group(2, "store_restart", {**args, "phase": "read", "lose_on_rank": 1}, timeout_s=TIMEOUT_S)
    assert read[1]["removed"] == [True]
    # Path 1 lost page 1 on rank 1 only: both ranks read page 0 alone. Paths 2 and 3 come back
    # whole (bytes checked on every rank); the path that never reached storage is a miss.
    assert read[0]["ready"] == read[1]["ready"] == [1, 2, 2, 0]
    assert read[0]["digest"] == read[1]["digest"]
    assert read[0]["closed"] is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_group_hits_what_the_first_wrote(
    request: pytest.FixtureRequest, backend: str, namespace: str, tmp_path: Path
) -> None:
    args = {"url": store_url(request, backend), "namespace": namespace, "sync_dir": str(tmp_path)}
    writer = _Group("store_share", {**args, "role": "writer"})
    reader = _Group("store_share", {**args, "role": "reader"})
    writer.start()
    reader.start()
    read, wrote = reader.outcome(), writer.outcome()
    assert [w["durable"] for w in wrote] == [5, 5]
    assert [r["ready"] for r in read] == [[3, 2], [3, 2]]
    assert read[0]["digest"] == read[1]["digest"]


def _outage_controls(request: pytest.FixtureRequest, target: str) -> tuple[str, Callable[[], None], Callable[[], None]]:
    if target == "redis":
        server = request.getfixturevalue("redis_server")
        return server.url, server.stop, server.start
    store = request.getfixturevalue("mooncake_store")
    if target == "mooncake-holder":
        return store_url(request, "mooncake"), store.kill_holder, store.start_holder
    return store_url(request, "mooncake"), store.stop_master, store.start_master


@pytest.mark.parametrize("target", ["mooncake-holder", "mooncake-master", "redis"])
def test_a_store_that_goes_away_mid_run_fails_cleanly_and_comes_back(
    request: pytest.FixtureRequest, target: str, namespace: str, tmp_path: Path
) -> None:
    url, stop, start = _outage_controls(request, target)
    group = _Group("store_outage", {"url": url, "namespace": namespace, "sync_dir": str(tmp_path)})
    group.start()
    group.wait_for(tmp_path / "in-flight")
    stop()
    (tmp_path / "stopped").touch()
    try:
        group.wait_for(tmp_path / "ready-to-restart")
    finally:
        start()
    (tmp_path / "restarted").touch()
    ranks = group.outcome()
    for r in ranks:
        assert r["durable_before"] == 2
        # While the store was away: the read in flight failed (a miss, no wrong bytes: every hit's
        # bytes are checked), rounds went on while it was in flight, writes failed, and the cache
        # kept serving the device and host copies of what it computed meanwhile.
        assert r["ready_while_down"] == 0
        assert r["rounds_with_op_in_flight"] > 0
        assert r["written_while_down"] == 0
        assert (r["device_hit_while_down"], r["host_hit_while_down"]) == (2, 0)
        assert r["closed_while_down"] is None and r["closed"] is None
        # After the restart: new pages become durable and hit again; what the store lost misses.
        assert (r["written_after"], r["ready_after"], r["ready_lost"]) == (2, 2, 0)
    down = [r["stats_while_down"] for r in ranks]
    if target.startswith("mooncake"):
        assert all(s["puts_direct"] > 0 for s in down)  # the host pool's pages went without a copy
    if target == "mooncake-holder":
        assert all(s["misses_io_error"] > 0 for s in down)  # "exists" still said yes; the reads failed
        assert all(s["client_renewals"] > 0 for s in down)  # and a read into host pages renewed the client
    else:
        assert all(s["unavailable"] > 0 for s in down)
    assert ranks[0]["digest"] == ranks[1]["digest"]
