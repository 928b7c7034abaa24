"""Memory per client is bounded: rank 0's resident memory, measured, under clients that send
large envelopes or never read their replies."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

import protocol as p
from tests.service.checks import cache_round_trip, fresh_tokens
from tests.service.harness import pid_alive, running_service, wait_for

pytestmark = pytest.mark.multiprocess

MiB = 1 << 20
LAYOUT = "L2xH2xD64:fp32"  # 8 KiB per page and rank at page size 4


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def non_reader(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)  # keeps as little as it can of what the server sends
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return sock


def test_large_envelopes_are_refused_not_echoed(tmp_path: Path) -> None:
    args = ("--page-size", "4", "--device-pages", "64", "--heartbeat", "0.2")
    with running_service(tmp_path, *args) as service, service.client() as c:
        cache_round_trip(service)  # warm: sockets, buffers, the first rounds
        leader = service.pids[0]
        before = rss(leader)
        sock = non_reader(service.endpoint)
        request = p.encode_request(p.Request(1, p.HealthRequest()))
        for _ in range(20):
            sock.send_multipart([bytes(16 * MiB), request])
        assert wait_for(lambda: c.stats().values["refused_envelopes"] >= 20, timeout_s=60)
        grown = rss(leader) - before
        assert grown < 64 * MiB, f"rank 0 grew by {grown / MiB:.0f} MiB"
        sock.close()
        assert pid_alive(leader)
        cache_round_trip(service)


def test_replies_to_a_client_that_never_reads_are_bounded(tmp_path: Path) -> None:
    args = ("--page-size", "4", "--device-pages", "64", "--kv-layout", LAYOUT, "--heartbeat", "0.2")
    with running_service(tmp_path, *args) as service, service.client() as c:
        tokens = fresh_tokens(16 * 4)
        lk = c.lock(tokens)
        pages = list(c.alloc(lk.lease, 16).device_page_ids)
        c.insert(tokens, pages, lease=lk.lease)
        c.release(lk.lease)
        reply_bytes = len(c.get_pages(pages).data)  # 16 pages of both ranks: 256 KiB a reply
        assert reply_bytes == 256 * 1024
        cache_round_trip(service)
        leader = service.pids[0]
        before = rss(leader)
        sock = non_reader(service.endpoint)
        n = 2000  # 500 MiB of replies if rank 0 kept them all
        frames = [p.encode_request(p.Request(i, p.GetPagesRequest(page_ids=pages))) for i in range(1, n + 1)]
        received = c.stats().values["requests_received"]
        for frame in frames:
            sock.send(frame)
        # Every request was read (and answered, refused or its reply dropped) by rank 0.
        stats = wait_for(lambda: (v := c.stats().values)["requests_received"] >= received + n and v, timeout_s=120)
        assert stats, c.stats().values
        grown = rss(leader) - before
        assert grown < 64 * MiB, f"rank 0 grew by {grown / MiB:.0f} MiB ({stats['dropped_replies']} dropped)"
        sock.close()
        cache_round_trip(service)
