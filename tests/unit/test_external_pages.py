"""Engine-owned device pages in the core: save, load_into, hit_pages, through the public operations
and the round (two ranks, one MIN reduce per round), with the invariants checked after each step."""

from collections.abc import Mapping

import pytest

from tpcache.comm import SimGroup
from tpcache.core import CacheClosed, CacheConfig, CacheCore, OpKind, check
from tpcache.core.round import Round
from tpcache.core.tiers import HostState
from tpcache.testing.ops import take_transfers

PAGE = 4


def config(**kw: object) -> CacheConfig:
    return CacheConfig(**{"page_size": PAGE, "device_pages": 0, "host_pages": 8, **kw})  # type: ignore[arg-type]


def toks(*pages: int) -> list[int]:
    return [p * 100 + i for p in pages for i in range(PAGE)]


class View:
    """One rank's local facts: op id -> pages that landed (absent: still in flight)."""

    def __init__(self) -> None:
        self.results: dict[int, int] = {}


class Group:
    """N cores driven alike; ``step`` runs one round with each rank's own completions."""

    def __init__(self, n: int = 2, **kw: object) -> None:
        self.cores = [CacheCore(config(**kw)) for _ in range(n)]
        self.rounds = [Round(c) for c in self.cores]
        self.views = [View() for _ in range(n)]
        self.sim = SimGroup(n)
        self.seq = 0

    def op(self, name: str, *args: object) -> list[object]:
        self.seq += 1
        return [getattr(c, name)(*args) for c in self.cores]

    def land(self, results: Mapping[int, int] | None = None, rank: int | None = None) -> None:
        """Report every op issued so far as landed in full, except ``results`` overrides on ``rank``."""
        for r, core in enumerate(self.cores):
            for op in take_transfers(core):
                self.views[r].results[op.op_id] = op.num_pages
            if results and (rank is None or rank == r):
                self.views[r].results.update(results)

    def step(self) -> None:
        vectors = [rd.prepare(self.seq, v.results, 0, True) for rd, v in zip(self.rounds, self.views, strict=True)]
        reduced = self.sim.reduce(vectors)
        for rd in self.rounds:
            rd.commit(reduced)
        for core in self.cores:
            check(core)
        assert len({c.digest.value for c in self.cores}) == 1 or all(c.closed for c in self.cores)


def test_save_makes_host_pages_valid_only_after_the_agreed_round() -> None:
    g = Group()
    (lease, _), _ = g.op("lock", toks(1, 2, 3))
    ops = g.op("save", lease, toks(1, 2, 3), [7, 8, 9])
    assert [o.device_pages for o in ops] == [[7, 8, 9]] * 2 and all(o.engine_pages for o in ops)
    assert g.cores[0].match(toks(1, 2, 3)).host_pages == 0  # writing is not readable
    g.land()
    g.step()
    assert [o.acked for o in ops] == [3, 3]
    assert [c.match(toks(1, 2, 3)).host_pages for c in g.cores] == [3, 3]
    # saving the same pages again is a no-op; a longer prompt saves only its new page
    assert g.op("save", lease, toks(1, 2, 3), [7, 8, 9]) == [None, None]
    more = g.op("save", lease, toks(1, 2, 3, 4), [7, 8, 9, 5])
    assert [o.device_pages for o in more] == [[5], [5]]


def test_partial_save_on_one_rank_keeps_only_the_agreed_prefix() -> None:
    g = Group()
    (lease, _), _ = g.op("lock", toks(1, 2, 3))
    ops = g.op("save", lease, toks(1, 2, 3), [0, 1, 2])
    g.land({ops[1].op_id: 1}, rank=1)  # rank 1 got only the first page through
    g.step()
    assert [o.acked for o in ops] == [1, 1]
    assert [c.match(toks(1, 2, 3)).host_pages for c in g.cores] == [1, 1]
    assert [c.host.used for c in g.cores] == [1, 1]  # the failed pages' slots went back


def test_load_into_copies_the_leases_hit_and_reports_failure_on_every_rank() -> None:
    g = Group()
    (w, _), _ = g.op("lock", toks(1, 2))
    g.op("save", w, toks(1, 2), [0, 1])
    g.land()
    g.step()
    g.op("release", w)
    (lease, hit), _ = g.op("lock", toks(1, 2, 3))
    assert hit.host_pages == 2 and g.cores[0].hit_pages(lease) == 2
    with pytest.raises(ValueError, match="holds 2 pages"):
        g.cores[0].load_into(lease, 1, [4, 5])
    ops = g.op("load_into", lease, 0, [10, 11])
    assert [(o.kind, o.device_pages) for o in ops] == [(OpKind.LOAD, [10, 11])] * 2
    assert [o.host_slots for o in ops] == [g.cores[0].treecore.host_slots(g.cores[0].match(toks(1, 2)).nodes)] * 2
    assert g.op("release", lease) == [False, False]  # parked: the load still writes its blocks
    g.land({ops[0].op_id: 0}, rank=0)  # the load failed on rank 0 only
    g.step()
    assert [o.acked for o in ops] == [0, 0]  # agreed: no rank uses the pages
    assert [len(c.leases) for c in g.cores] == [0, 0]  # released with its last copy
    assert [c.match(toks(1, 2)).host_pages for c in g.cores] == [2, 2]  # a failed load changes no tier


def test_a_lease_holding_its_hit_keeps_it_from_host_eviction() -> None:
    g = Group(host_pages=3)
    (w, _), _ = g.op("lock", toks(1, 2, 3))
    g.op("save", w, toks(1, 2, 3), [0, 1, 2])
    g.land()
    g.step()
    g.op("release", w)
    (lease, hit), _ = g.op("lock", toks(1, 2))
    assert hit.host_pages == 2
    (other, _), _ = g.op("lock", toks(5, 6, 7))
    ops = g.op("save", other, toks(5, 6, 7), [3, 4, 5])
    assert [o.num_pages for o in ops] == [1, 1]  # only page 3 was evictable: the hit is pinned
    g.land()
    g.step()
    assert [c.hit_pages(lease) for c in g.cores] == [2, 2]
    assert g.cores[0].match(toks(1, 2, 3)).host_pages == 2


def test_save_with_no_free_slot_saves_nothing_and_keeps_closure() -> None:
    g = Group(host_pages=1)
    (a, _), _ = g.op("lock", toks(1))
    g.op("save", a, toks(1), [0])
    assert g.op("save", a, toks(1, 2), [0, 1]) == [None, None]  # page 1 is writing, slot 0 in use
    g.land()
    g.step()
    (b, hit), _ = g.op("lock", toks(1))
    assert hit.host_pages == 1
    assert g.op("save", b, toks(1, 2), [0, 1]) == [None, None]  # the only slot is pinned by the hit


def test_engine_ops_are_refused_with_a_device_tier_or_when_closed() -> None:
    core = CacheCore(CacheConfig(page_size=PAGE, device_pages=4, host_pages=4))
    lease, _ = core.lock(toks(1))
    with pytest.raises(ValueError, match="device_pages=0"):
        core.save(lease, toks(1), [0])
    g = Group()
    (lease, _), _ = g.op("lock", toks(1, 2))
    with pytest.raises(ValueError, match="block for each"):
        g.cores[0].save(lease, toks(1, 2), [0])
    with pytest.raises(ValueError, match="twice"):
        g.cores[0].save(lease, toks(1, 2), [3, 3])
    g.cores[0].close("test")
    with pytest.raises(CacheClosed):
        g.cores[0].save(lease, toks(1, 2), [0, 1])


def test_divergent_saves_close_the_cache_and_nothing_becomes_readable() -> None:
    g = Group()
    (lease, _), _ = g.op("lock", toks(1, 2))
    g.cores[1].save(lease, toks(1, 2), [0, 1])  # only rank 1 applies it: the ranks diverge
    g.seq += 1
    g.land()
    g.step()
    assert all(c.closed for c in g.cores)
    assert [c.match(toks(1, 2)).host_pages for c in g.cores] == [0, 0]


def test_storage_writes_follow_an_agreed_save() -> None:
    g = Group(storage=True)
    (lease, _), _ = g.op("lock", toks(1, 2))
    g.op("save", lease, toks(1, 2), [0, 1])
    g.land()
    g.step()
    writes = [[op for op in c.inflight[OpKind.STORAGE_WRITE]] for c in g.cores]
    assert [[op.num_pages for op in w] for w in writes] == [[2], [2]]
    g.land()
    g.step()
    assert all(g.cores[0].treecore.host(i)[0] == HostState.VALID for i in g.cores[0].match(toks(1, 2)).nodes)
    assert g.cores[0].stats.storage_written_pages == 2


def test_a_flush_after_ranks_counted_different_ops_reopens_them_equal() -> None:
    g = Group()
    (lease, _), _ = g.op("lock", toks(1))
    extra, _ = g.cores[1].lock(toks(9))  # rank 1 alone: its lease and op counters run ahead
    g.cores[1].release(extra)
    g.land()
    g.step()
    assert all(c.closed for c in g.cores)
    g.op("request_flush")
    g.land()
    g.step()  # every rank asked and nothing is in flight: the agreed flush
    assert not any(c.closed for c in g.cores)
    g.land()
    g.step()  # the ranks stay equal (step() checks the digests) and open
    assert not any(c.closed for c in g.cores)
    (again, _), _ = g.op("lock", toks(1))
    assert again > lease  # ids never repeat across the flush


def test_a_save_stops_before_the_first_page_the_engine_no_longer_holds() -> None:
    g = Group()
    (lease, _), _ = g.op("lock", toks(1, 2, 3, 4))
    ops = g.op("save", lease, toks(1, 2), [7, 8])
    g.land()
    g.step()
    # pages 1-2 are on host; page 3 was freed by the engine (behind a sliding window): only
    # pages before it are saved, and nothing after it (the host tier stays ancestor-closed)
    assert g.op("save", lease, toks(1, 2, 3, 4), [-1, -1, -1, 5]) == [None, None]
    more = g.op("save", lease, toks(1, 2, 3, 4), [-1, -1, 9, 5])  # a page before the saved ones is not read
    assert [o.device_pages for o in more] == [[9, 5], [9, 5]]
    with pytest.raises(ValueError, match="engine block for every page"):
        g.cores[0].load_into(lease, 0, [3, -1])
    assert [o.acked for o in ops] == [2, 2]
