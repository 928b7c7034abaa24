"""The core's kernels in C (``tpcache/core/treecore/_account.c``, ``_candidates.c``, ``_evict.c``, ``_chain.c``,
``_holding.c``, ``_settle.c``)
against their Python references: records, counter flags, holdings, candidacy, offers and pops
on random node states; mixes, hashes and token bytes; eviction and inserts on two cores in lockstep. The
simulator schedules in ``test_native_nodes`` hold the whole core equal end to end."""

from __future__ import annotations

import heapq
import random
import types
from array import array

import pytest

from tpcache.core import CacheConfig, CacheCore, check, hashing
from tpcache.core.digest import mix, reference_mix
from tpcache.core.hashing import as_token_bytes
from tpcache.core.inserts import Inserter
from tpcache.core.tiers import TRANSITIONS, DeviceState, HostState, IllegalTransition, StorageState
from tpcache.core.treecore import allocator, eviction
from tpcache.core.treecore import core as treecore_core
from tpcache.core.treecore import ledger as ledger_module
from tpcache.core.treecore.accounting import (
    flags_of,
    record_of,
    reference_flags_of,
    reference_record_of,
)
from tpcache.core.treecore.eviction import Candidates, is_device_candidate, is_host_candidate
from tpcache.core.treecore.holdings import (
    DEVICE_PINS,
    HOST_PINS,
    PAGES,
    NodeHolding,
    PageHolding,
    ReferenceHolding,
    term,
)
from tpcache.core.treecore.tree import NATIVE_NODES, RadixTree
from tpcache.replay import drain
from tpcache.testing.ops import apply, random_op
from tpcache.testing.sim import snapshot

pytestmark = pytest.mark.skipif(not NATIVE_NODES, reason="tpcache.core.treecore._node was not built (no C compiler)")

if NATIVE_NODES:
    from tpcache.core.treecore import _node


def random_tree(seed: int, n: int = 60) -> RadixTree:
    """A tree whose nodes carry random tier states, pins, stamps and hits (not a state the cache
    would reach: the kernels must agree on any field values)."""
    rng = random.Random(seed)
    tree = RadixTree(4)
    nodes = [tree.root]
    for _ in range(n):
        parent = rng.choice(nodes)
        node = tree.add_child(parent, rng.randbytes(16), rng.getrandbits(64), rng.randrange(100))
        node.device_state = rng.choice([0, 0, 1, 2, 2])
        node.host_state, node.storage_state = rng.choice([0, 1, 2, 2]), rng.randrange(3)
        node.device_pins, node.host_pins = rng.choice([0, 0, 1, 3]), rng.choice([0, 0, 2])
        node.device_page, node.host_slot = rng.randrange(-1, 1 << 31), rng.randrange(-1, 1 << 20)
        node.last_access, node.hits = rng.randrange(1 << 40), rng.randrange(50)
        nodes.append(node)
    return tree


@pytest.mark.parametrize("seed", range(5))
def test_records_flags_and_candidacy_match_the_references(seed):
    tree = random_tree(seed)
    for node in tree.nodes.values():
        assert record_of(node) == reference_record_of(node)
        assert flags_of(node) == reference_flags_of(node)
    node = next(iter(tree.nodes.values()))
    node.comp = [1, 2, 3]  # a component record: packed after the node's fields, in C as in the reference
    assert record_of(node) == reference_record_of(node)
    node.comp = [-(1 << 63), (1 << 63) - 1, 0, -1] * 20  # past the kernel's buffer on the stack
    assert record_of(node) == reference_record_of(node)
    for bad, error in (([1 << 63], OverflowError), ([1.5], TypeError)):
        node.comp = bad
        with pytest.raises(error):
            reference_record_of(node)
        with pytest.raises(error):
            record_of(node)


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
@pytest.mark.parametrize("seed", range(4))
def test_offers_and_pops_match_the_reference(policy, seed):
    """Two equal trees: every node offered in C on one and through the reference methods on the
    other gives the same heaps, entry for entry; after the same changes (stale keys, new pins),
    both pop the same nodes in the same order."""
    trees = random_tree(seed, 80), random_tree(seed, 80)
    native, ref = Candidates(policy, trees[0]), Candidates(policy, trees[1])
    pairs = list(zip(trees[0].nodes.values(), trees[1].nodes.values(), strict=True))
    for a, b in pairs + pairs[::3]:
        native.offer(a)
        Candidates.offer(ref, b)
        native.offer_around(a)
        Candidates.offer_around(ref, b)
    assert native.device_heap == ref.device_heap and native.host_heap == ref.host_heap
    assert any(is_device_candidate(a) for a, _ in pairs) and any(is_host_candidate(a) for a, _ in pairs)
    for a, b in pairs[::4]:  # stale entries and nodes that stopped being candidates
        a.last_access = b.last_access = a.last_access + 1
        a.hits = b.hits = a.hits + 1
        a.created_at = b.created_at = a.created_at + 1
    for a, b in pairs[1::5]:
        a.device_pins = b.device_pins = a.device_pins + 1
        a.host_pins = b.host_pins = a.host_pins + 1
    pops = 0
    for heap in ("device", "host"):
        is_candidate = is_device_candidate if heap == "device" else is_host_candidate
        popped, expected = [], []
        while (a := getattr(native, f"pop_{heap}")()) is not None:
            popped.append(a.node_id)
        while (b := ref._pop(getattr(ref, f"{heap}_heap"), is_candidate)) is not None:
            expected.append(b.node_id)
        assert popped == expected
        pops += len(popped)
    assert pops > 0


@pytest.mark.parametrize("size", [300, 30000])
def test_a_native_rebuild_and_pops_lay_the_heaps_out_as_heapq(size):
    """The C sifts are heapq's: a rebuild (heapify, also past the size where heapq changes its
    traversal) and pops leave the lists entry for entry as the reference's heapq calls leave them,
    and the candidacy test in C, components included, is the reference's for every node."""
    trees = random_tree(size, size), random_tree(size, size)
    rng = random.Random(size)
    for a, b in zip(trees[0].nodes.values(), trees[1].nodes.values(), strict=True):
        if a.parent is not None and rng.random() < 0.3:  # component records: idle, written (1) or pinned
            a.comp = b.comp = [0, -1, rng.choice([0, 1, 2, 2]), -1, 0, 0, rng.choice([0, 0, 1]), 0]
    native, ref = Candidates("lru", trees[0]), Candidates("lru", trees[1])
    for a, b in zip(trees[0].nodes.values(), trees[1].nodes.values(), strict=True):
        assert _node.candidacy(a) == is_device_candidate(b) | is_host_candidate(b) << 1
    native.rebuild()
    nodes, key = list(trees[1].nodes.values()), ref.policy.key  # the reference's rebuild, with heapq's heapify
    device = [key(n) << 64 | n.node_id for n in nodes if is_device_candidate(n)]
    host = [key(n) << 64 | n.node_id for n in nodes if is_host_candidate(n)]
    heapq.heapify(device)
    heapq.heapify(host)
    assert len(device) > 2500 or size < 2500
    assert native.device_heap == device and native.host_heap == host
    assert native.device_heap is native.native.device  # the same list, changed in place
    for _ in range(len(device) // 2):
        assert native.pop_device() is not None
        ref.live(heapq.heappop(device), is_device_candidate)
    assert native.device_heap == device


def test_a_stale_entry_is_skipped_by_the_native_pop():
    core = CacheCore(CacheConfig(page_size=4, device_pages=8))
    lease, _ = core.lock(list(range(8)))
    core.insert(lease, list(range(8)), core.alloc(lease, 2))
    core.release(lease)
    leaf = max(core.tree.nodes.values(), key=lambda n: n.depth)
    cands = core.candidates
    old = cands.policy.key(leaf) - (1 << 128)  # the same node one stamp earlier: an old key
    heapq.heappush(cands.device_heap, old << 64 | leaf.node_id)
    assert cands.pop_device() is leaf
    assert cands.pop_device() is None  # its parent has a device child until the leaf goes


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_an_entry_equal_to_a_live_one_only_in_its_low_words_is_stale(policy):
    """The native pop compares entries with a node's key word by word: an entry that agrees with
    the live one in every word the key has but carries higher bits (one wider by a digit, by a word,
    or by many) is another key, skipped as stale, whatever its width."""
    core = CacheCore(CacheConfig(page_size=4, device_pages=8, eviction_policy=policy))
    lease, _ = core.lock(list(range(8)))
    core.insert(lease, list(range(8)), core.alloc(lease, 2))
    core.release(lease)
    leaf = max(core.tree.nodes.values(), key=lambda n: n.depth)
    cands = core.candidates
    live = cands.policy.key(leaf) << 64 | leaf.node_id
    width = 64 * (5 if policy == "lfu" else 4)
    for extra in (1 << width, 1 << (width + 29), 1 << (width + 64), 3 << 600):
        heapq.heappush(cands.device_heap, live | extra)
    cands.device_heap.remove(live)
    heapq.heapify(cands.device_heap)
    assert cands.pop_device() is None  # every entry left is wider than the leaf's: stale
    cands.offer(leaf)
    assert cands.pop_device() is leaf


@pytest.mark.parametrize("seed", range(4))
def test_a_native_holding_keeps_the_entries_and_total_of_the_reference(seed):
    """Random changes to a native holding and a ``ReferenceHolding`` side by side: the same entries,
    the same total, and the total its recount gives; a refused change changes neither. The total is
    read after some changes only: the native one sums the terms of entries added since it was last
    read when it is read or an entry goes, so changes run with such entries pending too."""
    rng = random.Random(seed)
    nodes = list(random_tree(seed, 30).nodes)  # (node ids)
    lease, kind = rng.randrange(1 << 40), rng.choice([DEVICE_PINS, HOST_PINS, PAGES])
    pick = (lambda: rng.choice(nodes)) if kind != PAGES else (lambda: rng.randrange(1 << 50))
    first = [pick() for _ in range(rng.randrange(4))]
    native = (NodeHolding if kind != PAGES else PageHolding)(lease, kind, first)
    ref = ReferenceHolding(lease, kind, first)
    assert type(native).__mro__[2] is _node.Holding
    for _ in range(300):
        which = rng.randrange(8)
        if which == 0:
            item = pick()
            native.append(item), ref.append(item)
        elif which == 1:
            items = [pick() for _ in range(rng.randrange(4))]
            native.extend(iter(items)), ref.extend(items)
        elif which == 2 and native:
            item = rng.choice(native)
            native.remove(item), ref.remove(item)
        elif which == 3:
            gone = set(rng.sample(list(native), min(len(native), 2)))
            native.discard(gone), ref.discard(gone)
        elif which == 5:  # many at once, some held twice, some not held, one past int64
            gone = [pick() for _ in range(rng.randrange(40))] + list(native)[::3] + [1 << 70]
            native.discard(gone), ref.discard(gone)
        elif which == 4:
            at = rng.randrange(-3, len(native) + 3)
            native.truncate(at), ref.truncate(at)
        elif which == 6 and rng.random() < 0.1:
            native.empty(), ref.empty()
        else:
            for change in (lambda h: h.extend([pick(), object()]), lambda h: h.append(object())):
                for held in (native, ref):
                    with pytest.raises(TypeError, match="an int"):
                        change(held)
        assert list(native) == list(ref)
        if rng.random() < 0.3:
            assert native.total == ref.total == native.recount() == ref.recount()
    assert native.total == sum(term(lease, kind, e) for e in native) % (1 << 62)
    assert (native.lease_id, native.kind) == (lease, kind)
    with pytest.raises(ValueError, match="not in list"):
        native.remove(-1)
    with pytest.raises(TypeError, match="an int"):
        native.remove(object())
    with pytest.raises(AttributeError):
        native.total = 0


def _twin_cores(config: CacheConfig, seed: int, steps: int) -> tuple[list[CacheCore], list[list]]:
    """Two cores after the same random requests (page size 4), and the leases each still holds."""
    cores = [CacheCore(config), CacheCore(config)]
    leases: list[list] = [[], []]
    rng = random.Random(seed)
    for _ in range(steps):
        op = random_op(rng, 4, requests=0.3, appends=0.1)
        for core, held in zip(cores, leases, strict=True):
            apply(core, op, held)
            drain(core)
    return cores, leases


@pytest.mark.parametrize("seed", range(4))
def test_dropping_a_device_leaf_in_one_step_is_free_then_remove(seed):
    """``Ledger.drop_device_leaf`` (eviction's common case) leaves what ``free_device_copy`` +
    ``remove_if_empty`` leave: nodes, digest, counters, free pages; it refuses any other node."""
    cores, leases = _twin_cores(CacheConfig(page_size=4, device_pages=24, host_pages=0), seed, 60)
    for core, held in zip(cores, leases, strict=True):
        for lease, _ in held[: len(held) // 2]:  # some pages stay pinned
            core.release(lease)
        drain(core)
    a, b = cores
    fast = refused = 0
    for na in sorted(a.tree.nodes.values(), key=lambda n: -n.depth):
        nb = b.tree.nodes[na.node_id]
        if na.parent is None or not na.device_valid or na.device_pins:
            assert not a.ledger.drop_device_leaf(na)
            refused += 1
            continue
        if a.ledger.drop_device_leaf(na):
            b.ledger.free_device_copy(nb)
            b.ledger.remove_if_empty(nb)
            fast += 1
        assert snapshot(a) == snapshot(b) and a.digest.value == b.digest.value
        assert a.ledger.device._free == b.ledger.device._free  # the same pages, freed in the same order
        assert (a.ledger.evictable_device_pages, a.ledger.protected_device_pages) == (
            b.ledger.evictable_device_pages,
            b.ledger.protected_device_pages,
        )
    assert fast and refused
    check(a)


# (from states, the change): an agreed copy's change to its pages, as the completions apply them.
SETTLES = [
    ({"host_state": HostState.WRITING}, {"host": HostState.VALID}),  # a backup landed
    ({"device_state": DeviceState.LOADING, "host_pins": 1}, {"device": DeviceState.VALID, "host_pins": -1}),
    ({"storage_state": StorageState.WRITING, "host_pins": 2}, {"storage": StorageState.DURABLE, "host_pins": -1}),
    ({"storage_state": StorageState.NONE}, {"storage": StorageState.WRITING, "host_pins": 1}),
    ({"host_state": HostState.WRITING}, {"host": HostState.VALID, "storage": StorageState.DURABLE}),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", range(len(SETTLES)))
def test_settling_a_copy_in_c_is_the_update_loop(seed, case, monkeypatch):
    """``Ledger.settle`` in C (``_settle.c``) leaves what the reference loop of ``update`` leaves: the
    nodes, digest, counters, mirror index (in its order) and heaps; at a node whose transition the
    tier tables refuse it raises as the reference does, with the nodes before it changed alike."""
    config = CacheConfig(page_size=4, device_pages=24, host_pages=24, write_policy="write_through")
    (a, b), _ = _twin_cores(config, seed, 50)
    before, change = SETTLES[case]
    rng = random.Random(seed * 10 + case)
    present = [i for i, n in a.tree.nodes.items() if n.parent is not None]
    ids = sorted(rng.sample(present, min(12, len(present))))
    assert len(ids) >= 8
    bad = ids[5] if seed == 2 else None  # a node the change cannot apply to: the loop stops there
    tier = next(t for t in ("device", "host", "storage") if t in change)
    for core in (a, b):
        for i in ids:
            node = core.tree.nodes[i]
            for name, value in before.items():
                setattr(node, name, value)
            if "storage" not in change:  # some become mirrors (device, host and storage copies)
                node.storage_state = StorageState.DURABLE
            if i == bad:  # a state to itself is never a transition
                setattr(node, f"{tier}_state", change[tier])
            core.ledger._rerecord(node)
    outcome = []
    for core, native in ((a, True), (b, False)):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(ledger_module, "_native", None)
            nodes = [core.tree.nodes[i] for i in ids]
            try:
                core.ledger.settle(nodes, **change)
                outcome.append(None)
            except IllegalTransition as exc:
                outcome.append(str(exc))
    assert outcome[0] == outcome[1] and (outcome[0] is not None) == (bad is not None)
    assert snapshot(a) == snapshot(b) and a.digest.value == b.digest.value
    assert list(a.ledger.mirrors) == list(b.ledger.mirrors)
    assert (a.ledger.evictable_device_pages, a.ledger.protected_device_pages) == (
        b.ledger.evictable_device_pages,
        b.ledger.protected_device_pages,
    )
    assert a.candidates.device_heap == b.candidates.device_heap and a.candidates.host_heap == b.candidates.host_heap


def test_a_leaf_with_a_host_copy_is_not_dropped_in_one_step():
    core = CacheCore(CacheConfig(page_size=4, device_pages=8, host_pages=8, write_policy="write_through"))
    lease, _ = core.lock(list(range(8)))
    core.insert(lease, list(range(8)), core.alloc(lease, 2))
    drain(core)
    core.release(lease)
    leaf = max(core.tree.nodes.values(), key=lambda n: n.depth)
    assert leaf.device_valid and leaf.on_host and not leaf.device_pins
    before = (snapshot(core), core.digest.value)
    assert not core.ledger.drop_device_leaf(leaf)
    assert (snapshot(core), core.digest.value) == before


def test_mix_matches_its_reference():
    rng = random.Random(2)
    for _ in range(500):
        fields = [rng.getrandbits(64)] + [rng.randrange(-(1 << 63), 1 << 63) for _ in range(6)] + [rng.getrandbits(64)]
        fields = fields[: rng.randrange(9)]  # "<QqqqqqqQ": the first and the last unsigned
        assert mix(*fields) == reference_mix(*fields)
    # What the reference refuses, C refuses alike: the same error, the same line.
    for bad in ([-1], [1 << 64], [0, 1 << 63], [0, -(1 << 63) - 1], [0] * 7 + [-1], [0] * 9, [1.5], [0, "1"]):
        with pytest.raises((TypeError, OverflowError)) as ref:
            reference_mix(*bad)
        with pytest.raises((TypeError, OverflowError)) as native:
            mix(*bad)
        assert (type(native.value), str(native.value)) == (type(ref.value), str(ref.value))


def test_token_bytes_match_the_array_reference():
    rng = random.Random(3)
    for n in (0, 1, 17, 2048):
        ids = [rng.randrange(-(1 << 31), 1 << 31) for _ in range(n)]
        assert _node.token_bytes(ids) == _node.token_bytes(tuple(ids)) == array("i", ids).tobytes()
    assert _node.token_bytes([True, 2]) == array("i", [1, 2]).tobytes()
    assert _node.token_bytes([1.0]) is None and _node.token_bytes(array("i", [1])) is None  # the reference's
    for big in (1 << 31, -(1 << 31) - 1, 1 << 70):
        with pytest.raises(ValueError, match="int32"):
            as_token_bytes([1, big])


def _policy_key_tuple(policy: str, node) -> tuple:
    tail = (-node.depth, node.hash, node.node_id)
    return {"lru": (node.last_access,), "lfu": (node.hits, node.last_access), "fifo": (node.created_at,)}[policy] + tail


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
def test_int_heap_entries_order_as_the_tuples_they_pack(policy):
    """An entry packs (key fields, -depth, hash, node id) 64 bits each: sorting entries sorts the tuples."""
    cands = Candidates(policy, random_tree(7, 200))
    nodes = [n for n in cands.tree.nodes.values() if n.parent is not None]
    by_entry = sorted(nodes, key=lambda n: cands.policy.key(n) << 64 | n.node_id)
    assert by_entry == sorted(nodes, key=lambda n: _policy_key_tuple(policy, n))


def _lockstep(page_size: int, policy: str, host_pages: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three cores, the same random ops: one through the C kernels (eviction's leaf loop, the insert
    and append chains, page allocation, token bytes), one through the Python references with
    ``_append_new``, the last through the references and ``_adopt``; equal after every op. With host
    pages (write-through), eviction meets leaves with host copies and backlog entries, which the C
    loop hands back to the Python one."""
    policies = {"eviction_policy": policy, "write_policy": "write_through"}
    config = CacheConfig(page_size=page_size, device_pages=40, host_pages=host_pages, **policies)
    cores = CacheCore(config), CacheCore(config), CacheCore(config)
    held: list[list] = [[], [], []]
    chain, token_bytes = _node.pinned_chain, hashing._token_bytes
    appended = []  # the chains append_chain made (the native core's appends it took)

    def append_chain(*args):
        made = _node.append_chain(*args)
        appended.append(made is not None)
        return made

    native = types.SimpleNamespace(append_chain=append_chain, pinned_chain=lambda *args: _node.pinned_chain(*args))
    monkeypatch.setattr(treecore_core, "_native", native)
    rng = random.Random(seed)
    for step in range(250):
        op = random_op(rng, page_size, requests=0.4, appends=0.2)
        for mode, core, leases in zip(("native", "reference", "adopt"), cores, held, strict=True):
            with monkeypatch.context() as m:
                if mode != "native":
                    for module in (eviction, ledger_module, treecore_core, allocator):  # touch, chains
                        m.setattr(module, "_native", None)
                    m.setattr(_node, "pinned_chain", lambda *args: None)
                    m.setattr(hashing, "_token_bytes", None)
                if mode == "adopt":
                    m.setattr(Inserter, "_append_new", lambda *args: None)
                    m.setattr(Inserter, "_insert_pinned", lambda *args: None)
                apply(core, op, leases)
                drain(core)
        for other in cores[1:]:
            a, b = cores[0], other
            assert snapshot(a) == snapshot(b) and a.digest.value == b.digest.value, f"step {step}: {op}"
            assert a.device._free == b.device._free and a.candidates.device_heap == b.candidates.device_heap
            assert a.clock == b.clock and a.stats == b.stats
    assert _node.pinned_chain is chain and hashing._token_bytes is token_bytes
    assert a.stats.device_evicted_pages > 20 and a.stats.inserted_pages > 40
    assert sum(appended) >= 5
    for core in cores:
        check(core)


# Hash inputs of 16, 24, 72 and 264 bytes: each a length branch of XXH3.
@pytest.mark.parametrize("page_size", [2, 4, 16, 64])
@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
@pytest.mark.parametrize("host_pages", [0, 12])
def test_the_kernels_and_their_references_make_the_same_core(page_size, policy, host_pages, monkeypatch):
    _lockstep(page_size, policy, host_pages, page_size * 7 + len(policy) + host_pages, monkeypatch)


def test_append_chain_takes_only_new_pages_the_lease_holds_and_otherwise_changes_nothing():
    """The cases ``append_chain`` leaves to the reference (None) change nothing; the one it takes
    makes the chain ``_append_new`` makes."""
    config = CacheConfig(page_size=4, device_pages=32)
    core = CacheCore(config)
    tokens = list(range(8))
    lease_id, _ = core.lock(tokens)
    core.insert(lease_id, tokens, core.alloc(lease_id, 2))
    other_id, _ = core.lock([100 + t for t in range(4)])
    core.insert(other_id, [100 + t for t in range(4)], core.alloc(other_id, 1))
    lease, led = core.lease(lease_id), core.ledger
    cursor, fresh = core.tree.nodes[lease.cursor], core.alloc(lease_id, 2)
    foreign = core.tree.nodes[core.lease(other_id).device_nodes[0]].device_page
    data = as_token_bytes(list(range(8, 16)))
    state = lambda: (snapshot(core), led.digest.value, led.clock, list(lease.pages), list(lease.device_nodes))  # noqa: E731
    before = state()
    tree = led.tree

    def append_chain(cur, data, pages, clock=None):
        clock = led.clock + 1 if clock is None else clock
        at = tree.nodes, tree._next_id, config.page_size, tree.seed, clock, lease.pages, lease.device_nodes
        return _node.append_chain(*at, cur, data, pages)

    refused = [
        (cursor, data, [fresh[0], foreign]),  # a page the lease does not hold
        (cursor, data, [fresh[0], fresh[0]]),  # the same page twice
        (cursor, data, fresh[:1]),  # fewer pages than the data's
        (cursor, b"", fresh),  # nothing to add
        (cursor, data, tuple(fresh)),  # pages not in a list
        (led.tree.root, as_token_bytes(tokens), fresh),  # the first page is below the root already
    ]
    for args in refused:
        assert append_chain(*args) is None, args
        assert state() == before
    assert append_chain(cursor, data, fresh, clock=1 << 63) is None and state() == before  # a clock past int64
    assert lease.cursor == cursor.node_id
    ids = core.treecore.append_chain(lease, cursor.node_id, data, fresh)
    assert [core.tree.nodes[i].device_page for i in ids] == fresh and lease.cursor == ids[-1] and lease.pages == []
    assert led.clock == before[2] + 1 and list(lease.device_nodes) == before[4] + ids
    check(core)


def test_a_kernel_refusing_a_value_past_its_field_changes_nothing():
    """A page past int32, a clock past int64 or a pin count past int32 raises before any node changes:
    a node's numbers are C integers, and a kernel checks what it would store before it stores it."""
    core = CacheCore(CacheConfig(page_size=4, device_pages=32, host_pages=8))
    tokens = list(range(8))
    lease_id, _ = core.lock(tokens)
    core.insert(lease_id, tokens, core.alloc(lease_id, 2))
    lease, led = core.lease(lease_id), core.ledger
    tree, fresh = led.tree, core.alloc(lease_id, 2)
    cursor = tree.nodes[lease.cursor]
    numbers = lambda: [(n.device_pins, n.host_pins, n.last_access, n.storage_state) for n in tree.nodes.values()]  # noqa: E731
    state = lambda: (snapshot(core), led.digest.value, numbers())  # noqa: E731
    before = state()
    data = as_token_bytes(list(range(8, 16)))
    with pytest.raises(OverflowError, match="past int32"):  # the second page: nothing made for the first
        _node.pinned_chain(tree.nodes, tree._next_id, 4, tree.seed, cursor, data, 0, [fresh[0], 2**31], led.clock)
    assert state() == before and len(tree.nodes) == 3
    path = list(lease.device_nodes)
    with pytest.raises(OverflowError):  # a clock past int64: no pin taken on the way
        _node.touch(tree.nodes, path, 1, True, False, 2**63, led.digest.value, led.candidates.native)
    assert state() == before
    nodes = [tree.nodes[i] for i in path]
    nodes[-1].host_pins = 2**31 - 1  # (a count no cache reaches: the last node's next pin overflows)
    before = state()
    with pytest.raises(OverflowError, match="pin count"):  # nor its storage state changed
        args = (None, None, StorageState.WRITING, 1, led.digest.value, led.candidates.native, led.mirrors, TRANSITIONS)
        _node.settle(nodes[1:], *args)
    assert state() == before and nodes[-1].storage_state == StorageState.NONE
