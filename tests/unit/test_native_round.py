"""The round's kernels in C (``tpcache/core/_round.c``) against their Python references: the digest
of a list of ids, the completion queues' fields of the round vector, and the vector's (x, -x) pairs.
The simulator's schedules run the round end to end on whichever path is built."""

from __future__ import annotations

import random
from collections import deque

import pytest

from protocol.round_vector import RoundLayout, RoundVectorError
from tpcache.core import CacheConfig, CacheCore
from tpcache.core.digest import reference_mix_ids
from tpcache.core.records import OpKind, Transfer
from tpcache.core.round import Round, reference_queue_fields
from tpcache.core.tree import NATIVE_NODES

pytestmark = pytest.mark.skipif(not NATIVE_NODES, reason="the C extension is not built")

if NATIVE_NODES:
    from tpcache.core import _node


def test_the_digest_of_ids_matches_the_reference_at_every_length():
    rng = random.Random(5)
    # 0, 8 and 16 bytes, 17-128, 129-240, and the long hash over one and several 1 KiB blocks.
    for n in list(range(0, 40)) + [127, 128, 129, 130, 300]:
        for _ in range(5):
            ids = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(n)]
            assert _node.mix_ids(ids) == reference_mix_ids(ids), n
    assert _node.mix_ids((1, 2, 3)) == reference_mix_ids([1, 2, 3])  # any sequence, as array('q') takes
    for bad, error in (([1 << 63], OverflowError), ([-(1 << 63) - 1], OverflowError), ([1.0], TypeError)):
        with pytest.raises(error):
            reference_mix_ids(bad)
        with pytest.raises(error):
            _node.mix_ids(bad)


def _op(op_id: int, pages: int) -> Transfer:
    return Transfer(op_id, OpKind.BACKUP, [], [], [], [0] * pages)


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
        assert _node.queue_fields(queues, landed) == reference_queue_fields(queues, landed)


def test_the_queue_fields_refuse_what_the_reference_cannot_read():
    with pytest.raises(TypeError):
        _node.queue_fields([deque([_op(1, 1)])], [(1, 1)])  # landed must be a dict (the caller checks)
    with pytest.raises(AttributeError):
        _node.queue_fields([deque([object()])], {})
    with pytest.raises(TypeError):
        _node.queue_fields([deque([_op(1, 1)])], {1: "1"})


def test_the_vector_pairs_match_the_reference_and_leave_bad_values_to_it():
    layout = RoundLayout(tuple(f"f{i}" for i in range(6)))
    rng = random.Random(3)
    limit = (1 << 63) - 1
    for _ in range(200):
        values = [rng.choice([0, 1, -1, limit, -limit, rng.randrange(-limit, limit + 1)]) for _ in range(6)]
        assert _node.pack_pairs(values) == layout.pack_values(values)
    for bad in ([limit + 1], [-limit - 1], [1 << 80], [1.5], ["1"], [None]):
        assert _node.pack_pairs(bad) is None
    assert _node.pack_pairs((1, 2)) is None  # only a list: the round builds one

    # The round takes the reference's error, which names the field.
    rnd = Round(CacheCore(CacheConfig(page_size=4, device_pages=8)))
    values = [0] * len(rnd.layout.fields)
    values[rnd.layout.index("seq")] = limit + 1
    with pytest.raises(RoundVectorError, match="field seq"):
        rnd._pack(values)
    values[rnd.layout.index("seq")] = 7
    assert rnd._pack(values) == rnd.layout.pack_values(values)
