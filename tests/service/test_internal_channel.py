"""The rank-to-rank channel against a foreign local process: what it sends to any port a rank
listens on is dropped (and counted) and changes nothing; every rank listens on loopback only."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator

import msgpack
import pytest
import zmq

import protocol as p
from tests.service.checks import cache_round_trip, fresh_tokens
from tests.service.harness import Service, listening_sockets, pid_alive, running_service, wait_for
from tpcache.service.config import ConfigError, build_config

# One worker runs the whole module, so its shared service starts once (under --dist loadgroup the
# module's tests would otherwise be spread over both workers, each starting its own).
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("service_internal_channel")]

ARGS = ("--page-size", "4", "--device-pages", "64", "--heartbeat", "0.2")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One group for the module; after every test's foreign traffic, it still stops cleanly (exit 0)."""
    with running_service(tmp_path_factory.mktemp("channel"), *ARGS) as svc:
        yield svc
        code = svc.stop()
    assert code == 0, svc.log()


def hostile_frames() -> list[bytes]:
    pack = msgpack.packb
    request = p.encode_request(p.Request(1, p.FlushRequest()))
    return [
        pack({}),
        pack([]),
        pack({"stop": 1}),  # what a follower sends the leader to stop the group
        pack({"b": 0, "s": 1, "n": 0, "e": [], "x": True}),  # a stop batch, as the leader sends it
        pack({"b": 10**9, "s": 1, "n": 1, "e": [[0, 1, 0, request]], "x": False}),  # a forged flush
        bytes(16) + pack({"stop": 1}),  # a made-up tag
        os.urandom(64),
        b"",
    ]


def test_foreign_frames_change_nothing(service: Service) -> None:
    with service.client() as c:
        tokens = fresh_tokens(8)
        lk = c.lock(tokens)
        c.insert(tokens, c.alloc(lk.lease, 2).device_page_ids, lease=lk.lease)
        c.release(lk.lease)
        before = c.stats().values
        client_port = int(service.endpoint.rsplit(":", 1)[1])
        targets = [(a, port) for pid in service.pids for a, port in listening_sockets(pid) if port != client_port]
        assert len(targets) >= 2, targets  # at least each rank's internal socket
        ctx = zmq.Context()
        try:
            for addr, port in targets:
                push = ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 2000)
                push.connect(f"tcp://{addr}:{port}")
                for frame in hostile_frames():
                    push.send(frame)
                push.close()  # lingers until the frames left
                for frame in hostile_frames():  # and the same bytes without any ZMQ framing
                    with socket.create_connection((addr, port), timeout=5) as raw:
                        raw.sendall(frame or b"\xff")
        finally:
            ctx.term()
        # Internal frames are dropped and counted on the rank that got them.
        frames = len(hostile_frames())
        counted = wait_for(
            lambda: (
                (v := c.stats().values)["rank0.internal_rejected_frames"] >= frames
                and v["rank1.internal_rejected_frames"] >= frames
                and v
            ),
            timeout_s=30,
        )
        assert counted, c.stats().values
        assert all(pid_alive(pid) for pid in service.pids), service.log()
        health = c.health()
        assert (health.state, health.reason) == ("open", "")
        # Nothing was applied: no flush, no stop, the same cached prefix, the same state everywhere.
        assert c.match(tokens).hit_tokens == 8
        after = c.stats().values
        assert after["digests_equal"] is True and after["rank0.digest"] == before["rank0.digest"]
        cache_round_trip(service)


def test_every_rank_listens_on_loopback_only(service: Service) -> None:
    for pid in service.pids:
        sockets = listening_sockets(pid)
        assert sockets, pid
        for addr, port in sockets:
            assert ipaddress.ip_address(addr).is_loopback, (pid, addr, port)


def test_a_non_loopback_internal_host_needs_allow_remote() -> None:
    with pytest.raises(ConfigError, match="--allow-remote"):
        build_config(env={}, cli={"internal_host": "0.0.0.0"})
    assert build_config(env={}, cli={"internal_host": "0.0.0.0", "allow_remote": True}).internal_host == "0.0.0.0"
