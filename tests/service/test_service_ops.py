"""Every op through a real 2-rank service: typed results, typed errors, batching, stats."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import protocol as p
from tests.service.checks import cache_round_trip, fresh_tokens
from tests.service.harness import Service
from tpcache.client import AsyncClient
from tpcache.testing.procs import stop

# One worker runs the whole module, so its shared service starts once (under --dist loadgroup the
# module's tests would otherwise be spread over both workers, each starting its own).
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("service_ops")]


def test_hello_describes_the_group(service: Service) -> None:
    with service.client(name="test") as c:
        assert c.info.world_size == 2
        assert c.info.page_size == 4
        assert c.info.layout == "metadata"
        assert c.info.protocol_version == p.PROTOCOL_VERSION
        h = c.health()
        assert (h.state, h.reason) == ("open", "")


def test_insert_then_hit_on_every_rank(service: Service) -> None:
    cache_round_trip(service)


def test_a_locked_prefix_is_reported_with_its_pages(service: Service) -> None:
    with service.client() as c:
        tokens = fresh_tokens(8)
        lk = c.lock(tokens)
        pages = list(c.alloc(lk.lease, 2).device_page_ids)
        c.insert(tokens, pages, lease=lk.lease)
        c.release(lk.lease)
        lk2 = c.lock(tokens + [7, 7, 7, 7])
        assert (lk2.hit_tokens, list(lk2.device_page_ids)) == (8, pages)
        assert lk2.lease != lk.lease
        c.abort(lk2.lease)
        with pytest.raises(p.NotFound):
            c.release(lk2.lease)  # the lease is gone after abort


def test_a_running_request_appends_its_new_pages_alone(service: Service) -> None:
    with service.client() as c:
        tokens = fresh_tokens(8)
        lk = c.lock(tokens)
        with pytest.raises(p.InvalidArgument, match="insert the whole sequence"):
            c.append(tokens[:4], c.alloc(lk.lease, 1).device_page_ids, lease=lk.lease)  # nothing inserted yet
        pages = list(c.alloc(lk.lease, 2).device_page_ids)
        c.insert(tokens, pages, lease=lk.lease)
        more = fresh_tokens(4)
        extra = list(c.alloc(lk.lease, 1).device_page_ids)
        assert c.append(more, extra, lease=lk.lease).inserted_pages == 1
        c.release(lk.lease)
        lk2 = c.lock(tokens + more)
        assert (lk2.hit_tokens, list(lk2.device_page_ids)) == (12, pages + extra)
        c.release(lk2.lease)


def test_engine_errors_become_typed_protocol_errors(service: Service) -> None:
    with service.client() as c:
        with pytest.raises(p.NotFound):
            c.release(987654321)
        lk = c.lock(fresh_tokens(4))
        with pytest.raises(p.NoSpace):
            c.alloc(lk.lease, 10_000)  # more than the device tier holds
        with pytest.raises(p.InvalidArgument):
            c.insert(fresh_tokens(4), [0], lease=lk.lease)  # page 0 is not this lease's
        with pytest.raises(p.InvalidArgument, match="namespace"):
            c.match([1, 2, 3, 4], namespace="other-model")
        with pytest.raises(p.InvalidArgument, match="lease"):
            c.call(p.InsertRequest(tokens=[1, 2, 3, 4], device_page_ids=[1]))
        with pytest.raises(p.InvalidArgument, match="metadata only"):
            c.get_pages([0])
        c.release(lk.lease)
    cache_round_trip(service)


def test_set_config_and_step(service: Service) -> None:
    with service.client() as c:
        r1 = c.step().round
        r2 = c.step().round
        assert r2 > r1
        settings = c.set_config(retention_cap_tokens=8).settings
        assert settings["retention_cap_tokens"] == 8
        c.step()
        assert c.stats().values["evictable_device_tokens"] <= 8
        assert c.set_config(retention_cap_tokens=-1).settings["retention_cap_tokens"] == -1
        assert c.set_config(mirror_release=False).settings["mirror_release"] is False
        assert c.set_config(mirror_release=True).settings["mirror_release"] is True
        with pytest.raises(p.InvalidArgument, match="no storage tier"):
            c.set_config(storage_prefetch=True)  # this service has none
        assert c.stats().values["digests_equal"] is True
    cache_round_trip(service)


def test_pipelined_requests_share_rounds(service: Service) -> None:
    """Requests waiting together are applied in one round: throughput grows with load."""
    n = 400
    with service.client() as c:
        tokens = fresh_tokens(4096)
        before = c.stats().values["rounds"]
        # Rank 0 is paused while the burst arrives (a busy leader, made deterministic): when it
        # resumes, every request is waiting and they share rounds.
        try:
            stop(service.pids[0])
            ids = c.submit_many(p.MatchRequest(tokens=tokens) for _ in range(n))
            time.sleep(0.2)
        finally:
            os.kill(service.pids[0], signal.SIGCONT)
        results = [c.wait(i) for i in ids]
        after = c.stats().values["rounds"]
    assert all(r.hit_tokens == 0 for r in results)
    # Without batching every request costs a round (>= n). How many share one depends on how fast
    # ZMQ hands the burst over on a loaded machine, so the bound leaves room for that.
    assert after - before < n * 3 // 4, f"{n} pipelined requests took {after - before} rounds"


def test_async_client(service: Service) -> None:
    async def run() -> list[int]:
        client = await AsyncClient.connect(service.endpoint, timeout_s=30.0)
        try:
            results = await asyncio.gather(*(client.match(fresh_tokens(8)) for _ in range(20)))
            health = await client.health()
        finally:
            client.close()
        assert health.state == "open"
        return [r.hit_tokens for r in results]

    assert asyncio.run(run()) == [0] * 20


def test_flush_empties_every_rank_and_keeps_serving(service: Service) -> None:
    with service.client() as c:
        tokens = fresh_tokens(8)
        lk = c.lock(tokens)
        c.insert(tokens, c.alloc(lk.lease, 2).device_page_ids, lease=lk.lease)
        c.release(lk.lease)
        assert c.match(tokens).hit_tokens == 8
        c.flush()
        assert c.match(tokens).hit_tokens == 0
        assert c.health().state == "open"
    cache_round_trip(service)
