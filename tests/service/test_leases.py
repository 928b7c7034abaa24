"""Leases belong to the connection that took them, are bounded, and cannot leak: a lease of a
client that left, or that sat unused past the TTL, is released by rank 0's sequenced decision.
Written as a client sees it: separate connections (raw DEALER sockets where a client misbehaves)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

import protocol as p
from tests.service.checks import cache_round_trip, fresh_tokens
from tests.service.harness import Service, running_service, wait_for
from tpcache.client import Client

# One worker runs the whole module, so its shared service starts once (under --dist loadgroup the
# module's tests would otherwise be spread over both workers, each starting its own).
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("service_leases")]

POOL = 64
ARGS = ("--page-size", "4", "--device-pages", str(POOL), "--heartbeat", "0.2")


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    args = (*ARGS, "--max-leases-per-client", "4", "--max-leases", "6", "--lease-ttl", "600")
    with running_service(tmp_path_factory.mktemp("leases"), *args) as svc:
        yield svc


def raw_client(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)  # a close still delivers what was sent
    sock.connect(endpoint)
    return sock


def call(sock: zmq.Socket, body: p.Body, rid: int = 1) -> p.Response:
    sock.send(p.encode_request(p.Request(rid, body)))
    assert sock.poll(30_000), "no reply"
    return p.decode_response(sock.recv())


def code(response: p.Response) -> p.ErrorCode | None:
    return None if response.error is None else p.ErrorCode(response.error.code)


def test_another_connections_lease_is_not_found_and_untouched(limited: Service) -> None:
    with limited.client() as a, limited.client() as b, limited.client() as c:
        tokens = fresh_tokens(8)
        lk = a.lock(tokens)
        held = list(a.alloc(lk.lease, 2).device_page_ids)
        for body in (
            p.ReleaseRequest(lease=lk.lease),
            p.AbortRequest(lease=lk.lease),
            p.AllocRequest(lease=lk.lease, num_pages=1),
            p.LoadRequest(lease=lk.lease),
            p.InsertRequest(tokens=tokens, device_page_ids=held, lease=lk.lease),
        ):
            with pytest.raises(p.NotFound, match=f"no lease {lk.lease}"):
                b.call(body)
        # The same answer as for a lease that never existed: another client's ids tell nothing.
        with pytest.raises(p.NotFound, match="no lease 987654"):
            b.release(987654)
        # Nothing changed: C's pages never include the pages A is writing, and A's lease works.
        other = c.lock(fresh_tokens(4))
        assert not set(c.alloc(other.lease, 8).device_page_ids) & set(held)
        c.release(other.lease)
        assert a.insert(tokens, held, lease=lk.lease).inserted_pages == 2
        a.release(lk.lease)
        assert b.match(tokens).hit_tokens == 8
    cache_round_trip(limited)


def test_lease_limits_per_connection_and_in_total(limited: Service) -> None:
    with limited.client() as a, limited.client() as b:
        mine = [a.lock(fresh_tokens(4)).lease for _ in range(4)]
        with pytest.raises(p.Overloaded, match="this connection holds 4 leases"):
            a.lock(fresh_tokens(4))
        theirs = [b.lock(fresh_tokens(4)).lease for _ in range(2)]
        with pytest.raises(p.Overloaded, match="the service holds 6 leases"):
            b.lock(fresh_tokens(4))
        a.release(mine.pop())
        theirs.append(b.lock(fresh_tokens(4)).lease)  # room again
        for lease in mine:
            a.release(lease)
        for lease in theirs:
            b.release(lease)
    cache_round_trip(limited)


def test_leases_of_clients_that_vanish_are_released(tmp_path: Path) -> None:
    """Eight clients pin or allocate and vanish (four of them before their lock's reply): a new
    client then gets the whole pool."""
    with running_service(tmp_path, *ARGS, "--lease-ttl", "600") as service, service.client() as c:
        tokens = fresh_tokens(16 * 4)
        lk = c.lock(tokens)
        c.insert(tokens, c.alloc(lk.lease, 16).device_page_ids, lease=lk.lease)
        c.release(lk.lease)
        lookups = c.stats().values["lookups"]
        for i in range(8):
            sock = raw_client(service.endpoint)
            if i % 2:
                r = call(sock, p.LockRequest(tokens=fresh_tokens(4)))
                assert r.ok and code(call(sock, p.AllocRequest(lease=r.result.lease, num_pages=6), 2)) is None
            else:  # pins the cached prefix; gone before the reply
                sock.send(p.encode_request(p.Request(1, p.LockRequest(tokens=tokens))))
            sock.close()
        # Every lock reached the service (each counts a lookup), the last four with nobody left to answer.
        assert wait_for(lambda: c.stats().values["lookups"] >= lookups + 8, timeout_s=30)

        def whole_pool() -> bool:
            lease = c.lock(fresh_tokens(4)).lease
            try:
                return len(c.alloc(lease, POOL).device_page_ids) == POOL
            except p.NoSpace:
                return False
            finally:
                c.release(lease)

        assert wait_for(whole_pool, timeout_s=60, interval_s=0.2), c.stats().values
        stats = c.stats().values
        assert stats["leases"] == 0 and stats["expired_leases"] == 8, stats
        assert stats["digests_equal"] is True


def test_idle_leases_expire_after_the_ttl(tmp_path: Path) -> None:
    with running_service(tmp_path, *ARGS, "--lease-ttl", "1") as service:
        idle = service.client()
        lk = idle.lock(fresh_tokens(4))
        idle.alloc(lk.lease, POOL)
        with service.client() as c:

            def allocated() -> bool:
                lease = c.lock(fresh_tokens(4)).lease
                try:
                    return len(c.alloc(lease, POOL).device_page_ids) == POOL
                except p.NoSpace:
                    return False
                finally:
                    c.release(lease)

            assert wait_for(allocated, timeout_s=60, interval_s=0.3)
        # The idle client's lease is gone; it is told so, and nothing else changes.
        with pytest.raises(p.NotFound):
            idle.release(lk.lease)
        idle.close()


def test_a_client_that_reconnects_cannot_use_its_old_lease(limited: Service) -> None:
    first = Client(limited.endpoint, timeout_s=30)
    lease = first.lock(fresh_tokens(4)).lease
    first.close()
    with limited.client() as again, pytest.raises(p.NotFound):
        again.release(lease)
