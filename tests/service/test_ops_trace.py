"""Sequenced ops are data all the way through the service: with ``TPCACHE_TRACE_OPS`` each rank
writes down the ops its driver applied, and every rank of the group applied the same ones."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from tests.service.checks import cache_round_trip
from tests.service.harness import running_service
from tpcache.engine.sequenced import APPLY, read_ops

pytestmark = pytest.mark.multiprocess


def test_every_rank_of_the_service_writes_down_the_same_sequence_of_ops(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    args = ("--page-size", "4", "--device-pages", "32", "--heartbeat", "0.2")
    with running_service(tmp_path / "svc", *args, env={"TPCACHE_TRACE_OPS": str(trace)}) as svc:
        cache_round_trip(svc)  # lock, alloc, insert, release, match
        with svc.client() as c:
            c.set_config(retention_cap_tokens=8, mirror_release=False)
            lease = c.lock(list(range(9))).lease
            c.abort(lease)
            c.flush()
        assert svc.stop() == 0
    ops = {path.name: read_ops(path) for path in sorted(trace.iterdir())}
    assert list(ops) == ["rank0.ops", "rank1.ops"]
    first = ops["rank0.ops"]
    assert ops["rank1.ops"] == first
    kinds = [kind for kind, _ in first]
    assert kinds == [
        "lock",
        "alloc",
        "insert",
        "release",
        "set_retention_cap",
        "set_feature",
        "lock",
        "release",
        "request_flush",
    ]
    assert set(kinds) <= set(APPLY)
    assert first[4] == ["set_retention_cap", [8]] and first[5] == ["set_feature", ["mirror_release", False]]
    assert first[6][1][0] == list(range(9))  # the lock's token ids, as plain ints
    assert msgpack.unpackb(msgpack.packb(first), strict_map_key=False) == first
