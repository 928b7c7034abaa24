"""The embedded API's event stream: rank 0 of a ``TPCache`` group publishes each round's changes
(``publish_events``); a closed cache reads as all cleared and a flush reopens it from what it holds."""

from __future__ import annotations

import threading
import time

from tpcache.comm import SimGroup
from tpcache.core import CacheConfig
from tpcache.core.treecore.feed import on_tiers
from tpcache.engine import TPCache
from tpcache.events import Group, Subscriber

P = 4


def sync(sub: Subscriber, g: Group, tp: TPCache) -> None:
    deadline = time.monotonic() + 20
    while g.seq < tp.events.publisher.seq:
        assert time.monotonic() < deadline
        sub.poll(0.05)


def test_rank_0_of_an_embedded_group_publishes_what_each_round_changed():
    group = SimGroup(2)
    ranks = [TPCache(CacheConfig(page_size=P, device_pages=6, host_pages=8), group.collective(r)) for r in range(2)]
    info = ranks[0].publish_events(model="tiny")
    assert ranks[1].publish_events() is None
    assert info is not None and (info["tp_size"], info["page_size"], info["model"]) == (2, P, "tiny")
    sub = Subscriber()
    g = sub.follow(info["endpoint"], info["replay_endpoint"])

    def everyone(fn):
        return [fn(tp) for tp in ranks]

    def round_():
        threads = [threading.Thread(target=tp.step) for tp in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    try:
        for i in range(12):
            toks = [i % 4 * 100 + d * 10 + k for d in range(3) for k in range(P)]
            leases = everyone(lambda tp, toks=toks: tp.lock(toks))
            for tp, (lease, m) in zip(ranks, leases, strict=True):
                if m.device_pages == 3:
                    tp.release(lease)
                    continue
                tp.insert(lease, toks, list(m.device_page_ids) + tp.alloc(lease, 3 - m.device_pages))
                tp.release(lease)
            round_()
            round_()
            sync(sub, g, ranks[0])
            assert g.tiers == on_tiers(ranks[0].core.tree.nodes.values())
        assert g.tiers[0] and g.tiers[1]
        for tp in ranks:
            tp.core.close("a test closes it")
        round_()
        sync(sub, g, ranks[0])
        assert g.tiers == (set(), set(), set())  # a closed cache serves no hit
        everyone(lambda tp: tp.request_flush())
        round_()
        round_()
        sync(sub, g, ranks[0])
        assert not ranks[0].core.closed and g.tiers == on_tiers(ranks[0].core.tree.nodes.values())
        assert g.counters["digest_mismatches"] == 0
    finally:
        sub.close()
        for tp in ranks:
            tp.close()
