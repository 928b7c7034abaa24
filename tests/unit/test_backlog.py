"""The backup backlog costs a round only what can be done: no host tier means no backups at all,
and a full host tier with nothing to evict leaves the backlog untouched (not re-scanned each round)."""

from tpcache.core import CacheConfig, CacheCore, OpKind, check
from tpcache.replay import drain

P = 2


def insert(core: CacheCore, pages: int) -> None:
    tokens = list(range(pages * P))
    lease, m = core.lock(tokens)
    core.insert(lease, tokens, core.alloc(lease, m.num_pages))
    core.release(lease)


def test_without_a_host_tier_nothing_is_backed_up_or_queued() -> None:
    core = CacheCore(CacheConfig(page_size=P, device_pages=32, host_pages=0, write_policy="write_through"))
    insert(core, 12)
    core.after_commit()
    assert not core.backup_backlog and core.host_deficit == 0
    assert not core.inflight[OpKind.BACKUP]
    assert core.stats.backup_deferred_host_full == 0
    check(core)


def test_a_full_host_tier_with_nothing_to_evict_leaves_the_backlog_alone() -> None:
    core = CacheCore(CacheConfig(page_size=P, device_pages=32, host_pages=3, write_policy="write_through"))
    insert(core, 8)  # 3 backups in flight (their slots are WRITING: not evictable), 5 waiting
    assert len(core.inflight[OpKind.BACKUP]) == 1 and core.host.available == 0
    waiting = list(core.backup_backlog)
    deferred = core.stats.backup_deferred_host_full
    assert len(waiting) == 5 and core.host_deficit == 5
    for _ in range(3):
        core.after_commit()
    assert list(core.backup_backlog) == waiting  # same pages, same order: nothing retried
    assert core.stats.backup_deferred_host_full == deferred
    check(core)
    # once the copies land, the host slots hold copies of device pages, which host eviction never
    # takes alone: the backlog keeps waiting, in order, until a device eviction frees a slot
    drain(core)
    core.after_commit()
    assert list(core.backup_backlog) == waiting
    assert not core.ledger.mirrors  # no storage tier: nothing is durable, mirror release has nothing
    assert core.evict_device(1) == 1  # the deepest page, waiting in the backlog: it leaves it
    core.after_commit()
    assert list(core.backup_backlog) == waiting[:-1] and not core.inflight[OpKind.BACKUP]
    check(core)
