"""``TreeCore``'s methods, each held to the invariant its docstring states, on whichever backend this
process runs (``test_backends.py`` runs this directory under the other one too). The state is made
by a real ``CacheCore``'s operations; every answer is a plain value."""

from array import array

import pytest

from tpcache.core import CacheConfig, CacheCore, check
from tpcache.core.hashing import as_token_bytes, page_hash
from tpcache.core.tiers import DeviceState, HostState, IllegalTransition, StorageState
from tpcache.core.treecore import NodeView, TreeCore
from tpcache.core.treecore.core import ROOT
from tpcache.replay import drain

P = 4


def toks(*pages: int) -> list[int]:
    return [v * 10 + i for v in pages for i in range(P)]


def data(*pages: int) -> bytes:
    return as_token_bytes(toks(*pages))


def cached(*paths: tuple[int, ...], **config: object) -> CacheCore:
    """A core holding each path (device, backed up to host with write-through), no lease left."""
    core = CacheCore(CacheConfig(page_size=P, device_pages=16, host_pages=16, write_policy="write_through", **config))
    for path in paths:
        lease, _ = core.lock(toks(*path))
        core.insert(lease, toks(*path), core.alloc(lease, len(path)))
        core.release(lease)
        drain(core)
    return core


def _plain(value: object) -> bool:
    if isinstance(value, (tuple, list, set)):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (bool, int, bytes)


def test_ids_name_nodes_from_creation_to_removal_and_the_structure_reads_as_ids():
    core = cached((1, 2, 3), (1, 4))
    tc: TreeCore = core.treecore
    ids = tc.ids()
    assert ids == sorted(ids) and len(ids) == len(tc) == 4 and ROOT not in ids
    walk = tc.walk_ids(data(1, 2, 3, 9))
    assert len(walk) == 3 and walk == tc.path_of(walk[-1]) and tc.path_of(ROOT) == []
    assert [tc.parent_of(i) for i in walk] == [ROOT, walk[0], walk[1]] and tc.parent_of(ROOT) == -1
    branch = tc.walk_ids(data(1, 4))
    assert branch[0] == walk[0] and tc.children_of(walk[0]) == sorted([walk[1], branch[1]])
    assert tc.children_of(walk[-1]) == [] and tc.children_of(ROOT) == [walk[0]]
    # the hash chain: each page's hash from its parent's and its tokens
    hashes = tc.page_hashes(walk)
    assert hashes[1] == page_hash(hashes[0], data(2), core.tree.seed)
    core.evict_device(16)
    core.evict_host(16)
    assert tc.ids() == [] and not any(tc.exists(i) for i in ids) and tc.exists(ROOT)
    core.lock(toks(1, 2, 3))
    assert all(i not in ids for i in tc.walk_ids(data(1, 2, 3)))  # nothing yet: a miss makes no node
    lease, _ = core.lock(toks(1, 2, 3))
    core.insert(lease, toks(1, 2, 3), core.alloc(lease, 3))
    assert set(tc.walk_ids(data(1, 2, 3))).isdisjoint(ids)  # ids are never reused


def test_a_view_holds_the_same_values_as_each_read_and_every_read_is_plain():
    core = cached((1, 2, 3))
    tc = core.treecore
    lease, _ = core.lock(toks(1, 2))
    for node_id in tc.ids():
        view = tc.view(node_id)
        assert isinstance(view, NodeView) and all(_plain(v) for v in view)
        assert tc.device(node_id) == (view.device_state, view.device_page)
        assert tc.host(node_id) == (view.host_state, view.host_slot)
        assert tc.pins(node_id) == (view.device_pins, view.host_pins)
        assert tc.storage(node_id) == view.storage_state and tc.component(node_id) == view.component
        assert (view.device_page == -1) == (view.device_state == DeviceState.NONE)
        assert (view.host_slot == -1) == (view.host_state == HostState.NONE)
        assert tc.tier_states([node_id]) == [(view.device_state, view.host_state, view.storage_state)]
    first, second, third = tc.walk_ids(data(1, 2, 3))
    assert [tc.pins(i)[0] for i in (first, second, third)] == [1, 1, 0]  # the lease pins its hit
    core.release(lease)
    assert [tc.pins(i)[0] for i in (first, second, third)] == [0, 0, 0]


def test_the_bulk_reads_equal_the_reads_one_by_one():
    core = cached((1, 2, 3), (5, 6))
    tc = core.treecore
    ids = tc.walk_ids(data(1, 2, 3)) + tc.walk_ids(data(5, 6))
    assert tc.device_pages(ids) == [tc.device(i)[1] for i in ids]
    assert tc.host_slots(ids) == [tc.host(i)[1] for i in ids]
    assert tc.copy_sides(ids, None) == (tc.device_pages(ids), tc.host_slots(ids), tc.page_hashes(ids))
    pages, slots, hashes = tc.copy_sides(ids, [0, 3])
    assert pages == tc.device_pages([ids[0], ids[3]]) and slots == tc.host_slots([ids[0], ids[3]])
    assert hashes == tc.page_hashes(ids)
    assert tc.ids_on_device(ids) == ids
    assert tc.depths(ids) == [tc.view(i).depth for i in ids] == [1, 2, 3, 1, 2] and tc.depths([ROOT]) == [0]
    assert all(tc.depths([i])[0] == len(tc.path_of(i)) for i in ids)
    assert tc.device_sides(ids) == [tc.device(i) for i in ids] and all(_plain(v) for v in tc.device_sides(ids))
    assert [tc.valid_on_device(i) for i in ids] == [tc.device(i)[0] == DeviceState.VALID for i in ids] == [True] * 5
    core.evict_device(2)
    assert [tc.valid_on_device(i) for i in ids] == [tc.device(i)[0] == DeviceState.VALID for i in ids] != [True] * 5
    with pytest.raises(KeyError):
        tc.device_pages([max(ids) + 100])  # an id not in the tree
    with pytest.raises(KeyError):
        tc.touch([max(ids) + 100], +1)


def test_a_child_is_found_by_its_pages_tokens_and_a_path_reads_back_as_its_tokens():
    core = cached((1, 2, 3), (1, 4))
    tc = core.treecore
    one, two, three = tc.walk_ids(data(1, 2, 3))
    step = P * 4
    assert tc.has_child(ROOT, data(1), 0) and tc.has_child(one, data(9, 2), step) and tc.has_child(one, data(4), 0)
    assert not tc.has_child(one, data(5), 0) and not tc.has_child(three, data(1, 2, 3), 2 * step)
    assert not tc.has_child(two, data(1, 2), 2 * step)  # past the end of the bytes: no page, no child
    assert not tc.has_child(one, data(2)[: step - 4], 0)  # a partial page is no child
    assert tc.path_tokens(three) == data(1, 2, 3) and tc.path_tokens(ROOT) == b""
    branch = tc.walk_ids(data(1, 4))[-1]
    assert tc.path_tokens(branch) == data(1, 4) and tc.walk_ids(tc.path_tokens(branch))[-1] == branch


def test_path_union_lists_every_ancestor_once_in_a_fixed_order():
    core = cached((1, 2, 3), (1, 2, 4), (1, 5))
    tc = core.treecore
    a, b, c = tc.walk_ids(data(1, 2, 3))
    d = tc.walk_ids(data(1, 2, 4))[-1]
    e = tc.walk_ids(data(1, 5))[-1]
    assert tc.path_union([c, d, e]) == [c, b, a, d, e]
    assert tc.path_union([d, c]) == [d, b, a, c] and tc.path_union([]) == []


def test_the_device_prefix_and_the_hit_prefix_agree_with_match():
    core = cached((1, 2, 3))
    tc = core.treecore
    full = data(1, 2, 3, 7)
    m = core.match(full)
    count, pages = tc.device_prefix(full)
    assert count == m.device_pages == 3 and pages == m.device_page_array and isinstance(pages, array)
    assert tc.device_prefix(full, 2) == (2, pages[:2]) and tc.device_prefix(data(8)) == (0, array("i"))
    core.evict_device(1)  # the last page lives on in host only
    dev, host, hit_pages = tc.hit_prefix(core.tree.walk(full), True)
    assert (dev, host) == (2, 1) and hit_pages == pages[:2] == array("i", tc.device_prefix(full)[1])
    assert tc.hit_prefix(core.tree.walk(full), False)[:2] == (2, 0)
    assert tc.valid_device_pages() == set(pages[:2])


def test_a_refused_transition_changes_nothing():
    core = cached((1, 2))
    tc = core.treecore
    node_id = tc.walk_ids(data(1, 2))[-1]
    before, digest = tc.view(node_id), core.digest.value
    with pytest.raises(IllegalTransition):
        tc.update(node_id, device=(DeviceState.LOADING, 3))  # VALID -> LOADING is no transition
    assert tc.view(node_id) == before and core.digest.value == digest
    check(core)


def test_touch_and_settle_equal_update_node_by_node():
    one, other = cached((1, 2, 3)), cached((1, 2, 3))
    ids = one.treecore.walk_ids(data(1, 2, 3))
    assert ids == other.treecore.walk_ids(data(1, 2, 3))
    assert one.treecore.touch(ids, +1, stamp=True, hit=True) == []  # every page is on device
    for node_id in ids:
        other.treecore.update(node_id, device_pins=+1, stamp=True, hit=True)
    assert [one.treecore.view(i) for i in ids] == [other.treecore.view(i) for i in ids]
    assert one.digest.value == other.digest.value
    for core in (one, other):
        core.treecore.touch(ids, -1)
    # A walk's first pages, touched without looking their ids up: the same as by id.
    one.treecore.touch_walk(one.treecore.walk(data(1, 2, 3)), 2, +1, stamp=True)
    other.treecore.touch(ids[:2], +1, stamp=True)
    assert [one.treecore.view(i) for i in ids] == [other.treecore.view(i) for i in ids]
    assert one.digest.value == other.digest.value
    for core in (one, other):
        core.treecore.touch(ids[:2], -1)
    one.treecore.settle(ids, storage=StorageState.WRITING, host_pins=+1)
    for node_id in ids:
        other.treecore.update(node_id, storage=StorageState.WRITING, host_pins=+1)
    assert [one.treecore.view(i) for i in ids] == [other.treecore.view(i) for i in ids]
    assert one.digest.value == other.digest.value


def test_touch_by_ids_in_any_order_equals_update_node_by_node():
    """A path is found by following parents up from its last page; ids that are no path (two
    branches, a page twice, a path backwards, an id not in the tree) touch what one by one does."""
    one, other = cached((1, 2, 3), (1, 4, 5)), cached((1, 2, 3), (1, 4, 5))
    a, b = one.treecore.walk_ids(data(1, 2, 3)), one.treecore.walk_ids(data(1, 4, 5))
    ids = [a[0], b[1], a[2], a[2], *reversed(b), a[1], *a]
    one.treecore.touch(ids, +1, stamp=True, hit=True)
    for node_id in ids:
        other.treecore.update(node_id, device_pins=+1, stamp=True, hit=True)
    assert [one.treecore.view(i) for i in a + b] == [other.treecore.view(i) for i in a + b]
    assert one.digest.value == other.digest.value
    with pytest.raises(KeyError):
        one.treecore.touch([a[0], a[1], max(a + b) + 100, a[2]], -1)  # inside a path found from its end


def test_touch_returns_the_pages_it_finds_with_no_copy_in_order():
    core = CacheCore(CacheConfig(page_size=P, device_pages=16))  # on device only
    lease, _ = core.lock(toks(1, 2, 3))
    core.insert(lease, toks(1, 2, 3), core.alloc(lease, 3))
    core.release(lease)
    tc = core.treecore
    ids = tc.walk_ids(data(1, 2, 3))
    tc.touch(ids[1:], +1)  # pinned while their copies go (as a failed load leaves them)
    for node_id in (ids[2], ids[1]):
        core.ledger.free_device_copy(core.tree.nodes[node_id])
    assert tc.unresident(ids) == ids[1:]
    assert tc.touch(ids[1:], -1) == ids[1:] == tc.unresident(ids)
    tc.remove_empty(ids)
    assert [tc.exists(i) for i in ids] == [True, False, False]
    check(core)


def test_a_host_copy_is_idle_only_unpinned_valid_and_with_no_host_only_child():
    core = cached((1, 2))
    tc = core.treecore
    first, second = tc.walk_ids(data(1, 2))
    assert tc.host_copy_idle(first) and tc.host_copy_idle(second) and not tc.host_copy_idle(ROOT)
    tc.update(second, host_pins=+1)
    assert not tc.host_copy_idle(second) and tc.host_copy_idle(first)
    tc.update(second, host_pins=-1)
    core.evict_device(1)  # the second page is host-only now: its parent's slot still anchors it
    assert tc.device(second)[0] == DeviceState.NONE and not tc.host_copy_idle(first)


def test_freeing_and_removing_by_id_keeps_every_invariant():
    core = cached((1, 2, 3))
    tc = core.treecore
    ids = tc.walk_ids(data(1, 2, 3))
    free_slots = core.host.available
    core.evict_device(3)  # host-only now
    tc.free_host_copy(ids[-1])
    assert tc.host(ids[-1]) == (HostState.NONE, -1) and core.host.available == free_slots + 1
    tc.remove_if_empty(ids[-1])
    assert not tc.exists(ids[-1]) and tc.exists(ids[-2])
    tc.remove_empty(ids)  # the rest hold host copies: they stay; the removed id is skipped
    assert [tc.exists(i) for i in ids] == [True, True, False]
    check(core)


def test_the_path_on_device_is_the_path_union_filtered_to_device():
    core = cached((1, 2, 3), (1, 2, 4), (1, 5))
    tc = core.treecore
    core.evict_device(2)  # two leaves live on in host only
    ends = [tc.walk_ids(data(*p))[-1] for p in ((1, 2, 3), (1, 2, 4), (1, 5))]
    union = tc.path_union(ends)
    assert tc.path_on_device(ends) == tc.ids_on_device(union) != union


def test_the_load_rule_counts_valid_then_on_device_then_host_only_pages():
    core = cached((1, 2, 3, 4))
    tc = core.treecore
    ids = tc.walk_ids(data(1, 2, 3, 4))
    assert tc.load_reach(ids) == (4, 4, 4, -1) and tc.resident_prefix(ids) == 4
    core.evict_device(2)  # the last two pages live on in host only
    assert tc.load_reach(ids) == (2, 2, 4, -1) and tc.resident_prefix(ids) == 4
    lease, _ = core.lock(toks(1, 2, 3, 4))
    core.load(lease)  # the third and fourth pages are loading now
    assert [tc.device(i)[0] for i in ids] == [DeviceState.VALID] * 2 + [DeviceState.LOADING] * 2
    assert tc.load_reach(ids) == (2, 4, 4, 2)  # a shared load: nothing under it would be loaded
    valid, on_device, reach, first = tc.load_reach(ids[:3])
    assert valid <= on_device <= reach <= 3 and first == 2
    drain(core)
    assert tc.load_reach(ids) == (4, 4, 4, -1)


def test_a_new_host_page_hangs_from_a_readable_node_and_takes_a_new_id():
    core = cached((1, 2))
    tc = core.treecore
    first, second = tc.walk_ids(data(1, 2))
    assert tc.readable(ROOT) and tc.readable(second)
    tokens = data(3)
    page_hash_ = page_hash(tc.page_hashes([second])[0], tokens, core.tree.seed)
    slot = core.host.alloc(1)[0]
    new = tc.add_host_page(second, tokens, page_hash_, slot)
    assert new > max(first, second) and tc.parent_of(new) == second and tc.walk_ids(data(1, 2, 3))[-1] == new
    assert tc.host(new) == (HostState.WRITING, slot) and tc.device(new) == (DeviceState.NONE, -1)
    assert not tc.readable(new) and tc.resident_prefix(tc.walk_ids(data(1, 2, 3))) == 3
    assert tc.unresident([first, second, new]) == []
    tc.update(new, host=(HostState.NONE, -1))
    core.host.free([slot])
    assert tc.unresident([first, second, new]) == [new]
    tc.remove_if_empty(new)
    assert not tc.exists(new) and tc.exists(second)
    check(core)


def test_a_host_mirror_may_go_only_redundant_with_no_host_only_child_least_valuable_first():
    core = cached((1, 2, 3), (1, 5), storage=True)
    drain(core)
    tc = core.treecore
    ids = tc.walk_ids(data(1, 2, 3)) + tc.walk_ids(data(1, 5))[1:]
    assert [tc.storage(i) for i in ids] == [StorageState.DURABLE] * 4 and tc.releasable_mirrors(0) == []
    assert all(tc.mirror_releasable(i) for i in ids) and not tc.mirror_releasable(ROOT)
    key = core.candidates.policy.key
    assert tc.releasable_mirrors(10) == sorted(ids, key=lambda i: key(core.tree.nodes[i]))
    assert tc.releasable_mirrors(2) == tc.releasable_mirrors(10)[:2]
    before = tc.hit_counts(ids)
    assert before == [tc.view(i).hits for i in ids]
    core.release(core.lock(toks(1, 2))[0])
    assert tc.hit_counts(ids) == [before[0] + 1, before[1] + 1, *before[2:]]
    core.evict_device(1)  # the leaf (1, 2, 3) lives on in host only: its parent's device copy must stay
    assert tc.device(ids[2])[0] == DeviceState.NONE and not tc.mirror_releasable(ids[2])
    assert not tc.mirror_releasable(ids[1]) and tc.mirror_releasable(ids[0]) and tc.mirror_releasable(ids[3])
    assert sorted(tc.releasable_mirrors(10)) == [ids[0], ids[3]]
    check(core)


def test_a_components_host_mirror_may_go_only_on_device_and_durable_by_its_own_key():
    from tests.unit.test_hybrid import MAMBA, SWA, hybrid, put
    from tests.unit.test_hybrid import toks as htoks

    core = hybrid(host_pages=16, swa_host_pages=16, mamba_host_states=16, write_policy="write_through", storage=True)
    put(core, htoks(1, 2, 3, 4))
    drain(core)
    tc = core.treecore
    ids = tc.walk_ids(as_token_bytes(htoks(1, 2, 3, 4)))
    swa = [tc.part_mirror_releasable(i, SWA) for i in ids]
    assert swa == [False, False, True, True]  # the SWA behind the window left device: no mirror there
    for part in (SWA, MAMBA):
        p = core.ledger.parts[part]
        found = [i for i in ids if tc.part_mirror_releasable(i, part)]
        assert tc.releasable_part_mirrors(part, 10) == sorted(found, key=lambda i: p.key(core.tree.nodes[i]))
        assert tc.releasable_part_mirrors(part, 1) == tc.releasable_part_mirrors(part, 10)[:1]
        assert tc.releasable_part_mirrors(part, 0) == []
    check(core)
