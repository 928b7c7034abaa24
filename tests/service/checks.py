"""Shared assertions: a service is healthy when it answers correctly on every rank."""

from __future__ import annotations

import itertools

from tests.service.harness import Service

_fresh = itertools.count(1)


def fresh_tokens(n: int) -> list[int]:
    """Tokens no other check used (so cached state from earlier tests cannot satisfy a check)."""
    base = 1_000_000 * next(_fresh)
    return list(range(base, base + n))


def cache_round_trip(service: Service, pages: int = 3) -> None:
    """lock (miss) -> alloc -> insert -> release -> match (hit, on the same pages), and equal digests."""
    with service.client() as c:
        assert c.health().state == "open"
        ps = c.info.page_size
        tokens = fresh_tokens(pages * ps + 1)  # one partial page, never cached
        lk = c.lock(tokens)
        assert lk.hit_tokens == 0
        fresh = list(c.alloc(lk.lease, pages).device_page_ids)
        assert len(fresh) == pages == len(set(fresh))
        ins = c.insert(tokens, fresh, lease=lk.lease)
        assert (ins.inserted_pages, ins.duplicate_pages) == (pages, 0)
        c.release(lk.lease)
        m = c.match(tokens)
        assert m.hit_tokens == pages * ps and m.device_pages == pages
        assert list(m.device_page_ids) == fresh
        stats = c.stats().values
        assert stats["digests_equal"] is True, stats
        assert stats["rank0.closed"] == 0 and stats["rank1.closed"] == 0
