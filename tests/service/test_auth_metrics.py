"""The front door's shared secret, the loopback-only default, and per-rank Prometheus metrics."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import zmq

import protocol as p
from tests.service.checks import cache_round_trip
from tests.service.harness import REPO, repo_env, running_service, wait_for
from tpcache.client import Client

pytestmark = pytest.mark.multiprocess

SECRET = "correct horse battery staple"


def free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no two adjacent free ports")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_secret_and_metrics(tmp_path: Path) -> None:
    port = free_port_pair()
    args = ("--page-size", "4", "--device-pages", "64", "--metrics-port", str(port), "--heartbeat", "0.1")
    with running_service(tmp_path, *args, env={"TPCACHE_SECRET": SECRET}) as service:
        # No hello, or the wrong secret: every op is refused.
        with pytest.raises(p.Unauthorized):
            Client(service.endpoint, timeout_s=10)
        with pytest.raises(p.Unauthorized):
            Client(service.endpoint, token="guess", timeout_s=10)
        c = Client(service.endpoint, token="guess", timeout_s=10, hello=False)
        for body in (p.HealthRequest(), p.MatchRequest(tokens=[1, 2, 3, 4]), p.StatsRequest(), p.FlushRequest()):
            with pytest.raises(p.Unauthorized):
                c.call(body)
        c.close()
        # Authentication belongs to the connection: a later connection that picks the routing id
        # of one that authenticated and left must send hello again, whatever id it picks.
        for routing_id in (b"alice", b"\x00\x80\x00\x00\x29"):
            first = raw_dealer(service.endpoint, routing_id)
            assert request(first, p.HelloRequest(token=SECRET)).ok
            assert request(first, p.HealthRequest()).ok
            first.close()
            second = wait_for(lambda rid=routing_id: reconnect_unauthorized(service.endpoint, rid), timeout_s=30)
            assert second, "a new connection with a used routing id was served without hello"
        with Client(service.endpoint, token=SECRET, timeout_s=10) as good:
            assert good.health().state == "open"
        cache_round_trip_with_secret(service)
        # Metrics: one endpoint per rank, Prometheus names, both tiers and the round histogram.
        for rank in range(2):
            text = scrape(port + rank)
            for name in (
                "tpcache_rounds_total",
                'tpcache_hit_tokens_total{tier="device"}',
                'tpcache_hit_tokens_total{tier="host"}',
                "tpcache_round_duration_seconds_bucket",
                "tpcache_evicted_pages_total",
                'tpcache_transfer_issued_pages_total{kind="backup"}',
                'tpcache_rejected_pages_total{reason="host_full"}',
                "tpcache_closed 0.0",
                "tpcache_transport_info",
            ):
                assert name in text, (rank, name)
        assert 'tpcache_requests_total{op="match",outcome="ok"}' in scrape(port)


def raw_dealer(endpoint: str, routing_id: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(endpoint)
    return sock


def request(sock: zmq.Socket, body: p.Body, timeout_s: float = 10.0) -> p.Response:
    sock.send(p.encode_request(p.Request(1, body)))
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    return p.decode_response(sock.recv())


def reconnect_unauthorized(endpoint: str, routing_id: bytes) -> bool:
    """A fresh connection with ``routing_id`` asks for health without hello: refused? (A reply
    that never comes means the server still had the first connection under that id.)"""
    sock = raw_dealer(endpoint, routing_id)
    try:
        sock.send(p.encode_request(p.Request(2, p.HealthRequest())))
        if not sock.poll(2000):
            return False
        error = p.decode_response(sock.recv()).error
        assert error is not None and error.code == p.ErrorCode.UNAUTHORIZED, error
        return True
    finally:
        sock.close()


def cache_round_trip_with_secret(service: object) -> None:
    class Authed:
        endpoint = service.endpoint  # type: ignore[attr-defined]
        pids = service.pids  # type: ignore[attr-defined]

        def client(self, **kw: object) -> Client:
            return Client(self.endpoint, token=SECRET, timeout_s=30)

    cache_round_trip(Authed())  # type: ignore[arg-type]


def test_a_non_loopback_endpoint_needs_a_flag_and_a_secret() -> None:
    base = [sys.executable, "-m", "launcher", "local", "--nproc", "1"]
    run = subprocess.run(
        [*base, "--endpoint", "tcp://0.0.0.0:0"], cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "--allow-remote" in run.stderr
    run = subprocess.run(
        [*base, "--endpoint", "tcp://0.0.0.0:0", "--allow-remote"],
        cwd=REPO,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "secret" in run.stderr
