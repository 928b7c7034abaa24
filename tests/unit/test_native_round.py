"""The round's kernels in C (``tpcache/core/treecore/_round.c``) against their Python references: the digest
of a list of ids, the completion queues' fields of the round vector, the vector's (x, -x) pairs, and
whether a reduced vector is this rank's own.
(``tests/sim`` runs the round end to end on whichever of the two is built.)"""

from __future__ import annotations

import random
from array import array
from collections import deque

import pytest

from protocol.round_vector import RoundLayout, RoundVectorError
from tpcache.core import CacheConfig, CacheCore
from tpcache.core.digest import reference_mix_ids
from tpcache.core.records import OpKind, Transfer
from tpcache.core.round import Round, queue_fields, reference_queue_fields
from tpcache.core.treecore.tree import NATIVE_NODES

native = pytest.mark.skipif(not NATIVE_NODES, reason="the C extension is not built")

if NATIVE_NODES:
    from tpcache.core.treecore import _node


@native
def test_the_digest_of_ids_matches_the_reference_at_every_length():
    rng = random.Random(5)
    # 0, 8 and 16 bytes, 17-128, 129-240, and the long hash over one and several 1 KiB blocks.
    for n in list(range(0, 40)) + [127, 128, 129, 130, 300]:
        for _ in range(5):
            ids = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(n)]
            assert _node.mix_ids(ids) == reference_mix_ids(ids), n
    assert _node.mix_ids((1, 2, 3)) == reference_mix_ids([1, 2, 3])
    with pytest.raises(TypeError, match="list of ints"):
        _node.mix_ids(iter([1]))
    for bad, error in (([1 << 63], OverflowError), ([-(1 << 63) - 1], OverflowError), ([1.0], TypeError)):
        with pytest.raises(error):
            reference_mix_ids(bad)
        with pytest.raises(error):
            _node.mix_ids(bad)


def _op(op_id: int, pages: int) -> Transfer:
    return Transfer(op_id, OpKind.BACKUP, [], [], [], [0] * pages)


def _native_fields(queues: list, landed: object) -> list[int] | None:
    """The kernel's fields, from each queue's op ids and page counts (what ``queue_fields`` passes it)."""
    ids = [[op.op_id for op in q] for q in queues]
    return _node.queue_fields(ids, [[op.num_pages for op in q] for q in queues], landed)


@native
def test_the_queue_fields_match_the_reference_on_random_queues():
    rng = random.Random(11)
    for _ in range(400):
        next_id, queues, landed = rng.randrange(1, 1 << 40), [], {}
        for _ in range(5):
            queue: deque[Transfer] = deque()
            for _ in range(rng.choice([0, 0, 1, 2, 3, 40])):  # 40: past the kernel's inline buffers
                next_id += rng.randrange(1, 4)
                op = _op(next_id, rng.randrange(0, 6))
                queue.append(op)
                if rng.random() < 0.7:  # finished here: every page, or some of them
                    landed[op.op_id] = op.num_pages if rng.random() < 0.6 else rng.randrange(0, op.num_pages + 1)
            queues.append(queue)
        for stale in range(rng.randrange(3)):  # retired ops the I/O has not forgotten yet
            landed[stale + 1] = 1
        assert _native_fields(queues, landed) == reference_queue_fields(queues, landed)


@native
def test_odd_landed_counts_are_read_as_the_reference_reads_them():
    queues = [deque([_op(1, 2), _op(2, 1)])]
    for odd in (None, 1.0, "1", 1 << 70, True):  # None: not landed; the rest: the kernel hands over
        landed = {1: odd, 2: 1}
        assert queue_fields(queues, landed) == reference_queue_fields(queues, landed), odd
    assert _native_fields(queues, {1: "1"}) is None
    for bad in ([deque([object()])], [deque([Transfer(None, OpKind.LOAD, [], [], [], [])])]):
        for fields in (queue_fields, reference_queue_fields):  # no op id: both raise
            with pytest.raises((AttributeError, TypeError)):
                fields(bad, {})
    with pytest.raises(TypeError, match="an int"):
        _node.queue_fields([["1"]], [[1]], {})  # an op id that is not an int
    with pytest.raises(TypeError):
        _node.queue_fields([[1]], [[1]], [(1, 1)])  # a landed mapping that is not a dict takes the reference
    with pytest.raises(TypeError):
        _node.queue_fields([[1]], [[]], {})  # a page count per op


@native
def test_the_vector_pairs_match_the_reference_and_leave_bad_values_to_it():
    layout = RoundLayout(tuple(f"f{i}" for i in range(6)))
    rng = random.Random(3)
    limit = (1 << 63) - 1
    for _ in range(200):
        values = [rng.choice([0, 1, -1, limit, -limit, rng.randrange(-limit, limit + 1)]) for _ in range(6)]
        assert _node.pack_pairs(values) == array("q", layout.pack_values(values))
    for bad in ([limit + 1], [-limit - 1], [1 << 80], [1.5], ["1"], [None]):
        assert _node.pack_pairs(bad) is None
    assert _node.pack_pairs((1, 2)) is None  # only a list: the round builds one


def test_the_round_takes_its_own_vector_back_as_unanimous_on_either_path():
    """A one-rank round: the reduced vector is the rank's own whatever form it comes back in."""
    core = CacheCore(CacheConfig(page_size=4, device_pages=8))
    rnd = Round(core)
    for reduced in (list, tuple, lambda v: v):
        vector = rnd.prepare(0, {}, 0, True)
        report = rnd.commit(reduced(vector))
        assert report.mismatches == [] and report.closed_reason is None
    vector = rnd.prepare(0, {}, 0, True)
    other = vector.tolist()
    other[2] += 1  # another rank saw a different round number
    assert rnd.commit(other).mismatches == ["round"] and core.closed


def test_the_round_names_a_field_out_of_range_on_either_path():
    rnd = Round(CacheCore(CacheConfig(page_size=4, device_pages=8)))
    values = [0] * len(rnd.layout.fields)
    values[rnd.layout.index("seq")] = (1 << 63) - 1 + 1
    with pytest.raises(RoundVectorError, match="field seq"):
        rnd._pack(values)
    values[rnd.layout.index("seq")] = 7
    assert rnd._pack(values).tolist() == rnd.layout.pack_values(values)
