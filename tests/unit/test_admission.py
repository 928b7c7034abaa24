"""Admission in phases (select, materialize, commit) and buffer-only host mode, on one core."""

import pytest

from tpcache.core import AdmissionError, CacheConfig, CacheCore, IllegalAdmissionEvent, NotAdmitted, OpKind, check
from tpcache.core.admission import TRANSITIONS
from tpcache.core.hashing import as_token_bytes
from tpcache.core.records import ADMISSION_STATES
from tpcache.core.tiers import DeviceState, HostState, StorageState

P = 2


def toks(*pages: int) -> list[int]:
    return [v * 100 + d * 10 + i for d, v in enumerate(pages) for i in range(P)]


def core_of(mode: str = "buffer", **kw) -> CacheCore:
    cfg = {"page_size": P, "device_pages": 8, "host_pages": 4, "write_policy": "write_through", "storage": True}
    return CacheCore(CacheConfig(**{**cfg, "host_mode": mode, **kw}))


def nodes(core: CacheCore, tokens: list[int]) -> list:
    return core.tree.walk(as_token_bytes(tokens)).nodes


def cached(core: CacheCore, tokens: list[int]) -> None:
    """A request computes and inserts ``tokens``; its backups land and reach storage."""
    lease, _ = core.lock(tokens)
    core.insert(lease, tokens, core.alloc(lease, len(tokens) // P))
    core.release(lease)
    while core.inflight[OpKind.BACKUP] or core.inflight[OpKind.STORAGE_WRITE]:
        kind = OpKind.BACKUP if core.inflight[OpKind.BACKUP] else OpKind.STORAGE_WRITE
        core.complete(kind)
        core.after_commit()


def staged(core: CacheCore, tokens: list[int], hit: int) -> int:
    """Admit ``tokens`` with nothing cached; storage holds ``hit`` pages; the read lands in host."""
    lease, m = core.admit(tokens)
    assert m.device_pages == m.host_pages == 0
    assert core.materialize(lease, core.select(lease)).status == "again"  # the lookup is in flight
    core.complete(OpKind.STORAGE_QUERY, hit)
    core.after_commit()
    core.complete(OpKind.STORAGE_READ)
    core.after_commit()
    return lease


def no_hit_counted(core: CacheCore) -> bool:
    s = core.stats
    return s.device_hit_tokens == s.host_hit_tokens == s.storage_hit_tokens == 0 and s.admissions_committed == 0


# ---------------------------------------------------------------------- the state machine


def test_the_transition_table_covers_every_state_and_nothing_leaves_committed():
    assert set(TRANSITIONS) == set(ADMISSION_STATES)
    assert all(nxt in ADMISSION_STATES for row in TRANSITIONS.values() for nxt in row.values())
    assert TRANSITIONS["committed"] == {}


def test_calls_out_of_order_are_typed_errors():
    core = core_of("cache", storage=False)
    locked, _ = core.lock(toks(1))
    with pytest.raises(NotAdmitted):
        core.select(locked)
    lease, _ = core.admit(toks(1))
    with pytest.raises(IllegalAdmissionEvent):
        core.commit(lease)  # nothing materialized yet
    assert core.materialize(lease, core.select(lease)).status == "ready"
    with pytest.raises(IllegalAdmissionEvent):
        core.materialize(lease, core.select(lease))  # ready: commit next, not materialize again
    core.commit(lease)
    with pytest.raises(IllegalAdmissionEvent):
        core.commit(lease)
    check(core)


def test_buffer_mode_is_checked_when_configured():
    for bad in ({"storage": False}, {"host_pages": 0}, {"write_policy": "write_back"}, {"host_mode": "mirror"}):
        with pytest.raises(ValueError):
            core_of(**bad)


# ---------------------------------------------------------------------- buffer mode


def test_buffer_backups_free_their_host_slots_once_the_write_is_durable():
    core = core_of()
    lease, _ = core.lock(toks(1, 2))
    core.insert(lease, toks(1, 2), core.alloc(lease, 2))
    core.release(lease)
    assert core.host.used == 2  # staging: the backups on their way to storage
    core.complete(OpKind.BACKUP)
    core.after_commit()
    assert core.host.used == 2 and core.inflight[OpKind.STORAGE_WRITE]  # the write is not agreed yet
    assert core.match(toks(1, 2)).host_pages == 0
    core.complete(OpKind.STORAGE_WRITE)
    core.after_commit()
    assert core.host.used == 0
    for node in nodes(core, toks(1, 2)):
        assert (node.device_state, node.host_state, node.storage_state) == (
            DeviceState.VALID,
            HostState.NONE,
            StorageState.DURABLE,
        )
    assert core.stats.staging_freed_pages == 2
    check(core)


def test_a_failed_storage_write_frees_the_staging_slot_too():
    core = core_of()
    lease, _ = core.lock(toks(1))
    core.insert(lease, toks(1), core.alloc(lease, 1))
    core.release(lease)
    core.complete(OpKind.BACKUP)
    core.after_commit()
    core.complete(OpKind.STORAGE_WRITE, 0)  # some rank could not write it
    core.after_commit()
    assert core.host.used == 0 and nodes(core, toks(1))[0].storage_state == StorageState.NONE
    check(core)


def test_a_staged_read_is_never_a_host_hit_and_is_counted_only_at_commit():
    core = core_of()
    cached(core, toks(1, 2))
    core.evict_device(8)
    assert not nodes(core, toks(1, 2))  # nothing left on any tier; storage holds both pages
    lease = staged(core, toks(1, 2, 3), hit=2)
    assert core.host.used == 2
    for probe in (toks(1), toks(1, 2), toks(1, 2, 3)):
        assert core.match(probe).host_pages == 0  # staging is not a cached tier
    shape = core.select(lease)
    assert (shape.device_pages, shape.staged_pages, shape.extend_pages, shape.waiting) == (0, 2, 1, False)
    out = core.materialize(lease, shape)
    assert (out.status, out.reason) == ("again", "loading")
    assert no_hit_counted(core)
    core.complete(OpKind.LOAD)
    core.after_commit()
    assert core.host.used == 0  # the load was agreed complete: the staging slots are free
    out = core.materialize(lease, shape)
    assert out.status == "ready" and out.shape.device_pages == 2 and out.shape.extend_pages == 1
    assert no_hit_counted(core)
    admitted = core.commit(lease)
    assert (admitted.hit_pages, admitted.storage_tokens, admitted.device_tokens) == (2, 2 * P, 0)
    assert admitted.device_page_ids == [n.device_page for n in nodes(core, toks(1, 2))]
    s = core.stats
    assert (s.storage_hit_tokens, s.host_hit_tokens, s.device_hit_tokens, s.admissions_committed) == (2 * P, 0, 0, 1)
    core.release(lease)
    check(core)


def test_fewer_pages_than_planned_reselect_without_a_staged_hit():
    core = core_of()
    cached(core, toks(1, 2))
    core.evict_device(8)
    lease = staged(core, toks(1, 2), hit=2)
    planned = core.select(lease)
    assert core.materialize(lease, planned).status == "again"
    core.complete(OpKind.LOAD, 1)  # the second page did not land on every rank
    core.after_commit()
    out = core.materialize(lease, planned)
    assert (out.status, out.reason) == ("short", "fewer_arrived")
    again = core.select(lease)
    assert (again.device_pages, again.staged_pages) == (1, 0)
    assert core.materialize(lease, again).status == "ready"
    assert core.commit(lease).hit_pages == 1
    assert core.stats.storage_hit_tokens == P and core.stats.admission_reselects == 1  # never the planned 2
    core.release(lease)
    core.after_commit()
    assert core.host.used == 0  # the page that failed to load left its staging slot too
    check(core)


def test_more_than_planned_shrinks_the_extend_range():
    core = core_of("cache", storage=False)
    lease, _ = core.admit(toks(1, 2, 3))
    planned = core.select(lease)
    assert planned.planned_pages == 0 and planned.extend_pages == 3
    cached(core, toks(1, 2))  # another request computed the first two pages meanwhile
    out = core.materialize(lease, planned)
    assert out.status == "ready" and out.shape.device_pages == 2 and out.shape.extend_pages == 1
    assert nodes(core, toks(1, 2))[1].device_pins == 1  # pinned for the request: safe to use
    assert core.commit(lease).device_tokens == 2 * P


def test_cache_mode_counts_host_hits_and_storage_hits_apart():
    core = core_of("cache", host_pages=8)
    cached(core, toks(1, 2))
    core.evict_device(8)  # host keeps pages 1 and 2 (cache mode); storage holds both too
    lease, m = core.admit(toks(1, 2))
    assert m.host_pages == 2 and core.stats.host_hit_tokens == 0
    assert not core.inflight[OpKind.STORAGE_QUERY]  # nothing is missing: no lookup
    assert core.materialize(lease, core.select(lease)).reason == "loading"
    core.complete(OpKind.LOAD)
    core.after_commit()
    assert core.materialize(lease, core.select(lease)).status == "ready"
    admitted = core.commit(lease)
    assert (admitted.host_tokens, admitted.storage_tokens) == (2 * P, 0)


# ---------------------------------------------------------------------- staged holds


def test_a_parked_request_keeps_its_turn():
    core = core_of()
    cached(core, toks(1, 2))
    core.evict_device(8)
    first, _ = core.admit(toks(1, 2))
    second, _ = core.admit(toks(3))
    assert core.admitter.queue() == [first, second]
    assert core.materialize(first, core.select(first)).status == "again"
    assert core.materialize(second, core.select(second)).status == "again"  # its own (empty) lookup
    third, _ = core.admit(toks(4))
    assert core.admitter.queue() == [first, second, third]  # retries never move a request back


def test_the_device_prefix_under_a_parked_fetch_is_held_against_eviction():
    core = core_of()
    lease, _ = core.admit(toks(1, 2, 3))  # nothing cached when it locked: its lock pins nothing
    cached(core, toks(1))  # page 1 arrives on device afterwards, unpinned
    assert core.materialize(lease, core.select(lease)).status == "again"  # parked: the fetch is in flight
    core.evict_device(8)
    first = nodes(core, toks(1))[0]
    assert first.device_state == DeviceState.VALID and first.device_pins == 1  # the hold: this prefix only
    check(core)
    core.release(lease)  # parked until its lookups retire (the first, and the one re-issued from page 1)
    while core.inflight[OpKind.STORAGE_QUERY]:
        core.complete(OpKind.STORAGE_QUERY, 0)
    core.after_commit()
    assert lease not in core.leases and first.device_pins == 0


def test_a_request_past_its_deferral_cap_is_admitted_with_what_the_device_holds():
    core = core_of(admission_max_deferrals=2)
    cached(core, toks(1))
    lease, _ = core.admit(toks(1, 2, 3))
    for _ in range(2):
        assert core.materialize(lease, core.select(lease)).status == "again"
    out = core.materialize(lease, core.select(lease))
    assert out.status == "ready" and out.shape.device_pages == 1
    assert core.stats.admission_gave_up == 1 and core.prefetch_status(lease)[0] == "done"
    core.complete(OpKind.STORAGE_QUERY, 2)  # the abandoned lookup answers: stale, nothing is read
    core.after_commit()
    assert core.stats.prefetch_stale_completions == 1 and not core.inflight[OpKind.STORAGE_READ]
    assert core.commit(lease).hit_pages == 1 and core.stats.storage_hit_tokens == 0
    check(core)


def test_a_reissued_lookup_makes_the_earlier_ack_stale():
    core = core_of()
    cached(core, toks(1, 2, 3))
    core.evict_device(8)
    lease, _ = core.admit(toks(1, 2, 3))  # looks up from page 0
    cached(core, toks(1))  # the prefix it hangs from moved: page 1 is on device now
    assert core.materialize(lease, core.select(lease)).status == "again"
    assert core.stats.prefetch_reissued == 1 and len(core.inflight[OpKind.STORAGE_QUERY]) == 2
    core.complete(OpKind.STORAGE_QUERY, 3)  # the first lookup's ack: stale
    assert core.stats.prefetch_stale_completions == 1 and not core.inflight[OpKind.STORAGE_READ]
    core.complete(OpKind.STORAGE_QUERY, 2)  # the re-issued one, from page 1: pages 2 and 3
    core.after_commit()
    read = core.inflight[OpKind.STORAGE_READ][0]
    assert read.num_pages == 2 and core.tree.nodes[read.nodes[0]].parent is nodes(core, toks(1))[0]
    check(core)


def test_a_hybrid_model_is_refused_rather_than_admitted_past_its_hit_rule():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, swa_window=P, swa_device_pages=8))
    with pytest.raises(AdmissionError, match="full-attention"):
        core.admit(toks(1))
    assert not core.leases


def test_a_closed_cache_admits_with_no_hit_and_counts_none():
    core = core_of()
    cached(core, toks(1, 2))
    lease, _ = core.admit(toks(1, 2))
    core.close("a rank diverged")
    assert core.select(lease).planned_pages == 0
    out = core.materialize(lease, core.select(lease))
    assert out.status == "ready" and out.shape.device_pages == 0
    assert core.commit(lease).hit_pages == 0 and core.stats.device_hit_tokens == 0
    check(core)
