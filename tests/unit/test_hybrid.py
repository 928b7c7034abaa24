"""Hybrid models in the core: SWA pages and Mamba states beside full-attention pages, each with its
own pools, pins, stamps and rules (the seed 001 and 004 rules), one promise per test."""

import copy

import pytest

from tpcache.comm.collective import elementwise_min
from tpcache.core import CacheConfig, CacheCore, InvariantViolation, OpKind, OutOfPages, check
from tpcache.core.hashing import as_token_bytes
from tpcache.core.round import Round
from tpcache.core.tiers import DeviceState, HostState
from tpcache.core.treecore.accounting import record_of
from tpcache.core.treecore.components import DEV, DPINS, DSLOT, FIELD_NAMES, HOST, STAMP, STRIDE
from tpcache.replay import drain as replay_drain
from tpcache.testing.ops import part_slots

P = 2
SWA, MAMBA = 1, 2


def toks(*pages: int) -> list[int]:
    return [v * 100 + d * 10 + i for d, v in enumerate(pages) for i in range(P)]


def hybrid(**kw) -> CacheCore:
    base = dict(
        page_size=P,
        device_pages=32,
        host_pages=0,
        write_policy="none",
        swa_window=2 * P,  # two pages
        swa_device_pages=32,
        mamba_every=1,
        mamba_device_states=32,
    )
    return CacheCore(CacheConfig(**{**base, **kw}))


def put(core: CacheCore, tokens: list[int], release: bool = True) -> int:
    """A request: lock, load host hits, compute the rest (full pages and component data), insert."""
    lease, m = core.lock(tokens)
    have = m.device_page_ids
    if m.host_pages:
        have = core.load(lease)
        drain(core)
    fresh = core.alloc(lease, m.num_pages - len(have))
    core.insert(lease, tokens, have + fresh, part_slots(core, lease, len(have), m.page_hashes))
    if release:
        core.release(lease)
    check(core)
    return lease


def drain(core: CacheCore) -> None:
    replay_drain(core)
    check(core)


def nodes(core: CacheCore, tokens: list[int]):
    return core.tree.walk(as_token_bytes(tokens)).nodes


def state(node, part: int, field: int) -> int:
    return node.comp[(part - 1) * STRIDE + field]


# ---------------------------------------------------------------- configuration


def test_configuration_declares_components_in_a_fixed_order():
    cfg = CacheConfig(page_size=4, swa_window=10, swa_device_pages=8, mamba_every=-1, mamba_device_states=4)
    (swa, mamba) = cfg.components()
    assert (swa.index, swa.name, swa.window_pages, swa.device_slots) == (1, "swa", 3, 8)
    assert (mamba.index, mamba.name, mamba.every, mamba.device_slots) == (2, "mamba", -1, 4)
    assert CacheConfig().components() == ()
    with pytest.raises(ValueError, match="swa_device_pages"):
        CacheConfig(swa_window=4).validate()
    with pytest.raises(ValueError, match="mamba_every"):
        CacheConfig(mamba_every=-2, mamba_device_states=1).validate()


@pytest.mark.parametrize("differ", ["config", "kv_layout"])
def test_ranks_with_different_component_settings_close_in_their_first_round(differ):
    cores = [hybrid(), hybrid(swa_window=3 * P) if differ == "config" else hybrid()]
    layouts = ['{"swa": 1}', '{"swa": 2}'] if differ == "kv_layout" else ["", ""]
    rounds = [Round(c, kv_layout=lay) for c, lay in zip(cores, layouts, strict=True)]
    assert rounds[0].layout.fields == rounds[1].layout.fields  # one shape: the collective still runs
    reduced = elementwise_min([r.prepare(0, {}, 0, True) for r in rounds])
    for core, rnd in zip(cores, rounds, strict=True):
        rnd.commit(reduced)
        assert core.closed and "layout differs" in core.closed_reason


def test_a_full_attention_only_configuration_has_no_component_records():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, write_policy="none"))
    put(core, toks(1, 2))
    assert all(n.comp is None for n in core.tree.nodes.values())
    assert "host_deficit.swa" not in Round(core).layout.fields


# ---------------------------------------------------------------- the record and the ledger


@pytest.mark.parametrize("part", [SWA, MAMBA])
@pytest.mark.parametrize("field", range(STRIDE))
def test_every_component_field_is_in_the_record(part, field):
    core = hybrid()
    put(core, toks(1))
    (node,) = [n for n in core.tree.nodes.values() if n.parent is not None]
    other = copy.copy(node)
    other.comp = list(node.comp)
    other.comp[(part - 1) * STRIDE + field] += 3
    assert record_of(other) != record_of(node), FIELD_NAMES[field]


@pytest.mark.parametrize("field", [STAMP, DPINS, DSLOT])
def test_a_component_field_changed_behind_the_ledgers_back_fails_the_check(field):
    core = hybrid()
    put(core, toks(1, 2))
    node = nodes(core, toks(1, 2))[-1]
    node.comp[(SWA - 1) * STRIDE + field] += 1
    with pytest.raises(InvariantViolation):
        check(core)


# ---------------------------------------------------------------- the hit rule in lock and match


def test_a_hit_needs_the_swa_window_before_its_boundary():
    core = hybrid(mamba_every=0, swa_release_out_of_window=False)
    put(core, toks(1, 2, 3, 4, 5))
    path = nodes(core, toks(1, 2, 3, 4, 5))
    assert core.match(toks(1, 2, 3, 4, 5)).device_pages == 5
    core.ledger.free_part_device(path[3], core.ledger.parts[SWA])  # page 4 loses its SWA: a tombstone
    check(core)
    assert path[3].device_state == DeviceState.VALID  # the full page stays
    m = core.match(toks(1, 2, 3, 4, 5))
    assert m.device_pages == 3  # boundaries 4 and 5 read page 4's SWA; 3 reads pages 2..3
    assert m.parts[SWA] == [path[1].node_id, path[2].node_id]


def test_a_hit_ends_at_a_state_and_states_are_kept_where_configured():
    core = hybrid(swa_window=0, swa_device_pages=0, mamba_every=2)
    put(core, toks(1, 2, 3, 4, 5))
    kept = [state(n, 1, DEV) == DeviceState.VALID for n in nodes(core, toks(1, 2, 3, 4, 5))]
    assert kept == [False, True, False, True, False]
    assert core.match(toks(1, 2, 3, 4, 5)).device_pages == 4
    assert core.match(toks(1, 2, 3)).device_pages == 2
    end_only = hybrid(swa_window=0, swa_device_pages=0, mamba_every=-1)
    put(end_only, toks(1, 2, 3))
    put(end_only, toks(1, 2, 3, 4, 5))
    kept = [state(n, 1, DEV) == DeviceState.VALID for n in nodes(end_only, toks(1, 2, 3, 4, 5))]
    assert kept == [False, False, True, False, True]


def test_swa_stamps_are_refreshed_only_through_the_window_full_pages_along_the_path():
    core = hybrid(mamba_every=0, swa_release_out_of_window=False)
    put(core, toks(1, 2, 3, 4, 5))
    path = nodes(core, toks(1, 2, 3, 4, 5))
    before = [state(n, SWA, STAMP) for n in path]
    lease, m = core.lock(toks(1, 2, 3, 4, 5))
    assert m.device_pages == 5
    assert all(n.last_access == core.clock for n in path)  # full pages: the whole path
    after = [state(n, SWA, STAMP) for n in path]
    assert after[:3] == before[:3] and after[3:] == [core.clock] * 2  # SWA: the last two pages only
    assert [state(n, SWA, DPINS) for n in path] == [0, 0, 0, 1, 1]  # and only they are pinned
    core.release(lease)
    check(core)


def test_swa_eviction_follows_window_stamps_and_leaves_tombstones():
    core = hybrid(mamba_every=0, swa_device_pages=6, swa_release_out_of_window=False)
    put(core, toks(1, 2, 3, 4))
    put(core, toks(5, 6))  # newer than every page of 1..4; the SWA pool is full
    put(core, toks(1, 2, 3, 4))  # a hit at 4: only the window (pages 3, 4) is refreshed
    assert core.ledger.parts[SWA].device.available == 0
    lease, _ = core.lock(toks(7))
    core.alloc(lease, 2, SWA)
    old, new = nodes(core, toks(1, 2, 3, 4)), nodes(core, toks(5, 6))
    assert [state(n, SWA, DEV) == DeviceState.VALID for n in old + new] == [False, False, True, True, True, True]
    assert all(n.device_state == DeviceState.VALID for n in old)  # tombstones: the full pages stay
    assert core.match(toks(1, 2, 3, 4)).device_pages == 4
    assert core.match(toks(1, 2)).device_pages == 0
    core.release(lease)
    check(core)


def test_full_eviction_takes_the_nodes_components_with_it():
    core = hybrid(device_pages=4)
    put(core, toks(1, 2, 3, 4))
    swa, mamba = core.ledger.parts[SWA], core.ledger.parts[MAMBA]
    used = (swa.device.used, mamba.device.used)
    core.evict_device(1)
    check(core)
    assert (swa.device.used, mamba.device.used) == (used[0] - 1, used[1] - 1)


def test_a_mamba_state_of_an_inner_node_is_a_tombstone_a_leafs_takes_its_node():
    core = hybrid(swa_window=0, swa_device_pages=0, mamba_device_states=3)
    put(core, toks(1, 2, 3))  # states at 1, 2, 3; the pool is full
    lease, _ = core.lock(toks(9))
    core.alloc(lease, 1, 1)  # the oldest state goes: all have the same stamp, the deepest first: the leaf's
    assert len(nodes(core, toks(1, 2, 3))) == 2  # the leaf left the device with its state (no hit could end there)
    core.alloc(lease, 1, 1)
    assert len(nodes(core, toks(1, 2, 3))) == 1  # now a leaf itself: it goes whole too
    core.release(lease)
    core2 = hybrid(swa_window=0, swa_device_pages=0, mamba_device_states=3)
    put(core2, toks(1, 2, 3))
    lease, _ = core2.lock(toks(1, 2, 3))  # pins the leaf's state (the hit ends there), stamps it
    core2.alloc(lease, 1, 1)
    inner = nodes(core2, toks(1, 2, 3))
    assert len(inner) == 3 and state(inner[1], 1, DEV) == 0  # an inner node's state: a tombstone
    assert core2.match(toks(1, 2)).device_pages == 1 and core2.match(toks(1, 2, 3)).device_pages == 3
    core2.release(lease)
    check(core2)


# ---------------------------------------------------------------- out-of-window release (seed 001)


def test_a_requests_swa_behind_its_window_is_released_after_its_insert():
    core = hybrid(mamba_every=0, swa_window=3)  # 3 tokens: 2 pages of window, keep max(3, 2) = 2 pages
    put(core, toks(1, 2))
    lease = put(core, toks(1, 2, 3, 4, 5, 6, 7), release=False)
    path = nodes(core, toks(1, 2, 3, 4, 5, 6, 7))
    has = [state(n, SWA, DEV) == DeviceState.VALID for n in path]
    # pages 1..2 were the protected prefix (its lock's hit); 3..5 are its own, behind its window
    assert has == [True, True, False, False, False, True, True]
    assert core.stats.swa_released_pages == 3
    assert core.match(toks(1, 2, 3, 4, 5, 6, 7)).device_pages == 7
    assert core.match(toks(1, 2, 3, 4, 9)).device_pages == 2  # a branch behind the window: the prefix
    core.release(lease)
    check(core)


def test_out_of_window_release_keeps_the_window_before_the_last_state():
    core = hybrid(swa_window=2 * P, mamba_every=3)  # two pages of window, a state every 3 pages
    lease = put(core, toks(1, 2, 3, 4, 5, 6, 7, 8), release=False)
    path = nodes(core, toks(1, 2, 3, 4, 5, 6, 7, 8))
    assert [state(n, MAMBA, DEV) == DeviceState.VALID for n in path].index(True) == 2  # pages 3, 6
    has = [state(n, SWA, DEV) == DeviceState.VALID for n in path]
    # the last state is at page 6: its window (pages 5..6) stays beside the leaf's (pages 7..8)
    assert has == [False, False, False, False, True, True, True, True]
    core.release(lease)
    assert core.match(toks(1, 2, 3, 4, 5, 6, 7, 9)).device_pages == 6  # a later turn hits at the state
    check(core)


def test_out_of_window_release_keeps_a_page_when_the_window_is_smaller_than_a_page():
    core = hybrid(mamba_every=0, swa_window=1)
    lease = put(core, toks(1, 2, 3), release=False)
    has = [state(n, SWA, DEV) == DeviceState.VALID for n in nodes(core, toks(1, 2, 3))]
    assert has == [False, False, True]  # max(W, page size) = one page: the leaf keeps its SWA
    core.release(lease)


def test_out_of_window_release_spares_what_another_request_holds():
    core = hybrid(mamba_every=0, swa_window=2)  # one page of window, one kept
    lease, _ = core.lock(toks(1, 2, 3, 4, 5))
    pages = core.alloc(lease, 5)
    swa = core.alloc(lease, 5, SWA)
    core.insert(lease, toks(1, 2, 3), pages[:3], {SWA: swa[:3]})  # the first prefill chunk
    other, m = core.lock(toks(1, 2, 3))  # another request hits it: pins the SWA of page 3
    assert m.device_pages == 3
    assert [i for i, _ in core.part_slots(lease)[SWA]] == [2]  # the chunk's SWA behind the window went
    core.insert(lease, toks(1, 2, 3, 4, 5), pages, {SWA: [-1, -1] + swa[2:]})  # the second chunk
    has = [state(n, SWA, DEV) == DeviceState.VALID for n in nodes(core, toks(1, 2, 3, 4, 5))]
    assert has == [False, False, True, False, True]  # page 3 is the other's; page 5 is kept at the leaf
    core.release(lease)
    core.release(other)
    check(core)


def test_chunk_size_shrinks_under_swa_pressure_instead_of_refusing():
    core = hybrid(mamba_every=0, swa_device_pages=5, swa_window=2)
    lease, _ = core.lock(toks(1, 2, 3, 4, 5, 6, 7, 8))
    assert core.chunk_tokens(lease, 0, 4 * P) == 4 * P  # it fits
    core.alloc(lease, 3, SWA)  # the engine holds 3 SWA pages for its first chunk
    assert core.chunk_tokens(lease, 3 * P, 4 * P) == 2 * P  # page-aligned, what is left
    assert core.chunk_tokens(lease, 3 * P, 2 * P - 1) == 2 * P - 1  # a chunk that fits whole stays whole
    core.alloc(lease, 2, SWA)
    assert core.chunk_tokens(lease, 5 * P, 4 * P) == 0  # wait: nothing can be freed
    with pytest.raises(OutOfPages):
        core.alloc(lease, 1, SWA)  # and alloc agrees
    core.release(lease)
    check(core)


def test_chunk_size_holds_back_the_swa_its_host_hit_still_has_to_load():
    core = hybrid(mamba_every=0, swa_device_pages=4, host_pages=16, swa_host_pages=16, write_policy="write_through")
    put(core, toks(1, 2, 3))
    drain(core)  # backed up, SWA included
    core.evict_device(3)
    lease, m = core.lock(toks(1, 2, 3, 4, 5))
    assert (m.device_pages, m.host_pages) == (0, 3) and len(m.parts[SWA]) == 2
    free = core.ledger.parts[SWA].device.available + core.ledger.parts[SWA].evictable
    assert core.chunk_tokens(lease, 3 * P, 8 * P) == (free - 2) * P  # two slots stay for the window's load
    core.release(lease)


# ---------------------------------------------------------------- load-back and seed 004


def test_load_brings_back_the_window_and_the_state_of_the_hit():
    core = hybrid(host_pages=16, swa_host_pages=16, mamba_host_states=16, write_policy="write_through")
    put(core, toks(1, 2, 3, 4))
    drain(core)
    core.evict_device(4)
    assert core.match(toks(1, 2, 3, 4)).device_pages == 0
    lease, m = core.lock(toks(1, 2, 3, 4))
    assert m.host_pages == 4
    pages = core.load(lease)
    assert len(pages) == 4
    (op,) = core.inflight[OpKind.LOAD]
    moved = {pc.part: [core.tree.nodes[op.nodes[i]].depth for i in pc.index] for pc in op.parts}
    assert moved == {SWA: [3, 4], MAMBA: [4]}  # the window's SWA pages and the state at the boundary
    assert core.match(toks(1, 2, 3, 4)).device_pages == 0  # loading: nothing reads it early
    drain(core)
    assert core.match(toks(1, 2, 3, 4)).device_pages == 4
    slots = core.part_slots(lease)
    assert [i for i, _ in slots[SWA]] == [2, 3] and [i for i, _ in slots[MAMBA]] == [3]
    core.release(lease)
    check(core)


def test_release_waits_for_a_load_into_its_mamba_slot():
    core = hybrid(swa_window=0, swa_device_pages=0, host_pages=16, mamba_host_states=16, write_policy="write_through")
    put(core, toks(1, 2))
    drain(core)
    path = nodes(core, toks(1, 2))
    core.ledger.free_part_device(path[1], core.ledger.parts[1])  # the leaf's state left the device
    check(core)
    lease, m = core.lock(toks(1, 2))
    assert (m.device_pages, m.host_pages) == (1, 1)  # the state at page 2 is on host
    core.load(lease)
    (op,) = core.inflight[OpKind.LOAD]
    assert op.full_index == [] and [pc.part for pc in op.parts] == [1]  # the state alone moves
    slot = state(path[1], 1, DSLOT)
    assert state(path[1], 1, DEV) == DeviceState.LOADING
    assert not core.release(lease)  # parked: the load still writes into the state's slot
    assert core.ledger.parts[1].device.is_owned(slot)
    other, m2 = core.lock(toks(1, 2))  # a request matching the loading state does not read it
    assert (m2.device_pages, m2.host_pages) == (1, 0)
    core.release(other)
    drain(core)  # the load lands; the parked lease finishes
    assert not core.leases and core.match(toks(1, 2)).device_pages == 2
    check(core)


def test_a_load_a_component_pool_cannot_take_is_refused_and_changes_nothing():
    core = hybrid(mamba_every=0, swa_device_pages=3, host_pages=16, swa_host_pages=16, write_policy="write_through")
    put(core, toks(1, 2))
    drain(core)
    core.evict_device(2)
    lease, m = core.lock(toks(1, 2))
    blocker, _ = core.lock(toks(8))
    core.alloc(blocker, 3, SWA)  # every SWA slot is held
    before = (core.digest.value, core.device.used, core.ledger.parts[SWA].device.used)
    with pytest.raises(OutOfPages, match="swa device pool"):
        core.load(lease)
    assert (core.digest.value - 0, core.device.used, core.ledger.parts[SWA].device.used)[1:] == before[1:]
    core.release(blocker)
    core.release(lease)
    check(core)


# ---------------------------------------------------------------- backups, storage, mirrors, the cap


def test_backups_and_storage_write_out_move_every_component():
    core = hybrid(host_pages=16, swa_host_pages=16, mamba_host_states=16, write_policy="write_through", storage=True)
    put(core, toks(1, 2, 3))
    drain(core)
    for node in nodes(core, toks(1, 2, 3)):
        for part in (SWA, MAMBA):
            assert state(node, part, HOST) == HostState.VALID
            assert node.comp[(part - 1) * STRIDE + 4] == 2  # durable
    assert core.stats.part_backups_issued == 6


def test_a_component_backup_without_a_host_slot_waits_in_its_own_backlog():
    core = hybrid(mamba_every=0, host_pages=16, swa_host_pages=1, write_policy="write_through")
    put(core, toks(1, 2, 3))
    assert len(core.ledger.parts[SWA].backlog) == 2
    rnd = Round(core)
    vector = rnd.prepare(core.clock, {}, 0, True)
    assert rnd.layout.unpack(vector).lo["host_deficit.swa"] == 2


def test_the_retention_cap_counts_each_components_pool():
    core = hybrid(swa_release_out_of_window=False)
    put(core, toks(1, 2, 3))
    lease, _ = core.lock(toks(1, 2, 3))  # pins full pages and only the window's SWA and the state
    core.set_retention_cap(0)
    assert core.evictable_device_tokens == 0
    assert all(p.evictable == 0 for p in core.ledger.parts.values())
    check(core)
    core.release(lease)


def test_a_flush_keeps_each_components_slots_and_ranks_agree_on_them():
    a, b = hybrid(), hybrid()
    lease_a, _ = a.lock(toks(1, 2))
    lease_b, _ = b.lock(toks(1, 2))
    a.alloc(lease_a, 2, SWA)
    assert a.book.kept_digest != b.book.kept_digest  # a flush would keep different slots: no agreement
    b.alloc(lease_b, 2, SWA)
    assert a.book.kept_digest == b.book.kept_digest
    held = list(a.lease(lease_a).parts[SWA].pages)
    a.reset(a.outbox.next_op, a.book.next_lease)
    assert a.lease(lease_a).parts[SWA].pages == held  # the engine may still write them
    assert a.ledger.parts[SWA].device.available == 32 - 2
    check(a)


def test_engine_owned_pages_refuse_a_hybrid_configuration():
    core = hybrid(device_pages=0, host_pages=8)
    lease, _ = core.lock(toks(1, 2))
    with pytest.raises(ValueError, match="full-attention models only"):
        core.save(lease, toks(1, 2), [0, 1])
