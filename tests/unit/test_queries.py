"""The core's queries for outside callers (``tpcache.core.queries``): each answers what its docstring
says, in plain values, held against the core's own state through a request's life."""

from tpcache.core import CacheConfig, CacheCore, OpKind, check
from tpcache.core.queries import PrefetchProgress
from tpcache.core.tiers import DeviceState
from tpcache.replay import drain

P = 4


def toks(*pages: int) -> list[int]:
    return [v * 10 + i for v in pages for i in range(P)]


def _plain(value: object) -> bool:
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return value is None or type(value) in (bool, int, str)


def test_queries_follow_a_request_through_backup_eviction_and_load():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8, write_policy="write_through"))
    assert core.is_empty() and core.ops_in_flight() == 0 and core.lease_count() == 0
    lease, m = core.lock(toks(1, 2, 3))
    assert core.has_lease(lease) and core.lease_count() == 1 and not core.is_empty()
    pages = core.alloc(lease, 3)
    assert core.lease_pages(lease) == tuple(pages)
    assert core.prefetch_progress(lease) is None and core.prefetch_status(lease) == ("none", 0)
    core.insert(lease, toks(1, 2, 3), pages)
    assert core.lease_pages(lease) == ()  # the tree adopted them
    # write-through: a backup of the three pages is in flight, their host copies being written
    assert core.ops_in_flight() == 1 and core.ops_in_flight_by_kind() == {"BACKUP": 1}
    (backup,) = core.outbox.inflight[OpKind.BACKUP]
    assert core.op_in_flight(OpKind.BACKUP, backup.op_id) and not core.op_in_flight(OpKind.LOAD, backup.op_id)
    assert [core.host_filling(toks(1, 2, 3), i) for i in range(4)] == [True, True, True, False]
    assert core.valid_device_pages() == set(pages) and core.pages_in_use() == (3, 3, 0)  # host slots being written
    assert core.device_valid_prefix(lease, 8) == tuple(pages) and core.device_valid_prefix(lease, 2) == tuple(pages[:2])
    core.release(lease)
    drain(core)
    assert core.ops_in_flight() == 0 and core.ops_in_flight_by_kind() == {}
    assert not core.op_in_flight(OpKind.BACKUP, backup.op_id) and not core.host_filling(toks(1, 2, 3), 0)
    assert not core.has_lease(lease) and core.lease_count() == 0
    device, host, storage = core.tier_hashes()
    assert device == host == set(m.page_hashes[:3]) and storage == set()

    core.evict_device(3)  # the pages live on in host only
    assert core.valid_device_pages() == set()
    lease, m = core.lock(toks(1, 2, 3))
    assert (m.device_pages, m.host_pages) == (0, 3) and core.device_valid_prefix(lease, 8) == ()
    loaded = core.load(lease)
    assert core.lease_loading(lease) and len(core.lease_ops(lease)) == 1
    assert core.ops_in_flight_by_kind() == {"LOAD": 1} and core.device_valid_prefix(lease, 8) == ()
    drain(core)
    assert not core.lease_loading(lease) and core.lease_ops(lease) == ()
    assert core.device_valid_prefix(lease, 8) == tuple(loaded)
    valid = {n.device_page for n in core.tree.nodes.values() if n.device_state == DeviceState.VALID}
    assert core.valid_device_pages() == valid == set(loaded)
    core.release(lease)
    check(core)
    answers = [core.tier_hashes(), core.ops_in_flight_by_kind(), core.lease_ops(core.lock(toks(1))[0])]
    assert all(_plain(a) for a in answers)


def test_prefetch_progress_names_the_prefetch_state():
    core = CacheCore(CacheConfig(page_size=P, device_pages=8, host_pages=8, storage=True))
    lease, _ = core.lock(toks(1, 2))
    assert core.prefetch(lease)  # nothing cached: look both pages up in storage
    assert core.prefetch_progress(lease) == PrefetchProgress("querying", 0, 0, 0, 0)
    assert core.ops_in_flight_by_kind() == {"STORAGE_QUERY": 1}
    assert not core.storage_down() and core.admission_queue() == []
    admitted, _ = core.admit(toks(5, 6))
    assert core.admission_queue() == [admitted]
    assert _plain(tuple(core.prefetch_progress(lease)))
