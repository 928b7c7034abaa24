"""Sequenced ops as data (``tpcache.engine.sequenced``): one dispatch table, plain arguments."""

from array import array

import pytest

from tpcache.core import CacheConfig
from tpcache.core.admission import Shape
from tpcache.engine.sequenced import APPLY, Op, plain, register
from tpcache.testing.sim import Faults, SimCluster


def _rank():
    config = CacheConfig(page_size=4, device_pages=8, host_pages=8, write_policy="write_through")
    return SimCluster(seed=1, ranks=1, config=config, faults=Faults(max_delay=0)).ranks[0]


def test_an_op_is_applied_through_the_table_and_seen_by_the_trace_first():
    rank = _rank()
    seen: list[tuple[Op, int]] = []
    rank.driver.trace = lambda op: seen.append((op, rank.core.lease_count()))
    lease, _ = rank.lock(array("i", range(8)))
    pages = rank.alloc(lease, 2)  # Operations.alloc: the same op as the record below
    more = rank.driver.apply(Op("alloc", (lease, 1, 0)))
    assert rank.core.lease_pages(lease) == (*pages, *more) and len(set(pages + more)) == 3
    assert [(op.kind, n) for op, n in seen] == [("lock", 0), ("alloc", 1), ("alloc", 1)]
    assert seen[1][0] == Op("alloc", (lease, 2, 0))
    assert seen[0][0].plain() == ["lock", [list(range(8))]]
    assert rank.driver.seq == 3


def test_an_unknown_op_is_refused_before_it_counts():
    rank = _rank()
    with pytest.raises(ValueError, match="no sequenced op 'evict_all'"):
        rank.driver.apply(Op("evict_all", (1,)))
    assert rank.driver.seq == 0
    with pytest.raises(ValueError, match="is built in"):
        register("lock", lambda driver, tokens: None)
    assert {"lock", "insert", "release", "request_flush", "set_feature"} <= set(APPLY)


def test_plain_turns_arguments_into_msgpack_types():
    assert plain((3, array("i", [1, 2]), memoryview(b"ab"), {1: (4,)}, None)) == [3, [1, 2], b"ab", {1: [4]}, None]
    assert plain(Shape(5, 2, 1, True)) == [5, 2, 1, True]
    with pytest.raises(TypeError, match="plain data, not object"):
        plain(object())
