"""Property tests: random operation streams keep every invariant, and equal inputs give equal state."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tpcache.core import CacheConfig, CacheCore, OpKind, check
from tpcache.core.tiers import DeviceState, HostState
from tpcache.testing.ops import apply, take_transfers, tokens_for

PAGE = 4

lock_op = st.tuples(
    st.just("lock"), st.lists(st.integers(0, 3), min_size=1, max_size=6).map(tuple), st.integers(0, PAGE - 1)
)
lease_op = st.tuples(st.sampled_from(["insert", "load", "release"]), st.integers(0, 7))
misc_op = st.one_of(
    st.tuples(st.just("evict"), st.integers(1, 4)),
    st.tuples(st.just("cap"), st.sampled_from([-1, 0, PAGE, 4 * PAGE])),
    st.tuples(st.just("complete"), st.sampled_from(list(OpKind)), st.one_of(st.none(), st.integers(0, 3))),
)
ops = st.lists(st.one_of(lock_op, lease_op, lease_op, misc_op), max_size=80)
configs = st.builds(
    CacheConfig,
    page_size=st.just(PAGE),
    device_pages=st.integers(2, 12),
    host_pages=st.sampled_from([0, 4, 16]),
    write_policy=st.sampled_from(["none", "write_through", "write_through_selective", "write_back"]),
    eviction_policy=st.sampled_from(["lru", "lfu", "fifo"]),
)


QUERIES = [tokens_for(pages, PAGE, 0) for pages in ((0, 1, 2, 3), (1, 1, 1), (0, 0), (2, 3, 0, 1, 2, 3))]


def match_is_consistent(core: CacheCore, tokens: list[int]) -> None:
    """The page ids a match copies from the run caches are those of its nodes, right now."""
    m = core.match(tokens)
    assert m.device_page_ids == core.treecore.device_pages(m.nodes[: m.device_pages])


def run(config: CacheConfig, stream: list) -> CacheCore:
    core = CacheCore(config)
    leases: list = []
    for op in stream:
        if op[0] == "complete":
            if core.inflight[op[1]]:
                core.complete(op[1], op[2])
                core.enforce_retention()
        else:
            apply(core, op, leases)
        take_transfers(core)
        check(core)
        for query in QUERIES:  # fills the run caches between ops, so later ops must keep them right
            match_is_consistent(core, query)
    return core


@settings(max_examples=300, deadline=None)
@given(configs, ops)
def test_random_streams_keep_invariants_and_digests_agree(config, stream):
    a = run(config, stream)
    b = run(config, stream)
    assert a.digest.value == b.digest.value
    assert a.clock == b.clock


@settings(max_examples=100, deadline=None)
@given(configs, ops)
def test_draining_everything_returns_every_page(config, stream):
    core = run(config, stream)
    for lease_id in list(core.leases):
        core.release(lease_id)
    for kind in OpKind:
        while core.inflight[kind]:
            core.complete(kind)
    check(core)
    assert not core.leases
    # Whatever remains cached is evictable to the last page.
    core.evict_device(config.device_pages)
    core.evict_host(config.host_pages)
    check(core)
    if config.write_policy != "write_back" or not config.host_pages:
        assert core.device.used == 0


def test_hits_never_point_at_pages_that_are_not_valid():
    rng = random.Random(7)
    core = CacheCore(CacheConfig(page_size=PAGE, device_pages=8, host_pages=8))
    leases: list = []
    for _ in range(2000):
        apply(core, ("lock", tuple(rng.randrange(3) for _ in range(rng.randint(1, 5))), 0), leases)
        apply(core, ("insert", rng.randrange(8)), leases)
        if rng.random() < 0.5:
            apply(core, ("release", rng.randrange(8)), leases)
        if rng.random() < 0.3 and core.inflight[OpKind.BACKUP]:
            core.complete(OpKind.BACKUP)
        m = core.match(tokens_for(tuple(rng.randrange(3) for _ in range(4)), PAGE, 0))
        hit = [core.tree.nodes[i] for i in m.nodes]
        assert m.device_page_ids == [n.device_page for n in hit[: m.device_pages]]
        for node in hit[: m.device_pages]:
            assert core.device.is_owned(node.device_page) and node.device_state == DeviceState.VALID
        for node in hit[m.device_pages :]:
            assert node.host_state == HostState.VALID
        check(core)
