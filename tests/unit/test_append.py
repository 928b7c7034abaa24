"""``append``: a running request's new pages, given alone, cached as ``insert`` of its whole sequence
would cache them (same tree, pins, stamps and digest), at a cost that does not depend on its context."""

import random
from array import array

import pytest

from tpcache.core import CacheConfig, CacheCore, NoCursor, OutOfPages, check
from tpcache.core.inserts import Inserter
from tpcache.core.treecore import core as treecore_core
from tpcache.core.treecore.holdings import NodeHolding
from tpcache.replay import drain
from tpcache.testing.ops import apply, part_slots, random_op
from tpcache.testing.sim import snapshot

P = 4


def toks(*pages: int, depth: int = 0) -> list[int]:
    return [v * 1000 + (depth + d) * 10 + i for d, v in enumerate(pages) for i in range(P)]


def core_of(**kw) -> CacheCore:
    return CacheCore(CacheConfig(**{"page_size": P, "device_pages": 64, "host_pages": 16, **kw}))


def start(core: CacheCore, tokens: list[int]) -> int:
    """Lock, compute what the device lacks, insert: a request after its prefill."""
    lease, m = core.lock(tokens)
    fresh = core.alloc(lease, m.num_pages - m.device_pages)
    core.insert(lease, tokens, m.device_page_ids + fresh, part_slots(core, lease, m.device_pages, m.page_hashes))
    return lease


def grow(core: CacheCore, lease: int, seq: list[int], more: list[int], *, whole: bool) -> list[int]:
    """One decode step that completes ``more``'s pages: ``append`` them, or ``insert`` it all."""
    n = len(more) // P
    hashes = core.match(seq + more).page_hashes
    fresh = core.alloc(lease, n)
    if whole:
        have = core.treecore.device_pages(core.match(seq).nodes)
        slots = part_slots(core, lease, len(seq) // P, hashes)
        core.insert(lease, seq + more, have + fresh, slots)
    else:
        slots = {c: row[len(seq) // P :] for c, row in part_slots(core, lease, len(seq) // P, hashes).items()}
        core.append(lease, more, fresh, slots)
    check(core)
    return seq + more


@pytest.mark.parametrize("kind", ["full", "hybrid"])
def test_append_caches_what_an_insert_of_the_whole_sequence_caches(kind):
    """The same random requests on two cores, one appending and one inserting whole sequences: the
    same state, field by field and in the digest, after every step."""
    extra = {"swa_window": 2 * P, "swa_device_pages": 64, "mamba_every": 1, "mamba_device_states": 64}
    cores = [core_of(**(extra if kind == "hybrid" else {})) for _ in range(2)]
    rng = random.Random(7)
    running: list[tuple[int, list[int]]] = []
    for step in range(40):
        choice = rng.random()
        if choice < 0.3 or not running:
            seq = toks(*(rng.randrange(3) for _ in range(rng.randint(1, 4))))
            leases = [start(core, seq) for core in cores]
            assert leases[0] == leases[1]
            running.append((leases[0], seq))
        elif choice < 0.85:
            at = rng.randrange(len(running))
            lease, seq = running[at]
            more = toks(*(rng.randrange(3) for _ in range(rng.randint(1, 2))), depth=len(seq) // P)
            for core, whole in zip(cores, (False, True), strict=True):
                grown = grow(core, lease, seq, more, whole=whole)
            running[at] = (lease, grown)
        else:
            lease, _ = running.pop(rng.randrange(len(running)))
            for core in cores:
                core.release(lease)
        for core in cores:
            drain(core)
            check(core)
        assert snapshot(cores[0]) == snapshot(cores[1]), f"step {step}"
        assert cores[0].digest.value == cores[1].digest.value


def test_append_costs_what_it_adds_not_the_context():
    """An append walks only its own pages: the run caches along the context stay untouched."""
    core = core_of(device_pages=256)
    seq = toks(*range(100))
    lease = start(core, seq)
    core.match(seq)  # builds the run cache of the 100-page chain
    chain_top = core.tree.root.children[bytes(core.match(seq).walk.pages[0])]
    built = chain_top.run
    assert built is not None
    calls = []
    original = core.tree.walk
    core.tree.walk = lambda data, start=None: calls.append((len(data), start)) or original(data, start)  # type: ignore[method-assign]
    core.append(lease, toks(5, depth=100), core.alloc(lease, 1))
    cursor = core.tree.nodes[core.lease(lease).device_nodes[-2]]
    assert calls in ([], [(P * 4, cursor)])  # no walk at all (a new page), or one page's from the cursor
    assert chain_top.run is built  # the context's run cache untouched
    assert core.match(seq + toks(5, depth=100)).device_pages == 101
    check(core)


def test_without_a_sequence_to_continue_append_is_refused_and_changes_nothing():
    core = core_of()
    lease, _ = core.lock(toks(1, 2))
    page = core.alloc(lease, 1)
    before = snapshot(core), core.digest.value
    with pytest.raises(NoCursor, match="insert the whole sequence"):
        core.append(lease, toks(3, depth=2), page)  # locked, never inserted: nothing to continue
    assert (snapshot(core), core.digest.value) == before

    # A lease that pins a path other than the one it inserted (it locked other tokens) has no cursor.
    start(core, toks(1, 2))
    other, _ = core.lock(toks(1, 2, 3))
    core.insert(other, toks(1), [core.match(toks(1)).device_page_ids[0]])
    assert core.lease(other).cursor is None
    with pytest.raises(NoCursor):
        core.append(other, toks(4, depth=1), core.alloc(other, 1))
    check(core)


def test_a_load_that_pins_pages_clears_the_cursor_and_a_refused_one_keeps_it():
    """A load pins what it brings back outside the inserted sequence: append needs an insert again.
    A load that pins nothing new keeps the cursor, and a refused one changes nothing."""
    core = core_of(device_pages=6, host_pages=8, write_policy="write_through")
    seq = toks(1, 2, 3, 4, 5, 6)
    lease = start(core, seq)
    core.release(lease)
    drain(core)
    core.evict_device(3)  # pages 4-6 on host only
    lease, m = core.lock(seq)
    assert (m.device_pages, m.host_pages) == (3, 3)
    core.insert(lease, seq[: 3 * P], m.device_page_ids)
    cursor = core.lease(lease).cursor
    assert cursor is not None and core.treecore.depths([cursor]) == [3]
    other, _ = core.lock(toks(9, 9, 9))
    core.insert(other, toks(9, 9, 9), core.alloc(other, 3))  # the rest of the device, pinned
    before = snapshot(core), core.digest.value
    with pytest.raises(OutOfPages):
        core.load(lease)
    after = snapshot(core), core.digest.value
    assert after[0].pop("clock") == before[0].pop("clock") + 1  # the refused op still ticked, on every rank
    assert after == before and core.lease(lease).cursor == cursor
    check(core)
    core.release(other)
    drain(core)
    core.load(lease)  # brings pages 4-6 back, pinned by the lease
    assert core.lease(lease).cursor is None
    with pytest.raises(NoCursor):
        core.append(lease, toks(7, depth=6), [])
    check(core)


def test_append_refuses_a_page_the_lease_does_not_hold_and_changes_nothing():
    core = core_of()
    lease = start(core, toks(1, 2))
    stranger = start(core, toks(7))
    foreign = core.treecore.device_pages(core.lease(stranger).device_nodes[:1])[0]
    before = snapshot(core), core.digest.value
    with pytest.raises(ValueError, match="not held by lease"):
        core.append(lease, toks(3, depth=2), [foreign])
    assert (snapshot(core), core.digest.value) == before


def test_a_holding_changes_only_through_its_methods_and_keeps_its_total():
    held = NodeHolding(3, 1, list(range(6)))  # node ids
    for change in (lambda: held.insert(0, 9), lambda: held.pop(), held.clear, lambda: held.__delitem__(0)):
        with pytest.raises(TypeError):
            change()
    held.truncate(4)
    held.remove(held[1])
    held.discard({2})
    assert list(held) == [0, 3]
    assert held.total == held.recount() == NodeHolding(3, 1, [3, 0]).total  # order does not matter
    assert held.total != NodeHolding(4, 1, [0, 3]).total  # another lease's holding differs

    core = core_of()
    lease = core.lease(start(core, toks(1, 2, 3)))
    list.append(lease.pages, 10**6)  # behind the holding's back: the check finds it
    with pytest.raises(Exception, match="holding's total is stale"):
        check(core)


@pytest.mark.parametrize("seed", range(4))
def test_touch_is_update_node_by_node(seed):
    """The path-wide pin/stamp/hit that lock and release use leaves exactly what one ``update``
    per node leaves: nodes, digest, counters and the eviction candidates."""
    cores = [core_of(device_pages=24, write_policy="write_through") for _ in range(2)]
    leases: list[list] = [[], []]
    rng = random.Random(seed)
    for _ in range(60):
        op = random_op(rng, P, requests=0.3, appends=0.1)
        for core, held in zip(cores, leases, strict=True):
            apply(core, op, held)
            drain(core)
    a, b = cores
    for pins, stamp, hit in ((+1, True, True), (-1, True, False)):
        on_device = [[n for n in c.tree.nodes.values() if n.parent is not None and n.on_device] for c in cores]
        assert on_device[0], "the schedule left nothing on device"
        a.ledger.tick(), b.ledger.tick()
        a.treecore.touch([n.node_id for n in on_device[0]], pins, stamp=stamp, hit=hit)
        for node in on_device[1]:
            b.ledger.update(node, device_pins=pins, stamp=stamp, hit=hit)
        assert snapshot(a) == snapshot(b) and a.digest.value == b.digest.value
        counters = [(c.ledger.evictable_device_pages, c.ledger.protected_device_pages) for c in cores]
        assert counters[0] == counters[1]
        assert a.candidates.device_heap == b.candidates.device_heap
        assert a.candidates.host_heap == b.candidates.host_heap
    check(a)


def test_an_insert_after_its_lock_matches_an_insert_that_walks_again(monkeypatch):
    """An insert of the lock's own bytes may start from the walk its lock made. When another lease
    inserted the next page in between it walks again: either way the same tree, pins, cursor and
    digest as an insert that always walks again."""
    taken: list[bool] = []
    lock_walk = Inserter._lock_walk

    def spy(self, lease, data):  # noqa: ANN001, ANN202
        walk = lock_walk(self, lease, data)
        taken.append(walk is not None)
        return walk

    monkeypatch.setattr(Inserter, "_lock_walk", spy)

    def run(keep_walk: bool) -> CacheCore:
        core = core_of()
        data = array("i", toks(1, 2, 3)).tobytes()
        first, _ = core.lock(data)  # both match nothing yet
        second, _ = core.lock(data)
        core.insert(second, data, core.alloc(second, 3))  # pages the first lease's walk did not see
        prefix, _ = core.lock(data[: 2 * P * 4])  # its walk: the whole of its bytes, cached
        for lease in (first, prefix):
            if not keep_walk:
                core.lease(lease).walk = None
            tokens = core.lease(lease).tokens
            core.insert(lease, tokens, core.match(tokens).device_page_ids)
        for lease in (first, second, prefix):
            core.release(lease)
        drain(core)
        check(core)
        return core

    a = run(True)
    assert taken == [True, False, True]  # the second lease's walk, not the first's (stale), the prefix's
    b = run(False)
    assert snapshot(a) == snapshot(b) and a.digest.value == b.digest.value
    assert a.stats.inserted_pages == 3 and a.stats.duplicate_pages == 0


@pytest.mark.parametrize("wrong", [True, False])
def test_an_insert_after_a_full_hit_checks_the_pages_its_lock_read(wrong):
    """The lock's walk carries the device pages its match read (``Walk.matched_pages``); an insert
    of the same bytes compares the given pages with them: wrong ones are refused as an insert that
    walks again refuses them, the right ones give the same core."""

    def run(keep_walk: bool) -> tuple:
        core = core_of()
        data = array("i", toks(1, 2, 3)).tobytes()
        start(core, list(array("i", data)))
        lease, m = core.lock(data + array("i", toks(4, depth=3)).tobytes())
        walk = core.lease(lease).walk
        assert walk is not None and walk.matched_pages is not None and m.device_pages == 3
        assert walk.matched_pages.tolist() == m.device_page_ids
        if not keep_walk:
            core.lease(lease).walk = None
        tokens = core.lease(lease).tokens
        pages = m.device_page_ids + core.alloc(lease, 1)
        if wrong:  # the lease's page where a cached one lies, and a cached page as the new one
            pages[0], pages[3] = pages[3], pages[0]
        try:
            outcome: object = core.insert(lease, tokens, pages)
        except ValueError as exc:
            outcome = str(exc)
        core.release(lease)
        drain(core)
        check(core)
        return outcome, snapshot(core), core.digest.value

    a, b = run(True), run(False)
    assert a == b
    assert (a[0] == (1, 0)) != wrong


@pytest.mark.parametrize("kernel", [True, False])
def test_append_of_the_lease_s_own_pages_caches_them(kernel, monkeypatch):
    """``append`` given the very list the lease holds its pages in (which adopting them empties)
    caches those pages, through the C kernel and through ``_append_new``."""
    if not kernel:
        monkeypatch.setattr(treecore_core, "_native", None)
    core = core_of()
    lease = start(core, toks(1, 2))
    core.alloc(lease, 1)
    held = core.lease(lease).pages
    assert core.append(lease, toks(3, depth=2), held) == (1, 0)
    assert list(held) == [] and core.treecore.device(core.lease(lease).cursor)[1] >= 0
    check(core)
