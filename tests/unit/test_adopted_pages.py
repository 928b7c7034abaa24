"""Adopted device pages (``device_adopt``): the device tier holds pages an engine's own allocator
hands out (SGLang's KV pool). Inserts adopt the engine's pages, eviction and releases hand page ids
back in an order every rank computes alike, and the core allocates none."""

import pytest

from tpcache.core import CacheConfig, CacheCore, check

PAGE = 4
PAGES = 32


def core(**kw: object) -> CacheCore:
    return CacheCore(CacheConfig(**{"page_size": PAGE, "device_pages": PAGES, "device_adopt": True, **kw}))  # type: ignore[arg-type]


def toks(*pages: int) -> list[int]:
    return [p * 100 + i for p in pages for i in range(PAGE)]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"storage": True}, "storage reads and writes it through a host tier: set host_pages > 0"),
        ({"host_pages": 8, "write_policy": "write_back"}, "write_through or write_through_selective"),
        ({"device_pages": 0}, "device_adopt needs device_pages > 0"),
        ({"swa_window": 8, "swa_device_pages": 4}, "full-attention models only"),
    ],
)
def test_settings_it_cannot_serve_are_refused_in_one_line(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        core(**kw)
    assert "\n" not in str(err.value)


def test_adopt_caches_the_engines_pages_and_a_later_lock_hits_them() -> None:
    c = core()
    lease, miss = c.lock(toks(1, 2, 3))
    assert miss.device_pages == 0
    # Two full pages and a partial one: only the full pages are cached.
    assert c.engine_pages.adopt(lease, toks(1, 2, 3)[:-1], [5, 9, 2]) == []
    check(c)
    assert c.device.used == 2 and c.protected_device_tokens == 2 * PAGE
    c.release(lease)
    assert c.engine_pages.drain() == []  # the pages stay cached: nothing goes back to the engine
    assert c.evictable_device_tokens == 2 * PAGE
    other, hit = c.lock(toks(1, 2, 7))
    assert hit.device_pages == 2 and list(hit.device_page_ids) == [5, 9]
    # The request's row now points at the cached pages; the page it computed past them is new.
    assert c.engine_pages.adopt(other, toks(1, 2, 7), [5, 9, 11]) == []
    check(c)
    assert list(c.match(toks(1, 2, 7)).device_page_ids) == [5, 9, 11]


def test_pages_already_cached_under_other_pages_stay_the_engines() -> None:
    c = core()
    first, _ = c.lock(toks(1, 2))
    second, _ = c.lock(toks(1, 2, 4))  # both missed: both computed pages 1 and 2
    assert c.engine_pages.adopt(first, toks(1, 2), [3, 4]) == []
    assert c.engine_pages.adopt(second, toks(1, 2, 4), [6, 7, 8]) == [6, 7]
    check(c)
    assert list(c.match(toks(1, 2, 4)).device_page_ids) == [3, 4, 8]
    assert not c.device.is_owned(6) and not c.device.is_owned(7)
    c.release(first)
    c.release(second)
    assert c.engine_pages.drain() == []


def test_eviction_hands_page_ids_back_in_the_same_order_on_every_rank() -> None:
    ranks = [core(), core()]
    drained = []
    for c in ranks:
        for i, pages in enumerate(([1, 2, 3], [4, 5], [6])):
            tokens = toks(*(10 * i + k for k in range(len(pages))))
            lease, _ = c.lock(tokens)
            c.engine_pages.adopt(lease, tokens, pages)
            c.release(lease)
        assert c.evict_device(4) == 4
        drained.append(c.engine_pages.drain())
        check(c)
    assert drained[0] == drained[1]
    assert sorted(drained[0]) == sorted(set(drained[0])) and len(drained[0]) == 4
    c = ranks[0]
    assert c.device.used == 2 and not any(c.device.is_owned(p) for p in drained[0])
    assert c.engine_pages.drain() == []
    # A page handed back is the engine's again: it may come back with other KV.
    page = drained[0][0]
    lease, _ = c.lock(toks(50))
    assert c.engine_pages.adopt(lease, toks(50), [page]) == []
    check(c)


def test_a_locked_path_is_not_evicted() -> None:
    c = core()
    lease, _ = c.lock(toks(1, 2))
    c.engine_pages.adopt(lease, toks(1, 2), [1, 2])
    assert c.evict_device(2) == 0
    assert c.engine_pages.drain() == []
    c.release(lease)
    assert c.evict_device(2) == 2
    assert c.engine_pages.drain() == [2, 1]  # leaf first


def test_refused_adopts_change_nothing() -> None:
    c = core()
    lease, _ = c.lock(toks(1, 2))
    c.engine_pages.adopt(lease, toks(1, 2), [1, 2])
    other, _ = c.lock(toks(3, 4))
    before = c.state_digest()
    with pytest.raises(ValueError, match="page 2 is cached at another position"):
        c.engine_pages.adopt(other, toks(3, 4), [5, 2])
    with pytest.raises(ValueError, match="device_pages"):
        c.engine_pages.adopt(other, toks(3, 4), [5, PAGES])
    with pytest.raises(ValueError, match="twice"):
        c.engine_pages.adopt(other, toks(3, 4), [5, 5])
    with pytest.raises(ValueError, match="a device page for each of 2 full pages"):
        c.engine_pages.adopt(other, toks(3, 4), [5])
    assert c.state_digest() == before
    assert not c.device.is_owned(5)
    check(c)
    with pytest.raises(ValueError, match="the engine allocates device pages"):
        c.alloc(other, 1)


def test_adopt_needs_the_mode() -> None:
    c = CacheCore(CacheConfig(page_size=PAGE, device_pages=PAGES))
    lease, _ = c.lock(toks(1))
    with pytest.raises(ValueError, match="adopt needs device_adopt"):
        c.engine_pages.adopt(lease, toks(1), [1])
    assert c.engine_pages.drain() == []


def test_a_flush_hands_every_cached_page_back() -> None:
    c = core()
    lease, _ = c.lock(toks(1, 2, 3))
    c.engine_pages.adopt(lease, toks(1, 2, 3), [7, 3, 5])
    c.release(lease)
    c.evict_device(1)  # page 5 freed, not drained yet
    c.reset(c.outbox.next_op, c.book.next_lease)
    assert c.engine_pages.drain() == [3, 5, 7]
    assert c.device.used == 0 and c.match(toks(1)).device_pages == 0
    check(c)


class Engine:
    """An engine's page allocator (SGLang's KV pool): pages 1 .. n, the last freed reused first."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n, 0, -1))

    def alloc(self, k: int) -> list[int]:
        out = self.free[len(self.free) - k :][::-1]
        del self.free[len(self.free) - k :]
        return out

    def give_back(self, pages: list[int]) -> None:
        assert not set(pages) & set(self.free), "a page handed back twice"
        self.free.extend(pages)


def _settle(c: CacheCore) -> None:
    """A round where every copy in flight landed on every rank: each is agreed complete."""
    for _ in range(2):
        if c.has_ready():
            c.ready()
            c.advance()
        for kind, ops in c.inflight.items():
            while ops:
                c.complete(kind)


def _schedule(seed: int, stats: dict[str, int], ranks: int = 2, ops: int = 60, host: int = 0) -> None:
    """Random requests on ``ranks`` cores, each under its own engine allocator, every op applied
    to all: the same pages come back in the same order everywhere, and every page is either free
    in the engine or cached in the core, never both, never lost. With a ``host`` tier, pages are
    backed up as they are cached and a request may load its host hit into pages of its engine."""
    import random

    rng = random.Random(seed)
    pages = PAGES - 1
    policy = rng.choice(["lru", "lfu", "fifo"])
    cores = [core(eviction_policy=policy, host_pages=host) for _ in range(ranks)]
    engines = [Engine(pages) for _ in range(ranks)]
    running: list[int] = []  # leases of running requests (the same ids on every rank)

    def on_all(fn) -> list:  # type: ignore[no-untyped-def]
        out = [fn(c, e) for c, e in zip(cores, engines, strict=True)]
        assert all(o == out[0] for o in out), f"seed {seed}: ranks differ: {out}"
        return out

    for _ in range(ops):
        kind = rng.random()
        if kind < 0.6:
            tokens = toks(*(rng.randrange(3) * 10 + i for i in range(rng.randint(1, 5))))
            need_pages = len(tokens) // PAGE

            twins = 2 if rng.random() < 0.3 else 1  # requests for the same tokens, both locked first
            load = rng.random() < 0.7

            def request(
                c: CacheCore,
                e: Engine,
                tokens: list[int] = tokens,
                n: int = need_pages,
                twins: int = twins,
                load: bool = load,
            ) -> list:
                locked = [c.lock(tokens) for _ in range(twins)]
                out = []
                for lease, m in locked:
                    cached = m.device_page_ids
                    hit = c.match(tokens)  # a twin's load may have brought pages back meanwhile
                    if load and hit.host_pages and hit.device_page_ids == cached:
                        if hit.host_pages > len(e.free):
                            c.evict_device(hit.host_pages - len(e.free))
                            e.give_back(c.engine_pages.drain())
                        if hit.host_pages <= len(e.free):
                            loaded = e.alloc(hit.host_pages)
                            c.engine_pages.load_adopted(lease, loaded)
                            cached = cached + loaded
                            stats["loaded"] += len(loaded)
                    short = n - len(cached) - len(e.free)
                    if short > 0:
                        c.evict_device(short)
                        e.give_back(c.engine_pages.drain())
                    if n - len(cached) > len(e.free):
                        c.release(lease)
                        e.give_back(c.engine_pages.drain())
                        out.append((lease, None))
                        continue
                    given = cached + e.alloc(n - len(cached))
                    left = c.engine_pages.adopt(lease, tokens, given)
                    e.give_back(left)
                    out.append((lease, left))
                return out

            for lease, left in on_all(request)[0]:
                stats["left"] += len(left or [])
                if left is not None and rng.random() < 0.5:
                    running.append(lease)
                elif left is not None:
                    on_all(lambda c, e, lease=lease: (c.release(lease), e.give_back(c.engine_pages.drain()))[1])
        elif kind < 0.85 and running:
            lease = running.pop(rng.randrange(len(running)))
            on_all(lambda c, e, lease=lease: (c.release(lease), e.give_back(c.engine_pages.drain()))[1])
        else:
            k = rng.randint(1, 4)
            on_all(lambda c, e, k=k: (c.evict_device(k), e.give_back(drained := c.engine_pages.drain()), drained)[2])
        if host and rng.random() < 0.5:  # a round: the copies in flight are agreed landed
            on_all(lambda c, e: (_settle(c), e.give_back(drained := c.engine_pages.drain()), drained)[2])
        stats["evicted"] = sum(c.stats.device_evicted_pages for c in cores[:1])
        for c, e in zip(cores, engines, strict=True):
            check(c)
            assert len(e.free) + c.device.used == pages, f"seed {seed}: a page was lost or held twice"
            assert not any(c.device.is_owned(p) for p in e.free)
        assert len({c.state_digest() for c in cores}) == 1
        assert len({tuple(e.free) for e in engines}) == 1


@pytest.mark.parametrize("host", [0, 12], ids=["device", "host"])
def test_random_schedules_agree_and_lose_no_page(host: int) -> None:
    totals = {"left": 0, "evicted": 0, "loaded": 0}
    for seed in range(25):
        stats = {"left": 0, "evicted": 0, "loaded": 0}
        _schedule(seed, stats, host=host)
        totals = {k: totals[k] + stats[k] for k in totals}
    # The schedules did exercise what they check: pages cached twice, evicted, loaded from host.
    assert totals["left"] > 0 and totals["evicted"] > 0, totals
    assert (totals["loaded"] > 0) == bool(host), totals


def test_a_host_tier_keeps_evicted_pages_and_a_load_adopts_them_into_the_engines_pages() -> None:
    ranks = [core(host_pages=16), core(host_pages=16)]
    seen = []
    for c in ranks:
        lease, _ = c.lock(toks(1, 2, 3))
        c.engine_pages.adopt(lease, toks(1, 2, 3), [4, 5, 6])
        (backup,) = c.ready().transfers  # write-through: the adopted pages are copied to host
        c.advance()
        assert backup.kind.name == "BACKUP" and backup.device_pages == [4, 5, 6]
        assert c.evict_device(3) == 0  # the copy in flight protects its pages
        c.complete(backup.kind)
        c.release(lease)
        check(c)
        assert c.evict_device(2) == 2 and c.engine_pages.drain() == [6, 5]
        hit = c.match(toks(1, 2, 3))
        assert (hit.device_pages, hit.host_pages) == (1, 2)
        lease, _ = c.lock(toks(1, 2, 3))
        before = c.state_digest()
        with pytest.raises(ValueError, match="holds 2 host-only pages after its 1 device pages; cannot load 3"):
            c.engine_pages.load_adopted(lease, [7, 8, 9])
        with pytest.raises(ValueError, match="page 4 is cached at another position"):
            c.engine_pages.load_adopted(lease, [4, 8])
        assert c.state_digest() == before
        load = c.engine_pages.load_adopted(lease, [8, 7])
        assert load is not None and load.engine_pages and load.device_pages == [8, 7]
        assert list(c.match(toks(1, 2, 3)).device_page_ids) == [4, 8, 7]
        assert c.evict_device(3) == 0  # the lease pins the loaded pages
        check(c)
        c.release(lease)  # parked until the load is agreed landed
        assert c.evict_device(3) == 0
        c.ready()
        c.advance()
        c.complete(load.kind)
        check(c)
        assert c.evict_device(3) == 3
        seen.append((c.engine_pages.drain(), c.state_digest()))
        check(c)
    assert seen[0] == seen[1]
    assert sorted(seen[0][0]) == [4, 7, 8]


def test_storage_keeps_adopted_pages_for_a_fresh_core_which_prefetches_them_to_host_and_loads_them() -> None:
    from tpcache.core import OpKind

    first = core(host_pages=16, storage=True)
    lease, _ = first.lock(toks(1, 2, 3))
    first.engine_pages.adopt(lease, toks(1, 2, 3), [4, 5, 6])
    _settle(first)  # the backup to host lands, then its write to storage
    _settle(first)
    first.release(lease)
    check(first)
    assert first.stats.storage_written_pages == 3

    fresh = core(host_pages=16, storage=True)  # restarted over the same storage: nothing cached
    lease, m = fresh.lock(toks(1, 2, 3, 4))
    assert m.device_pages == m.host_pages == 0
    assert fresh.prefetch(lease)
    fresh.complete(OpKind.STORAGE_QUERY, 3)  # the agreed hit: 3 pages (page 4 was never stored)
    fresh.after_commit()
    fresh.complete(OpKind.STORAGE_READ, 2)  # a read that failed on some rank after 2 pages: a miss past them
    fresh.after_commit()
    assert fresh.prefetch_status(lease)[1] == 2  # the 2 pages that landed are on host (a retry may follow)
    fresh.release(lease)
    check(fresh)
    hit = fresh.match(toks(1, 2, 3, 4))
    assert (hit.device_pages, hit.host_pages) == (0, 2)
    lease, _ = fresh.lock(toks(1, 2, 3, 4))
    load = fresh.engine_pages.load_adopted(lease, [9, 7])
    assert load is not None and load.device_pages == [9, 7]
    assert list(fresh.match(toks(1, 2, 3, 4)).device_page_ids) == [9, 7]
    fresh.complete(OpKind.LOAD)
    fresh.after_commit()
    fresh.release(lease)
    check(fresh)
    assert fresh.stats.host_hit_tokens == 2 * PAGE  # read to host by the prefetch, served from host
