"""Memory per client is bounded: rank 0's resident memory, measured, under clients that send
large envelopes or never read their replies."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zmq

import protocol as p
from tests.service.checks import cache_round_trip, fresh_tokens
from tests.service.harness import pid_alive, running_service, wait_for
from tpcache.client import Client

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


def _stored_pages(c: Any, n: int = 16) -> list[int]:
    """``n`` pages inserted and released: what get_pages can read (256 KiB a reply for 16)."""
    tokens = fresh_tokens(n * 4)
    lk = c.lock(tokens)
    pages = list(c.alloc(lk.lease, n).device_page_ids)
    c.insert(tokens, pages, lease=lk.lease)
    c.release(lk.lease)
    return pages


def _episode(
    c: Any, endpoint: str, pages: list[int], connections: int, requests: int, paced: bool = False
) -> dict[str, Any]:
    """``connections`` clients each send ``requests`` get_pages and read nothing (``paced``: each
    once the one before was answered); returns rank 0's counters once every request was read."""
    received = c.stats().values["requests_received"]
    socks = [non_reader(endpoint) for _ in range(connections)]
    frames = [p.encode_request(p.Request(i, p.GetPagesRequest(page_ids=pages))) for i in range(1, requests + 1)]
    for n, sock in enumerate(socks, 1):
        for frame in frames:
            sock.send(frame)
        if paced:
            sent = received + n * (requests + 1)  # (and a stats request each)
            assert wait_for(lambda sent=sent: c.stats().values["requests_received"] >= sent, timeout_s=60)
    want = received + connections * requests
    stats = wait_for(lambda: (v := c.stats().values)["requests_received"] >= want and v, timeout_s=120)
    assert stats, c.stats().values
    # A new client is answered at once while they hold their replies.
    with Client(endpoint, timeout_s=5.0) as fresh:
        assert fresh.hello() is not None
    for sock in socks:
        sock.close()
    return stats


def test_unread_replies_of_all_connections_together_are_bounded(tmp_path: Path) -> None:
    """Past max_unread_reply_bytes a large reply is refused OVERLOADED and the connection holding
    the most unread bytes is closed; a client that reads is served again afterwards."""
    args = ("--page-size", "4", "--device-pages", "64", "--kv-layout", LAYOUT, "--heartbeat", "0.2")
    args += ("--max-unread-reply-bytes", "2MiB")
    with running_service(tmp_path, *args) as service, service.client() as c:
        pages = _stored_pages(c)
        stats = _episode(c, service.endpoint, pages, connections=8, requests=16, paced=True)  # 32 MiB unread if kept
        assert stats["refused_replies"] > 0, stats
        assert stats["dropped_connections"] > 0, stats
        assert stats["unread_reply_bytes"] <= 2 * MiB + 64 * 1024, stats  # (small replies pass, briefly)
        # Once they are gone, nothing is held for them and a reader gets its pages.
        assert wait_for(lambda: c.stats().values["unread_reply_bytes"] < 64 * 1024, timeout_s=30), c.stats().values
        assert len(c.get_pages(pages).data) == 256 * 1024
        assert "dropped client connection" in service.log()


def test_rank_memory_stays_bounded_and_episodes_do_not_ratchet(tmp_path: Path) -> None:
    """64 connections leave 6 MiB of replies unread each (384 MiB if kept), five times: each rank's
    resident memory stays within the bound plus a margin, and later episodes leave it grown no more
    than the first did (freed buffers go back to the OS)."""
    bound = 32 * MiB
    args = ("--page-size", "4", "--device-pages", "64", "--kv-layout", LAYOUT, "--heartbeat", "0.2")
    args += ("--max-unread-reply-bytes", str(bound))
    with running_service(tmp_path, *args) as service, service.client() as c:
        pages = _stored_pages(c)
        cache_round_trip(service)
        before = [rss(pid) for pid in service.pids]
        growth = []
        for _ in range(5):
            _episode(c, service.endpoint, pages, connections=64, requests=24)
            assert wait_for(lambda: c.stats().values["unread_reply_bytes"] < 64 * 1024, timeout_s=30), c.stats().values
            time.sleep(1.5)  # the ranks hand freed memory back once the burst is over
            growth.append([rss(pid) - b for pid, b in zip(service.pids, before, strict=True)])
            assert max(growth[-1]) < bound + 64 * MiB, f"ranks grew by {[g / MiB for g in growth[-1]]} MiB"
        shown = [[f"{g / MiB:.1f}" for g in ranks] for ranks in growth]
        for rank in range(len(before)):
            assert growth[-1][rank] <= max(growth[0][rank], 0) + 16 * MiB, f"MiB per episode and rank: {shown}"
        assert all(pid_alive(pid) for pid in service.pids)
        cache_round_trip(service)


def test_connections_past_the_cap_are_refused_with_the_reason(tmp_path: Path) -> None:
    args = ("--page-size", "4", "--device-pages", "64", "--heartbeat", "0.2", "--max-connections", "3")
    with running_service(tmp_path, *args) as service:
        clients = [service.client(timeout_s=10.0) for _ in range(3)]
        try:
            with pytest.raises(p.Overloaded, match="already has 3 client connections, its limit: max_connections = 3"):
                service.client(timeout_s=10.0)  # (its hello is refused)
            clients.pop().close()
            assert wait_for(lambda: _hello_ok(service), timeout_s=20)
        finally:
            for client in clients:
                client.close()
        assert "refusing client connections" in service.log()


def _hello_ok(service: Any) -> bool:
    try:
        service.client(timeout_s=5.0).close()
    except p.Overloaded:
        return False
    return True
